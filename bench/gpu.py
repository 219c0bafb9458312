"""W2 on a GPU: W2's weights as a TorchScript model on KIND_GPU, and its limit with torch on CUDA.

    python bench/gpu.py build [--repo bench/out/gpu-repo] [--onnx bench/out/repo/mlp_heavy/1/model.onnx]
                              [--kind KIND_GPU]
    python bench/gpu.py limit [--repo bench/out/gpu-repo] [--seconds 2] [--device cuda]

`build` reads W2's ONNX file (bench/models.py) and writes `mlp_heavy_gpu`: the same layers and
weights in TorchScript, W2's config (max_batch_size 128, 500 us queue delay) on one KIND_GPU
instance (no `gpus`: every GPU, so GPU 0 on a one-GPU machine). `limit` calls that file the way the
worker's pytorch backend does, in bench/models.py's tight loop: rows from numpy copied to the device,
the model under no_grad, the result copied back to numpy. One JSON line per batch size, as
bench/limit.py prints them.
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from limit import ms
from models import DEFAULT_REPO, measure
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
NAME = "mlp_heavy_gpu"
BATCHES = (1, 8, 32, 128)
CONFIG = """name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 128
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 10 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
instance_group [ {{ count: 1, kind: {kind} }} ]
"""


def mlp(weights: list[np.ndarray]) -> torch.nn.Sequential:
    """bench/models.py's graph (x @ W + b, relu between layers) as torch layers."""
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


def build(repo: Path, onnx_file: Path, kind: str) -> Path:
    folder = repo / NAME
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(CONFIG.format(name=NAME, kind=kind))
    with warnings.catch_warnings():  # TorchScript is deprecated upstream; Triton's backend still loads it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(mlp(onnx_weights(onnx_file)).eval()).save(str(folder / "1" / "model.pt"))
    return folder


class OnDevice:
    """The TorchScript file called as despina/workers/backends/pytorch.py's execute calls it: rows from
    numpy copied to the device, the model under no_grad, the result copied back to numpy. It has
    onnxruntime's `run` so that bench/models.py's `measure` loops over it."""

    def __init__(self, path: Path, device: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.module = torch.jit.load(str(path), map_location=device).eval()
        self.device = torch.device(device)

    def run(self, names: None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            return [self.module(torch.from_numpy(feeds["x"]).to(self.device)).cpu().numpy()]


def limit(repo: Path, device: str, seconds: float) -> None:
    model = OnDevice(repo / NAME / "1" / "model.pt", device)
    name = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    for batch in BATCHES:
        x = np.random.default_rng(0).standard_normal((batch, 256)).astype(np.float32)
        elapsed, lat = measure(model, x, seconds)  # type: ignore[arg-type]
        print(json.dumps({"peer": "limit", "client": "loop", "model": NAME, "batch": batch, "conc": 1,
                          "n": len(lat), "rps": round(len(lat) * batch / elapsed, 1), "p50_ms": ms(lat, 0.5),
                          "p90_ms": ms(lat, 0.9), "p99_ms": ms(lat, 0.99), "errors": 0,
                          "mean_batch": float(batch), "device": name}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["build", "limit"])
    p.add_argument("--repo", type=Path, default=HERE / "out" / "gpu-repo")
    p.add_argument("--onnx", type=Path, default=DEFAULT_REPO / "mlp_heavy" / "1" / "model.onnx")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--kind", default="KIND_GPU", choices=["KIND_GPU", "KIND_CPU"],
                   help="the instance group's kind (KIND_CPU: to try bench/gpu.sh without a GPU)")
    args = p.parse_args()
    if args.what == "build":
        print(f"built {build(args.repo, args.onnx, args.kind)}")
    else:
        limit(args.repo, args.device, args.seconds)


if __name__ == "__main__":
    main()
