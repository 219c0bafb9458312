"""The benchmark workloads, built by script into a Triton repository under bench/out/.

    python bench/models.py [REPOSITORY]      # default bench/out/repo
    python bench/models.py --calibrate       # time W2 candidates at batch 1 on one thread
    BENCH_W2_CONV=96x2 python bench/models.py  # conv_heavy with other channels x convolutions

W1 `mlp`: the example MLP, float32 [N, 256] -> 1024 relu -> 10 (the peers' model, same weights).
W2 `mlp_heavy`: the same interface, deep enough that one row costs about 0.5 ms on one
onnxruntime thread at batch 1, so the model, not the serving path, should set the pace. At batch 1
it is bound by reading its 24 MB of weights, not by arithmetic: batching cuts its cost per row
about 5x (116 us at batch 128), and the serving path's cost per request weighs as much again.
W2 `conv_heavy`: the same interface, compute-bound: the 256 floats as one 16 x 16 image through
3x3 convolutions (weights of a few hundred KB, in cache), so a row costs about 0.5 ms at every
batch size, as a compute-bound model's does. How much a row costs depends on the CPU (0.54 ms with
the default on one host, 0.27 on one with AVX-512, 0.36 on another): BENCH_W2_CONV=CHANNELSxCONVS
builds it from another candidate that --calibrate timed closer to 0.5 ms on the machine at hand
(bench/ab.sh and bench/run.sh pass it through; RESULTS says which one each figure used).
All: dynamic batching, max_batch_size 128, max_queue_delay 500 us, one CPU instance.
W3 `mlp_classify`: the example ensemble, copied unchanged from model_repository/: W1's `mlp`, then
`classify_post` (Python backend: softmax and arg-max) on its logits.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

# isort: off
import despina  # noqa: F401  before onnxruntime: its telemetry off, as in Despina's worker
# isort: on
import numpy as np
import onnxruntime as ort

from despina.examples import D_HIDDEN, D_IN, D_OUT, build_mlp

HERE = Path(__file__).resolve().parent
DEFAULT_REPO = HERE / "out" / "repo"
# Chosen with --calibrate on the benchmark machine (AMD EPYC, 2 cores): ~0.5 ms per call at batch 1.
W2_HIDDEN = (1024,) * 6
W2_CONV = (64, 3)  # channels, 3x3 convolutions after the first: chosen with --calibrate, as W2_HIDDEN


def w2_conv(setting: str | None) -> tuple[int, int]:
    """conv_heavy's (channels, convolutions after the first): BENCH_W2_CONV's "CHANNELSxCONVS" or the
    default."""
    if not setting:
        return W2_CONV
    parts = setting.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and 0 < int(p) <= 1024 for p in parts):
        raise SystemExit(f"BENCH_W2_CONV must be CHANNELSxCONVS, as 96x2, got {setting!r}")
    return int(parts[0]), int(parts[1])


WORKLOADS: dict[str, tuple[int, ...]] = {
    "mlp": (D_IN, D_HIDDEN, D_OUT),
    "mlp_heavy": (D_IN, *W2_HIDDEN, D_OUT),
}
CONV_WORKLOADS: dict[str, tuple[int, int]] = {"conv_heavy": w2_conv(os.environ.get("BENCH_W2_CONV"))}
CANDIDATES = [(1024,) * k for k in (5, 6, 7, 8)] + [(1280,) * 4, (1536,) * 3, (2048,) * 2]
CONV_CANDIDATES = [(32, 2), (48, 2), (64, 1), (64, 2), (64, 3), (96, 1), (96, 2)]
SIDE = 16  # the 256 inputs as one SIDE x SIDE image

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


def build_conv(path: Path, channels: int, convs: int, seed: int = 0) -> None:
    """float32 [N, 256] -> [N, 1, 16, 16] -> 3x3 conv to `channels`, relu, then `convs` 3x3 convs
    channels -> channels with relu (padding 1: the image stays 16 x 16) -> global average pool ->
    channels -> 10 (input x, output y). About 4,600 x channels^2 multiply-adds per row per conv."""
    from onnx import TensorProto, helper, numpy_helper

    from despina.examples import save_onnx

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array([-1, 1, SIDE, SIDE], np.int64), "image_shape")]
    nodes = [helper.make_node("Reshape", ["x", "image_shape"], ["c_in"])]
    prev, fan_in = "c_in", 1
    for i in range(convs + 1):
        w = (rng.standard_normal((channels, fan_in, 3, 3)) * np.sqrt(2 / (9 * fan_in))).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"K{i}"),
                  numpy_helper.from_array((rng.standard_normal(channels) * 0.01).astype(np.float32), f"k{i}")]
        nodes += [helper.make_node("Conv", [prev, f"K{i}", f"k{i}"], [f"c{i}"], kernel_shape=[3, 3],
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        prev, fan_in = f"r{i}", channels
    head = (rng.standard_normal((channels, D_OUT)) * np.sqrt(1 / channels)).astype(np.float32)
    inits += [numpy_helper.from_array(head, "W"),
              numpy_helper.from_array((rng.standard_normal(D_OUT) * 0.01).astype(np.float32), "b")]
    nodes += [helper.make_node("GlobalAveragePool", [prev], ["pooled"]),
              helper.make_node("Flatten", ["pooled"], ["features"], axis=1),
              helper.make_node("MatMul", ["features", "W"], ["logits"]),
              helper.make_node("Add", ["logits", "b"], ["y"])]
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SIDE * SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", D_OUT])], inits)
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def build(repo: Path) -> Path:
    for name, layers in WORKLOADS.items():
        build_mlp(repo / name / "1" / "model.onnx", layers=layers)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, d_in=layers[0], d_out=layers[-1]))
    # W1 with Triton's response cache on (served from the cache when the gateway has memory for it)
    shutil.rmtree(repo / "mlp_cached", ignore_errors=True)
    shutil.copytree(repo / "mlp", repo / "mlp_cached")
    (repo / "mlp_cached" / "config.pbtxt").write_text(
        CONFIG.format(name="mlp_cached", d_in=D_IN, d_out=D_OUT) + "response_cache { enable: true }\n")
    for name, (channels, convs) in CONV_WORKLOADS.items():
        build_conv(repo / name / "1" / "model.onnx", channels, convs)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, d_in=D_IN, d_out=D_OUT))
    for name in W3:
        shutil.rmtree(repo / name, ignore_errors=True)
        shutil.copytree(EXAMPLES / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def classify_post(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What W3's second step computes (model_repository/classify_post/1/model.py), for the limit."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32), logits.argmax(axis=1)


def p50_ms(sess: ort.InferenceSession, batch: int, seconds: float = 1.0) -> float:
    """The median time of one call at this batch size, in ms."""
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
        path = Path(tmp) / "m.onnx"
        timed = []
        for hidden in CANDIDATES:
            build_mlp(path, layers=(D_IN, *hidden, D_OUT))
            ms = p50_ms(session(path), 1)
            timed.append((abs(ms - target_ms), hidden))
            print(f"hidden {hidden[0]} x {len(hidden)}: {ms:.3f} ms per row at batch 1", flush=True)
        print(f"closest to {target_ms} ms: hidden {min(timed)[1][0]} x {len(min(timed)[1])}")
        conv = []
        for channels, convs in CONV_CANDIDATES:
            build_conv(path, channels, convs)
            sess = session(path)
            one, many = p50_ms(sess, 1), p50_ms(sess, 128) / 128
            conv.append((abs(many - target_ms), (channels, convs)))
            print(f"conv {channels} channels, 1 + {convs} convs: {one:.3f} ms per row at batch 1, "
                  f"{many:.3f} at batch 128", flush=True)
        print(f"closest to {target_ms} ms per row at batch 128: conv {min(conv)[1]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repo", nargs="?", type=Path, default=DEFAULT_REPO)
    p.add_argument("--calibrate", action="store_true")
    args = p.parse_args()
    if args.calibrate:
        calibrate()
    else:
        channels, convs = CONV_WORKLOADS["conv_heavy"]
        print(f"built {', '.join([*WORKLOADS, *CONV_WORKLOADS, *W3])} in {build(args.repo)} "
              f"(conv_heavy: {channels} channels, 1 + {convs} convolutions)")


if __name__ == "__main__":
    main()
