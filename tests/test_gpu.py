"""The GPU paths, on a machine with an NVIDIA GPU (every test here is skipped without one).

A TorchScript model on KIND_GPU through a real `despina serve`, against torch on the CPU; KIND_AUTO
taking the GPU; a GPU the machine lacks as a load error; a Python-backend model told its instance
kind and device id as Triton tells it, running torch on that device; onnxruntime's CUDA execution
provider where onnxruntime-gpu is installed; the worker announcing its GPU to placement, and
Triton's nv_gpu_* metrics. `bench/gpu.sh` runs this module on the device machine.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import httpx
import numpy as np
import pytest

from despina.contract.errors import ConfigError
from despina.contract.keys import Keys
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.examples import build_mlp, build_torchscript_mlp, mlp_numpy
from despina.workers.backends import Instance, backend_class
from despina.workers.backends.base import visible_gpus
from despina.workers.runner import ModelRunner

from .conftest import Server, module_server, settled_stats
from .control_support import wait_until
from .test_backend_pytorch import torchscript_output, write_config

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

TORCHSCRIPT = '''
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 64
input [ {{ name: "INPUT__0", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 10 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
{group}
'''
ONNX_GPU = '''
name: "mlp_onnx_gpu"
backend: "onnxruntime"
max_batch_size: 64
input [ { name: "x", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 10 ] } ]
instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] } ]
'''
PYTHON_GPU = '''
name: "double_gpu"
backend: "python"
max_batch_size: 16
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [
  { name: "y", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "on", data_type: TYPE_STRING, dims: [ 1 ] }
]
instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] } ]
'''
# Written for Triton's Python backend: the instance kind and device id come in `args`, as there.
PYTHON_GPU_MODEL = '''
import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        kind, device = args["model_instance_kind"], args["model_instance_device_id"]
        self.device = torch.device(f"cuda:{device}" if kind == "GPU" else "cpu")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = torch.from_numpy(pb_utils.get_input_tensor_by_name(request, "x").as_numpy()).to(self.device)
            y = (x * 2).cpu().numpy()
            on = np.array([[str(x.device).encode()]] * len(y), dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("y", y), pb_utils.Tensor("on", on)]))
        return responses
'''
GPU = "instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] } ]"
AUTO = ""  # no instance_group: Triton's default, KIND_AUTO, which is the GPU when there is one


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpu-repo")
    for name, group in (("mlp_gpu", GPU), ("mlp_auto", AUTO)):
        build_torchscript_mlp(write_config(root, name, TORCHSCRIPT.format(name=name, group=group)) / "1" / "model.pt")
    (write_config(root, "double_gpu", PYTHON_GPU) / "1" / "model.py").write_text(PYTHON_GPU_MODEL)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, repo: Path) -> Iterator[Server]:
    yield from module_server(repo, tmp_path_factory, redis_url, ("mlp_gpu", "mlp_auto", "double_gpu"))


def infer(server: Server, model: str, name: str, x: np.ndarray) -> dict:
    body = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return {o["name"]: o for o in r.json()["outputs"]}


@pytest.mark.parametrize("model", ["mlp_gpu", "mlp_auto"])
def test_torchscript_on_the_gpu_answers_as_torch_on_the_cpu(server: Server, repo: Path, model: str) -> None:
    x = np.random.default_rng(7).standard_normal((5, 256)).astype(np.float32)
    out = infer(server, model, "INPUT__0", x)["OUTPUT__0"]
    want = torchscript_output(repo / model / "1" / "model.pt", x).numpy()
    assert out["shape"] == [5, 10]
    np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(5, 10), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(want, mlp_numpy(x), rtol=1e-3, atol=1e-4)


async def test_concurrent_requests_batch_on_the_gpu(server: Server, repo: Path) -> None:
    rows = np.random.default_rng(8).standard_normal((48, 256)).astype(np.float32)
    before = httpx.get(f"{server.url}/v2/models/mlp_gpu/stats").json()["model_stats"][0]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        replies = await asyncio.gather(*(client.post("/v2/models/mlp_gpu/infer", json={"inputs": [
            {"name": "INPUT__0", "shape": [1, 256], "datatype": "FP32", "data": row.tolist()}]})
            for row in rows))
    got = np.array([r.json()["outputs"][0]["data"] for r in replies], np.float32)
    np.testing.assert_allclose(got, torchscript_output(repo / "mlp_gpu" / "1" / "model.pt", rows).numpy(), rtol=1e-3, atol=1e-4)
    after = settled_stats(server.url, "mlp_gpu")
    assert after["inference_count"] - before["inference_count"] == 48
    assert after["execution_count"] - before["execution_count"] < 48  # some rows shared a model call


def test_python_model_is_told_its_gpu(server: Server) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = infer(server, "double_gpu", "x", x)
    assert out["y"]["data"] == (x * 2).ravel().tolist()
    assert out["on"]["data"] == ["cuda:0", "cuda:0"]


def test_the_worker_announces_its_gpu_and_metrics_name_it(server: Server) -> None:
    assert visible_gpus() == torch.cuda.device_count()
    page = server.metrics_url.removesuffix("/metrics") + "/status.json"
    # the page samples Redis every 2 s: its first sample may predate the worker
    status = wait_until(lambda: (s := httpx.get(page, timeout=10).json())["workers"] and s, 10, what="the workers")
    assert {w["gpus"] for w in status["workers"]} == {torch.cuda.device_count()}
    assert {m["name"]: m["state"] for m in status["models"]}["mlp_gpu"] == "READY"
    if find_spec("pynvml") is None:
        pytest.skip("no pynvml (nvidia-ml-py) here: the control plane exports no nv_gpu_* metrics")
    metrics = httpx.get(server.metrics_url, timeout=10).text
    assert "nv_gpu_memory_used_bytes{gpu_uuid=" in metrics and "nv_gpu_utilization{" in metrics


async def test_a_gpu_the_machine_lacks_is_a_load_error(repo: Path, tmp_path: Path) -> None:
    missing = torch.cuda.device_count()
    folder = tmp_path / "far"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.pt").write_bytes((repo / "mlp_gpu" / "1" / "model.pt").read_bytes())
    (folder / "config.pbtxt").write_text(TORCHSCRIPT.format(
        name="far", group=f"instance_group [ {{ count: 1, kind: KIND_GPU, gpus: [ {missing} ] }} ]"))
    spec = ModelSpec.from_config(load_model(folder).config)
    runner = ModelRunner(None, Keys("unused"), spec, 1, folder, "test")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"GPU.*{missing}"):
        await runner.load()


async def test_kind_auto_takes_the_gpu(repo: Path) -> None:
    folder = repo / "mlp_auto"
    runner = ModelRunner(None, Keys("unused"), ModelSpec.from_config(  # type: ignore[arg-type]
        load_model(folder).config), 1, folder, "test")
    await runner.load()
    backend = await asyncio.wait_for(runner.execution.instances.get(), 5)
    assert backend.instance.kind == "GPU" and str(backend.device) == "cuda:0"
    backend.unload()


def test_onnxruntime_cuda_provider(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"this onnxruntime has no CUDA provider ({', '.join(ort.get_available_providers())})")
    folder = tmp_path / "mlp_onnx_gpu"
    build_mlp(write_config(tmp_path, "mlp_onnx_gpu", ONNX_GPU) / "1" / "model.onnx")
    spec = ModelSpec.from_config(load_model(folder).config)
    backend = backend_class(spec.backend)(spec, folder / "1", Instance("mlp_onnx_gpu_0", "GPU", 0))
    backend.load()
    assert backend.session.get_providers()[0] == "CUDAExecutionProvider"
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_allclose(backend.execute({"x": x}, ["y"])["y"], mlp_numpy(x), rtol=1e-3, atol=1e-4)
    backend.unload()
