"""PyTorch: TorchScript and torch.export models through a real `despina serve`, and the backend alone.

Outputs are compared with what torch itself computes from the same file.
"""
from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from despina.contract.errors import ConfigError
from despina.contract.keys import Keys
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.examples import build_torch_export_mlp, build_torchscript_mlp, mlp_numpy
from despina.workers.backends import Instance, backend_class
from despina.workers.runner import ModelRunner

from .conftest import FULL_QUEUE_DELAY, Server, module_server, settled_stats
from .test_ragged import answers_of_one_batch

torch = pytest.importorskip("torch")

MLP_TORCHSCRIPT = '''
name: "mlp_torchscript"
platform: "pytorch_libtorch"
max_batch_size: 64
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 10 ] } ]
dynamic_batching { max_queue_delay_microseconds: 50000 }
'''
MLP_EXPORT = '''
name: "mlp_torch_export"
backend: "pytorch"
default_model_filename: "model.pt2"
max_batch_size: 64
input [ { name: "x", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 10 ] } ]
dynamic_batching { max_queue_delay_microseconds: 50000 }
instance_group [ { count: 2, kind: KIND_CPU } ]
'''
# Indexed names listed out of order: the index, not the listing, gives the position.
PAIR = '''
name: "pair"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  { name: "INPUT__1", data_type: TYPE_INT64, dims: [ 3 ] },
  { name: "INPUT__0", data_type: TYPE_INT64, dims: [ 3 ] }
]
output [
  { name: "OUTPUT__1", data_type: TYPE_INT64, dims: [ 3 ] },
  { name: "OUTPUT__0", data_type: TYPE_INT64, dims: [ 3 ] }
]
'''
# Names that are forward()'s argument names bind by name, whatever the config order.
NAMED = '''
name: "named"
backend: "pytorch"
default_model_filename: "model.pt2"
max_batch_size: 8
input [
  { name: "b", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "a", data_type: TYPE_FP32, dims: [ 2 ] }
]
output [ { name: "difference", data_type: TYPE_FP32, dims: [ 2 ] } ]
'''


# Ragged batching (workers/ragged.py): x comes flat, the requests end to end, and `ends` (a batch input,
# forward()'s first argument) says where each request's part ends; each request gets its sum.
RAGGED_SUM = '''
name: "ragged_sum"
platform: "pytorch_libtorch"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 2000000 }
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT, target_name: "ends", data_type: TYPE_INT32,
                source_input: "x" } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 1 ] } ]
'''

# A TorchScript model may return a List[str]: a TYPE_STRING output, one string per row of the batch.
LABELS = '''
name: "labels"
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 3 ] } ]
output [
  { name: "OUTPUT__0", data_type: TYPE_INT64, dims: [ 1 ], reshape: { shape: [ ] } },
  { name: "OUTPUT__1", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] } }
]
'''


class Labels(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        best = x.argmax(1)
        names = ["cat", "dog", "eel"]
        return best, [names[int(i)] for i in best]


class RaggedSum(torch.nn.Module):
    def forward(self, ends: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        prefix = torch.cat([torch.zeros(1, device=x.device), torch.cumsum(x, 0)])  # where the instance is
        upper = ends.long()
        lower = torch.cat([torch.zeros(1, dtype=torch.long, device=x.device), upper[:-1]])
        return (prefix[upper] - prefix[lower]).unsqueeze(1)


class Pair(torch.nn.Module):
    def forward(self, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return first * 10 + second, first - second


class DictDifference(torch.nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["x"] - inputs["y"]


class Difference(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b


def write_config(repo: Path, name: str, text: str) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(text)
    return folder


def build_pair(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Pair()).save(str(path))


def build_ragged_sum(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(RaggedSum()).save(str(path))


def build_labels(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Labels()).save(str(path))


def build_named(path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Difference(), (torch.zeros(2, 2), torch.zeros(2, 2)),
                                  dynamic_shapes={"a": {0: batch}, "b": {0: batch}})
    torch.export.save(program, str(path))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torch-repo")
    build_torchscript_mlp(write_config(root, "mlp_torchscript", MLP_TORCHSCRIPT) / "1" / "model.pt")
    build_torch_export_mlp(write_config(root, "mlp_torch_export", MLP_EXPORT) / "1" / "model.pt2")
    build_pair(write_config(root, "pair", PAIR) / "1" / "model.pt")
    build_named(write_config(root, "named", NAMED) / "1" / "model.pt2")
    build_ragged_sum(write_config(root, "ragged_sum", RAGGED_SUM) / "1" / "model.pt")
    build_labels(write_config(root, "labels", LABELS) / "1" / "model.pt")
    greet_model(write_config(root, "greet", GREET))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, repo: Path) -> Iterator[Server]:
    yield from module_server(repo, tmp_path_factory, redis_url,
                             ("mlp_torchscript", "mlp_torch_export", "pair", "named", "ragged_sum", "labels",
                              "greet"),
                             env=FULL_QUEUE_DELAY)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"), concurrency=16)
    yield c
    c.close()


def torchscript_output(path: Path, *args: np.ndarray) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(path))
    with torch.no_grad():
        return module(*(torch.from_numpy(a) for a in args))


def export_output(path: Path, *args: np.ndarray) -> Any:
    with warnings.catch_warnings():  # torch 2.11's loader warns about its own read-only buffers
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        module = torch.export.load(str(path)).module()
    with torch.no_grad():
        return module(*(torch.from_numpy(a) for a in args))


def fp32_input(name: str, array: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def test_torchscript_mlp_with_dynamic_batching(client: httpclient.InferenceServerClient, server: Server,
                                                repo: Path) -> None:
    rows = [np.random.default_rng(i).standard_normal((1 + i % 3, 256)).astype(np.float32) for i in range(12)]
    before = client.get_inference_statistics("mlp_torchscript")["model_stats"][0]["execution_count"]
    pending = [client.async_infer("mlp_torchscript", [fp32_input("INPUT__0", x)]) for x in rows]
    results = [p.get_result().as_numpy("OUTPUT__0") for p in pending]
    path = repo / "mlp_torchscript" / "1" / "model.pt"
    for x, y in zip(rows, results):
        np.testing.assert_allclose(y, torchscript_output(path, x).numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y, mlp_numpy(x), rtol=1e-4, atol=1e-5)
    stats = settled_stats(server.url, "mlp_torchscript")
    assert stats["inference_count"] >= sum(len(x) for x in rows)
    assert stats["execution_count"] - before < len(rows)  # requests shared executions


def test_torch_export_mlp_through_fn_and_tritonclient(client: httpclient.InferenceServerClient,
                                                      server: Server, repo: Path) -> None:
    x = np.random.default_rng(7).standard_normal((3, 256)).astype(np.float32)
    expected = export_output(repo / "mlp_torch_export" / "1" / "model.pt2", x).numpy()
    result = client.infer("mlp_torch_export", [fp32_input("x", x)]).as_numpy("y")
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    r = httpx.post(f"{server.url}/fn/mlp_torch_export", json=x[0].tolist())
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["y"], np.float32), expected[0], rtol=1e-5, atol=1e-6)


def test_indexed_names_bind_by_index(client: httpclient.InferenceServerClient, repo: Path) -> None:
    first = np.array([[1, 2, 3]], dtype=np.int64)
    second = np.array([[4, 5, 6]], dtype=np.int64)
    inputs = []
    for name, array in (("INPUT__0", first), ("INPUT__1", second)):
        tensor = httpclient.InferInput(name, [1, 3], "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer("pair", inputs)
    out0, out1 = torchscript_output(repo / "pair" / "1" / "model.pt", first, second)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), out0.numpy())
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), out1.numpy())
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), [[14, 25, 36]])


def test_forward_argument_names_bind_by_name(server: Server) -> None:
    r = httpx.post(f"{server.url}/fn/named", json={"b": [[1.0, 1.0]], "a": [[5.0, 7.0]]})
    assert r.status_code == 200, r.text
    assert r.json() == {"difference": [[4.0, 6.0]]}


def test_a_list_of_strings_is_a_string_output(client: httpclient.InferenceServerClient) -> None:
    """Triton's PyTorch backend answers a model's List[str] as a TYPE_STRING output."""
    result = client.infer("labels", [fp32_input("INPUT__0", np.array([[0, 0, 1], [1, 0, 0]], np.float32))])
    assert result.as_numpy("OUTPUT__1").tolist() == [[b"eel"], [b"cat"]]
    assert result.as_numpy("OUTPUT__0").tolist() == [[2], [0]]


def test_a_string_output_of_more_than_one_dimension_is_a_load_error(repo: Path, tmp_path: Path) -> None:
    folder = write_config(tmp_path, "labels2", LABELS.replace('"labels"', '"labels2"').replace(
        'TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] }', 'TYPE_STRING, dims: [ 1 ]'))
    (folder / "1" / "model.pt").write_bytes((repo / "labels" / "1" / "model.pt").read_bytes())
    with pytest.raises(ConfigError, match="output 'OUTPUT__1' is TYPE_STRING.*only one dimension"):
        load_backend(folder)


class Greet(torch.nn.Module):
    def forward(self, names: list[str], times: torch.Tensor) -> list[str]:
        out: list[str] = []
        for i in range(len(names)):
            out.append("".join([names[i] + "!" for _ in range(int(times[i]))]))
        return out


GREET = '''
platform: "pytorch_libtorch"
max_batch_size: 4
input [
  { name: "INPUT__0", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] } },
  { name: "INPUT__1", data_type: TYPE_INT64, dims: [ 1 ], reshape: { shape: [ ] } }
]
output [ { name: "OUTPUT__0", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] } } ]
'''


def greet_model(folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Greet()).save(str(folder / "1" / "model.pt"))
    return folder


def test_a_string_input_reaches_forward_as_a_list_of_str(tmp_path: Path) -> None:
    """Triton's PyTorch backend: a TYPE_STRING input of one dimension (the batch's here) is a List[str]."""
    backend = load_backend(greet_model(write_config(tmp_path, "greet", GREET)))
    names = np.array(["é".encode(), b"bo"], dtype=object)
    out = backend.execute({"INPUT__0": names, "INPUT__1": np.array([2, 1])}, ["OUTPUT__0"])["OUTPUT__0"]
    assert out.tolist() == ["é!é!".encode(), b"bo!"]
    backend.unload()


def test_string_inputs_through_tritonclient(client: httpclient.InferenceServerClient) -> None:
    names = httpclient.InferInput("INPUT__0", [2, 1], "BYTES")
    names.set_data_from_numpy(np.array([["ab"], ["c"]], dtype=object))
    times = httpclient.InferInput("INPUT__1", [2, 1], "INT64")
    times.set_data_from_numpy(np.array([[1], [2]], dtype=np.int64))
    result = client.infer("greet", [names, times])
    assert result.as_numpy("OUTPUT__0").tolist() == [[b"ab!"], [b"c!c!"]]


def test_a_string_input_without_batching_is_one_dimension(tmp_path: Path) -> None:
    config = GREET.replace("max_batch_size: 4", "max_batch_size: 0").replace(
        "dims: [ 1 ], reshape: { shape: [ ] }", "dims: [ -1 ]")
    backend = load_backend(greet_model(write_config(tmp_path, "greet0", config)))
    names = np.array([b"a", b"b", b"c"], dtype=object)
    out = backend.execute({"INPUT__0": names, "INPUT__1": np.array([1, 0, 3])}, ["OUTPUT__0"])["OUTPUT__0"]
    assert out.tolist() == [b"a!", b"", b"c!c!c!"]
    backend.unload()


def test_a_string_input_of_more_than_one_dimension_is_a_load_error(tmp_path: Path) -> None:
    folder = greet_model(write_config(tmp_path, "greet2", GREET.replace(
        '"INPUT__0", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] }',
        '"INPUT__0", data_type: TYPE_STRING, dims: [ 1 ]')))
    with pytest.raises(ConfigError, match="input 'INPUT__0' is TYPE_STRING.*only one dimension"):
        load_backend(folder)


def test_ragged_requests_share_a_batch_and_the_batch_input_binds_by_name(server: Server) -> None:
    assert answers_of_one_batch(server, "ragged_sum", [[1.0, 2.0], [10.0, 20.0, 30.0]]) == [[3.0], [60.0]]


# -- the backend on its own ------------------------------------------------------------------------


def load_backend(folder: Path) -> Any:
    spec = ModelSpec.from_config(load_model(folder).config)
    backend = backend_class("pytorch")(spec, folder / "1", Instance(f"{spec.name}_0"))
    backend.load()
    return backend


def test_no_inference_tensor_trap_whatever_the_callers_grad_mode(repo: Path) -> None:
    backend = load_backend(repo / "mlp_torchscript")
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    readonly = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(2, 256)
    expected = mlp_numpy(x)
    with torch.enable_grad():
        first = backend.execute({"INPUT__0": x}, ["OUTPUT__0"])["OUTPUT__0"]
    with torch.inference_mode():
        second = backend.execute({"INPUT__0": readonly}, ["OUTPUT__0"])["OUTPUT__0"]
    third = backend.execute({"INPUT__0": x}, ["OUTPUT__0"])["OUTPUT__0"]
    for y in (first, second, third):
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    backend.unload()


def test_a_dictionary_input_gets_every_input_by_name(tmp_path: Path) -> None:
    """Triton's PyTorch backend: a forward() whose one argument is a Dict[str, Tensor] gets the inputs
    in it, keyed by their config names, whatever the naming convention."""
    folder = write_config(tmp_path, "dict_in", '''
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "y", data_type: TYPE_FP32, dims: [ 2 ] }, { name: "x", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 2 ] } ]
''')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(DictDifference()).save(str(folder / "1" / "model.pt"))
    backend = load_backend(folder)
    x = np.array([[5.0, 7.0]], dtype=np.float32)
    y = np.array([[1.0, 2.0]], dtype=np.float32)
    assert backend.execute({"x": x, "y": y}, ["OUTPUT__0"])["OUTPUT__0"].tolist() == [[4.0, 5.0]]
    backend.unload()


def test_a_config_without_every_forward_argument_is_a_load_error(repo: Path, tmp_path: Path) -> None:
    """As in Triton, the config must give forward() every argument: else the model does not load (it
    would fail every request)."""
    folder = write_config(tmp_path, "half_pair", PAIR.replace('"pair"', '"half_pair"').replace(
        '  { name: "INPUT__1", data_type: TYPE_INT64, dims: [ 3 ] },\n', ''))
    (folder / "1" / "model.pt").write_bytes((repo / "pair" / "1" / "model.pt").read_bytes())
    with pytest.raises(ConfigError, match=r"the config gives 1 inputs, the model's forward\(\) takes 2 "
                                          r"\(first, second\)"):
        load_backend(folder)


def test_torch_export_auto_complete(repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "pytorch"\ndefault_model_filename: "model.pt2"\n')
    (folder / "1" / "model.pt2").write_bytes((repo / "named" / "1" / "model.pt2").read_bytes())
    config = load_model(folder).config
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("a", "TYPE_FP32", [2]), ("b", "TYPE_FP32", [2])]
    assert [(t["name"], t["dims"]) for t in config["output"]] == [("OUTPUT__0", [2])]


def test_torchscript_needs_a_full_config(repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('platform: "pytorch_libtorch"\n')
    (folder / "1" / "model.pt").write_bytes((repo / "pair" / "1" / "model.pt").read_bytes())
    with pytest.raises(ConfigError, match="needs its input and output"):
        load_model(folder)
    (folder / "1" / "model.pt").unlink()
    with pytest.raises(ConfigError, match="no model.pt or model.pt2"):
        load_model(folder)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
async def test_kind_gpu_without_cuda_is_a_load_error(repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gpu_mlp"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.pt").write_bytes((repo / "mlp_torchscript" / "1" / "model.pt").read_bytes())
    (folder / "config.pbtxt").write_text(MLP_TORCHSCRIPT.replace('"mlp_torchscript"', '"gpu_mlp"') +
                                         "instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] } ]\n")
    spec = ModelSpec.from_config(load_model(folder).config)
    runner = ModelRunner(None, Keys("unused"), spec, 1, folder, "test")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="KIND_GPU.*sees no GPU"):
        await runner.load()
    auto = ModelRunner(None, Keys("unused"), ModelSpec.from_config(  # type: ignore[arg-type]
        {**spec.config, "instance_group": [{"count": 1, "kind": "KIND_AUTO"}]}), 1, folder, "test")
    await auto.load()  # KIND_AUTO falls back to the CPU
    backend = await asyncio.wait_for(auto.execution.instances.get(), 1)
    assert backend.instance.kind == "CPU" and str(backend.device) == "cpu"
    backend.unload()
