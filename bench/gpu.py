"""W2 on a GPU: W2 on KIND_GPU, as TorchScript (torch on CUDA) or as its ONNX file (onnxruntime's CUDA
provider), and its limit.

    python bench/gpu.py build [--repo bench/out/gpu-repo] [--onnx bench/out/repo/mlp_heavy/1/model.onnx]
                              [--kind KIND_GPU] [--backend pytorch|onnxruntime]
    python bench/gpu.py limit [--repo bench/out/gpu-repo] [--seconds 2] [--device cuda]

`build` reads W2's ONNX file (bench/models.py) and writes `mlp_heavy_gpu`: the same layers and
weights in TorchScript (`--backend pytorch`), or the ONNX file itself (`onnxruntime`, which needs
onnxruntime-gpu), with W2's config (max_batch_size 128, 500 us queue delay) on one KIND_GPU instance
(no `gpus`: every GPU, so GPU 0 on a one-GPU machine). `limit` loads that model with the worker's own
backend on one instance (GPU 0, or the CPU with `--device cpu`) and calls its `execute` in
bench/models.py's tight loop, as the worker calls it: numpy rows in, numpy rows out (torch copies
them to the device and back; onnxruntime's CUDA provider does the same inside its run). One JSON
line per batch size, as bench/limit.py prints them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from limit import ms
from models import DEFAULT_REPO, measure
from onnx import numpy_helper

from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.workers.backends import Instance, backend_class

HERE = Path(__file__).resolve().parent
NAME = "mlp_heavy_gpu"
BATCHES = (1, 8, 32, 128)
CONFIG = """name: "{name}"
backend: "{backend}"
max_batch_size: 128
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 10 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
instance_group [ {{ count: 1, kind: {kind} }} ]
"""


def mlp(weights: list[np.ndarray]) -> Any:
    """bench/models.py's graph (x @ W + b, relu between layers) as torch layers."""
    import torch

    layers: list[torch.nn.Module] = []
    for w, b in zip(weights[::2], weights[1::2]):
        linear = torch.nn.Linear(*w.shape)
        linear.weight.data = torch.from_numpy(np.ascontiguousarray(w.T))
        linear.bias.data = torch.from_numpy(b)
        layers += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def onnx_weights(path: Path) -> list[np.ndarray]:
    """The MatMul weights and Add biases in graph order (bench/models.py builds W, b per layer)."""
    model = onnx.load(str(path))
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return [init[name].astype(np.float32) for node in model.graph.node if node.op_type in ("MatMul", "Add")
            for name in node.input if name in init]


def build(repo: Path, onnx_file: Path, kind: str, backend: str) -> Path:
    folder = repo / NAME
    shutil.rmtree(folder, ignore_errors=True)  # no model.pt beside a model.onnx from another build
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(CONFIG.format(name=NAME, kind=kind, backend=backend))
    if backend == "onnxruntime":
        shutil.copyfile(onnx_file, folder / "1" / "model.onnx")
        return folder
    import torch

    with warnings.catch_warnings():  # TorchScript is deprecated upstream; Triton's backend still loads it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(mlp(onnx_weights(onnx_file)).eval()).save(str(folder / "1" / "model.pt"))
    return folder


class Looped:
    """The model as the worker holds it: its backend's `execute` on one instance, with onnxruntime's
    `run` so that bench/models.py's `measure` loops over it."""

    def __init__(self, folder: Path, device: str) -> None:
        self.spec = ModelSpec.from_config(load_model(folder).config)
        kind = "GPU" if device.startswith("cuda") else "CPU"
        index = int(device.partition(":")[2] or 0)
        self.backend = backend_class(self.spec.backend)(self.spec, folder / "1",
                                                        Instance(f"{NAME}_0", kind, index))
        self.backend.load()

    def run(self, names: None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [self.backend.execute(feeds, ["y"])["y"]]

    def device_name(self) -> str:
        if self.backend.instance.kind != "GPU":
            return "cpu"
        if self.spec.backend == "onnxruntime":
            return "onnxruntime " + ", ".join(self.backend.session.get_providers())
        import torch

        return torch.cuda.get_device_name(self.backend.instance.device)


def limit(repo: Path, device: str, seconds: float) -> None:
    model = Looped(repo / NAME, device)
    for batch in BATCHES:
        x = np.random.default_rng(0).standard_normal((batch, 256)).astype(np.float32)
        elapsed, lat = measure(model, x, seconds)  # type: ignore[arg-type]
        print(json.dumps({"peer": "limit", "client": "loop", "model": NAME, "batch": batch, "conc": 1,
                          "n": len(lat), "rps": round(len(lat) * batch / elapsed, 1), "p50_ms": ms(lat, 0.5),
                          "p90_ms": ms(lat, 0.9), "p99_ms": ms(lat, 0.99), "errors": 0,
                          "mean_batch": float(batch), "backend": model.spec.backend,
                          "device": model.device_name()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["build", "limit"])
    p.add_argument("--repo", type=Path, default=HERE / "out" / "gpu-repo")
    p.add_argument("--onnx", type=Path, default=DEFAULT_REPO / "mlp_heavy" / "1" / "model.onnx")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--kind", default="KIND_GPU", choices=["KIND_GPU", "KIND_CPU"],
                   help="the instance group's kind (KIND_CPU: to try bench/gpu.sh without a GPU)")
    p.add_argument("--backend", default="pytorch", choices=["pytorch", "onnxruntime"])
    args = p.parse_args()
    if args.what == "build":
        print(f"built {build(args.repo, args.onnx, args.kind, args.backend)}")
    else:
        limit(args.repo, args.device, args.seconds)


if __name__ == "__main__":
    main()
