"""The model's own limit: each workload called with onnxruntime in a tight loop, no server.

    python bench/limit.py [--repo bench/out/repo] [--seconds 2] [--cpu 0] [--model conv_heavy ...]
                          [--batch 128 ...]

One thread, sequential: the session settings of despina/workers/backends/onnxruntime.py. W3
(`mlp_classify`, the ensemble) is W1's session followed by its post-processing in numpy, in one loop.
Prints one JSON line per (workload, batch): rps counts rows per second, latencies are per call.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# isort: off
import despina  # noqa: F401  before onnxruntime: its telemetry off, as in Despina's worker
# isort: on
import numpy as np
import onnxruntime as ort
from models import CONV_WORKLOADS, DEFAULT_REPO, WORKLOADS, classify_post, measure, session

BATCHES = (1, 8, 32, 128)
MODELS = [*WORKLOADS, *CONV_WORKLOADS, "mlp_classify"]


class Chained:
    """W3 without a server: the MLP's session, then classify_post's numpy, as one call."""

    def __init__(self, sess: ort.InferenceSession) -> None:
        self.sess = sess

    def run(self, names: None, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return classify_post(self.sess.run(names, feeds)[0])


def ms(lat: list[float], q: float) -> float:
    return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=DEFAULT_REPO)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--cpu", type=int, help="pin this process to one core")
    p.add_argument("--model", nargs="+", choices=MODELS, default=MODELS, help="these workloads only")
    p.add_argument("--batch", nargs="+", type=int, default=BATCHES, help="these batch sizes only")
    p.add_argument("--peer", default="limit", help="the lines' peer (bench/run.sh: limit-beside)")
    args = p.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    for model in args.model:
        sess = session(args.repo / ("mlp" if model == "mlp_classify" else model) / "1" / "model.onnx")
        if model == "mlp_classify":
            sess = Chained(sess)
        for batch in args.batch:
            x = np.random.default_rng(0).standard_normal((batch, 256)).astype(np.float32)
            elapsed, lat = measure(sess, x, args.seconds)  # type: ignore[arg-type]
            print(json.dumps({"peer": args.peer, "client": "loop", "model": model, "batch": batch, "conc": 1,
                              "n": len(lat), "rps": round(len(lat) * batch / elapsed, 1),
                              "p50_ms": ms(lat, 0.5), "p90_ms": ms(lat, 0.9), "p99_ms": ms(lat, 0.99),
                              "errors": 0, "mean_batch": float(batch)}), flush=True)


if __name__ == "__main__":
    main()
