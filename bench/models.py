"""The benchmark workloads, built by script into a Triton repository under bench/out/.

    python bench/models.py [REPOSITORY]      # default bench/out/repo
    python bench/models.py --calibrate       # time W2 candidates at batch 1 on one thread

W1 `mlp`: the example MLP, float32 [N, 256] -> 1024 relu -> 10 (the peers' model, same weights).
W2 `mlp_heavy`: the same interface, deep enough that one row costs about 0.5 ms on one
onnxruntime thread at batch 1, so the model, not the serving path, should set the pace.
Both: dynamic batching, max_batch_size 128, max_queue_delay 500 us, one CPU instance.
W3 `mlp_classify`: the example ensemble, copied unchanged from model_repository/: W1's `mlp`, then
`classify_post` (Python backend: softmax and arg-max) on its logits.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from despina.examples import D_HIDDEN, D_IN, D_OUT, build_mlp

HERE = Path(__file__).resolve().parent
DEFAULT_REPO = HERE / "out" / "repo"
# Chosen with --calibrate on the benchmark machine (AMD EPYC, 2 cores): ~0.5 ms per call at batch 1.
W2_HIDDEN = (1024,) * 6
WORKLOADS: dict[str, tuple[int, ...]] = {
    "mlp": (D_IN, D_HIDDEN, D_OUT),
    "mlp_heavy": (D_IN, *W2_HIDDEN, D_OUT),
}
CANDIDATES = [(1024,) * k for k in (5, 6, 7, 8)] + [(1280,) * 4, (1536,) * 3, (2048,) * 2]

CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 128
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ {d_in} ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ {d_out} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
"""


def session(path: Path) -> ort.InferenceSession:
    """The session settings of despina/workers/backends/onnxruntime.py, with one thread."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


EXAMPLES = HERE.parent / "model_repository"
W3 = ("classify_post", "mlp_classify")  # with W1's mlp


def build(repo: Path) -> Path:
    for name, layers in WORKLOADS.items():
        build_mlp(repo / name / "1" / "model.onnx", layers=layers)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, d_in=layers[0], d_out=layers[-1]))
    for name in W3:
        shutil.rmtree(repo / name, ignore_errors=True)
        shutil.copytree(EXAMPLES / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def classify_post(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What W3's second step computes (model_repository/classify_post/1/model.py), for the limit."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32), logits.argmax(axis=1)


def p50_ms(sess: ort.InferenceSession, batch: int, seconds: float = 1.0) -> float:
    x = np.random.default_rng(0).standard_normal((batch, D_IN)).astype(np.float32)
    _, lat = measure(sess, x, seconds)
    return lat[len(lat) // 2] * 1000


def measure(sess: ort.InferenceSession, x: np.ndarray, seconds: float) -> tuple[float, list[float]]:
    """(elapsed seconds, sorted per-call latencies) of calling the model on x in a loop."""
    for _ in range(20):
        sess.run(None, {"x": x})
    lat: list[float] = []
    start = time.perf_counter()
    while (t0 := time.perf_counter()) < start + seconds:
        sess.run(None, {"x": x})
        lat.append(time.perf_counter() - t0)
    return time.perf_counter() - start, sorted(lat)


def calibrate(target_ms: float = 0.5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        timed = []
        for hidden in CANDIDATES:
            path = Path(tmp) / "m.onnx"
            build_mlp(path, layers=(D_IN, *hidden, D_OUT))
            ms = p50_ms(session(path), 1)
            timed.append((abs(ms - target_ms), hidden))
            print(f"hidden {hidden[0]} x {len(hidden)}: {ms:.3f} ms per row at batch 1", flush=True)
    print(f"closest to {target_ms} ms: hidden {min(timed)[1][0]} x {len(min(timed)[1])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repo", nargs="?", type=Path, default=DEFAULT_REPO)
    p.add_argument("--calibrate", action="store_true")
    args = p.parse_args()
    if args.calibrate:
        calibrate()
    else:
        print(f"built {', '.join([*WORKLOADS, *W3])} in {build(args.repo)}")


if __name__ == "__main__":
    main()
