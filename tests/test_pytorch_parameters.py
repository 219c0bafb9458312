"""Triton's PyTorch backend conventions beyond inputs and outputs: the config's `parameters`, and a
model.pt that is not TorchScript. Each model is built here with torch and loaded by the real backend.

What a call runs under is seen from inside the model: its forward() calls an operator registered here
that reports the thread's graph-executor optimisation, grad mode and inference mode.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from despina.contract.errors import ConfigError
from despina.contract.keys import Keys
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.workers.backends import Instance, backend_class, pytorch_sharing
from despina.workers.runner import ModelRunner

torch = pytest.importorskip("torch")

CONFIG = '''
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_BOOL, dims: [ 3 ] } ]
'''


@torch.library.custom_op("despina_test::modes", mutates_args=())
def modes(x: torch.Tensor) -> torch.Tensor:
    flags = [torch._C._get_graph_executor_optimize(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    return torch.tensor([flags] * x.shape[0])


class Modes(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.despina_test.modes(x)


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) > 0


@pytest.fixture(scope="module")
def modes_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("modes") / "model.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Modes()).save(str(path))
    return path


def model(tmp_path: Path, name: str, parameters: dict[str, str], source: Path | None = None) -> Path:
    folder = tmp_path / name
    (folder / "1").mkdir(parents=True)
    text = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    (folder / "config.pbtxt").write_text(CONFIG + text)
    if source is not None:
        (folder / "1" / "model.pt").write_bytes(source.read_bytes())
    return folder


def load_backend(folder: Path) -> Any:
    spec = ModelSpec.from_config(load_model(folder).config)
    backend = backend_class("pytorch")(spec, folder / "1", Instance(f"{spec.name}_0"))
    backend.load()
    return backend


def seen_by_the_model(folder: Path) -> dict[str, bool]:
    backend = load_backend(folder)
    out = backend.execute({"INPUT__0": np.zeros((2, 1), np.float32)}, ["OUTPUT__0"])["OUTPUT__0"]
    backend.unload()
    assert out[0].tolist() == out[1].tolist()
    return dict(zip(("optimized", "grad", "inference_mode"), out[0].tolist()))


def test_by_default_a_call_is_optimized_and_in_inference_mode(modes_file: Path, tmp_path: Path) -> None:
    """Triton's current PyTorch backend starts every model with INFERENCE_MODE enabled (its README: "By
    default, the inference mode is enabled"; ModelState's constructor)."""
    assert seen_by_the_model(model(tmp_path, "plain", {}, modes_file)) == {
        "optimized": True, "grad": False, "inference_mode": True}


def test_disable_optimized_execution_reaches_the_model(modes_file: Path, tmp_path: Path) -> None:
    """Triton's DISABLE_OPTIMIZED_EXECUTION (its README's one documented parameter): the TorchScript graph
    executor runs unoptimised, for this model's calls only (the setting is per thread in torch)."""
    seen = seen_by_the_model(model(tmp_path, "unoptimized", {"DISABLE_OPTIMIZED_EXECUTION": "true"}, modes_file))
    assert seen == {"optimized": False, "grad": False, "inference_mode": True}
    assert torch._C._get_graph_executor_optimize()  # the calling thread's setting is left as it was
    assert seen_by_the_model(model(tmp_path, "optimized", {"DISABLE_OPTIMIZED_EXECUTION": "false"},
                                   modes_file))["optimized"]


def test_inference_mode_reaches_the_model(modes_file: Path, tmp_path: Path) -> None:
    seen = seen_by_the_model(model(tmp_path, "inference", {"INFERENCE_MODE": "true"}, modes_file))
    assert seen == {"optimized": True, "grad": False, "inference_mode": True}
    seen = seen_by_the_model(model(tmp_path, "no_inference", {"INFERENCE_MODE": "false"}, modes_file))
    assert seen == {"optimized": True, "grad": False, "inference_mode": False}


@pytest.mark.parametrize(("key", "value", "message"), [
    ("DISABLE_OPTIMIZED_EXECUTION", "maybe", "parameter DISABLE_OPTIMIZED_EXECUTION must be true or false, "
                                             "got 'maybe'"),
    ("INFERENCE_MODE", "", "parameter INFERENCE_MODE must be true or false, got ''"),
    ("ENABLE_CACHE_CLEANING", "2", "parameter ENABLE_CACHE_CLEANING must be true or false"),
    ("ENABLE_JIT_PROFILING", "yes please", "parameter ENABLE_JIT_PROFILING must be true or false"),
    ("INTRA_OP_THREAD_COUNT", "two", "parameter INTRA_OP_THREAD_COUNT must be an integer, got 'two'"),
])
def test_a_parameter_triton_would_refuse_is_the_load_error(modes_file: Path, tmp_path: Path, key: str,
                                                          value: str, message: str) -> None:
    """As in Triton, whose ParseParameter fails the load on a value it cannot read: never a model that runs
    without what its config asked for."""
    with pytest.raises(ConfigError, match=f"model 'bad': {message}"):
        load_backend(model(tmp_path, "bad", {key: value}, modes_file))


def test_process_wide_switches_are_taken_and_said_to_have_no_effect(modes_file: Path, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Triton flips these torch-wide (JIT, fuser, cuDNN) switches around each call, which would change every
    other model in a Despina worker; they load with a warning that names them, as does ENABLE_NVFUSER,
    which Triton and torch have dropped. The thread counts apply."""
    parameters = {"ENABLE_JIT_PROFILING": "false", "ENABLE_JIT_EXECUTOR": "false", "ENABLE_TENSOR_FUSER": "false",
                  "DISABLE_CUDNN": "true", "ENABLE_WEIGHT_SHARING": "true", "ENABLE_NVFUSER": "true",
                  "ENABLE_CACHE_CLEANING": "true", "INTRA_OP_THREAD_COUNT": "2", "INTER_OP_THREAD_COUNT": "-1"}
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="despina.backends.pytorch"):
            backend = load_backend(model(tmp_path, "switches", parameters, modes_file))
        assert torch.get_num_threads() == 2  # rather than the instance's 1
        backend.unload()
    finally:
        torch.set_num_threads(threads)
    seen = seen_by_the_model(model(tmp_path, "switches2", parameters, modes_file))
    assert seen == {"optimized": True, "grad": False, "inference_mode": True}
    warned = " ".join(r.getMessage() for r in caplog.records)
    for key in ("ENABLE_JIT_PROFILING", "ENABLE_JIT_EXECUTOR", "ENABLE_TENSOR_FUSER", "DISABLE_CUDNN",
                "ENABLE_NVFUSER"):
        assert key in warned
    assert "model 'switches'" in warned and "INTRA_OP_THREAD_COUNT" not in warned
    assert "ENABLE_WEIGHT_SHARING" not in warned  # it applies (below)


async def loaded_instances(folder: Path, count: int) -> tuple[ModelRunner, list[Any]]:
    spec = ModelSpec.from_config({**load_model(folder).config,
                                  "instance_group": [{"count": count, "kind": "KIND_CPU"}]})
    runner = ModelRunner(None, Keys("unused"), spec, 1, folder, "test")  # type: ignore[arg-type]
    await runner.load()
    return runner, list(runner.execution.backends)


async def test_weight_sharing_gives_the_instances_one_module(tmp_path: Path) -> None:
    """Triton's ENABLE_WEIGHT_SHARING (ModelState::LoadModel): the instances of a model on one device take
    the module the first one loaded; each answers. Without it each loads its own. The last instance to
    unload frees it: a later load reads the file again."""
    path = tmp_path / "linear.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Linear()).save(str(path))
    x = np.ones((1, 1), np.float32)
    runner, shared = await loaded_instances(model(tmp_path, "shared", {"ENABLE_WEIGHT_SHARING": "true"}, path), 3)
    assert shared[0].module is shared[1].module is shared[2].module
    answers = [b.execute({"INPUT__0": x}, ["OUTPUT__0"])["OUTPUT__0"].tolist() for b in shared]
    assert answers[0] == answers[1] == answers[2]
    first = shared[0].module
    await runner.execution.unload()
    _, again = await loaded_instances(tmp_path / "shared", 1)
    assert again[0].module is not first
    again[0].unload()
    _, own = await loaded_instances(model(tmp_path, "own", {"ENABLE_WEIGHT_SHARING": "false"}, path), 2)
    assert own[0].module is not own[1].module
    _, plain = await loaded_instances(model(tmp_path, "plain", {}, path), 2)  # Triton's default: off
    assert plain[0].module is not plain[1].module
    for backend in own + plain:
        backend.unload()


def test_a_load_that_fails_after_taking_a_shared_module_gives_it_back(modes_file: Path, tmp_path: Path) -> None:
    """A config whose inputs do not fit forward() fails the load; the module it took is not kept."""
    folder = model(tmp_path, "misfit", {"ENABLE_WEIGHT_SHARING": "true"}, modes_file)
    text = (folder / "config.pbtxt").read_text()
    (folder / "config.pbtxt").write_text(text.replace(
        'input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 1 ] } ]',
        'input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 1 ] }, '
        '{ name: "INPUT__1", data_type: TYPE_FP32, dims: [ 1 ] } ]'))
    with pytest.raises(ConfigError, match="the config gives 2 inputs"):
        load_backend(folder)
    assert not [key for key in pytorch_sharing._SHARED if key[0] == "misfit"]


# -- a model.pt that is not TorchScript ------------------------------------------------------------------


def saved(tmp_path: Path, what: str) -> Path:
    path = tmp_path / f"{what}.pt"
    module = Linear()
    if what == "module":
        torch.save(module, str(path))
    elif what == "state_dict":
        torch.save(module.state_dict(), str(path))
    elif what == "legacy":
        torch.save(module.state_dict(), str(path), _use_new_zipfile_serialization=False)
    elif what == "export":
        program = torch.export.export(module, (torch.zeros(2, 1),))
        with warnings.catch_warnings():  # it warns that the name does not end in .pt2
            warnings.simplefilter("ignore")
            torch.export.save(program, str(path))
    else:
        path.write_bytes(b"not a model")
    return path


@pytest.mark.parametrize(("what", "message"), [
    ("module", r"model.pt was written by torch.save\(\) \(a pickled nn.Module or state_dict\), not "
               r"TorchScript: save the model with torch.jit.script\(model\).save\(path\)"),
    ("state_dict", r"model.pt was written by torch.save\(\) \(a pickled nn.Module or state_dict\)"),
    ("legacy", r"model.pt was written by torch.save\(\) \(a pickled nn.Module or state_dict\)"),
    ("export", r"model.pt is a torch.export program, not TorchScript: name it model.pt2"),
    ("garbage", r"torch cannot load model.pt: PytorchStreamReader failed"),
])
def test_a_model_pt_that_is_not_torchscript_is_a_load_error_saying_what_it_is(tmp_path: Path, what: str,
                                                                              message: str) -> None:
    """Triton's backend loads model.pt with torch::jit::load; a torch.save() pickle is the usual mistake,
    and torch's own message for it is that the "checkpoint file is corrupted"."""
    folder = model(tmp_path, "wrong", {}, saved(tmp_path, what))
    with pytest.raises(ConfigError, match=f"model 'wrong': {message}"):
        load_backend(folder)


def test_a_torchscript_model_pt_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "linear.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Linear()).save(str(path))
    backend = load_backend(model(tmp_path, "linear", {}, path))
    assert backend.execute({"INPUT__0": np.ones((1, 1), np.float32)}, ["OUTPUT__0"])["OUTPUT__0"].shape == (1, 3)
    backend.unload()
