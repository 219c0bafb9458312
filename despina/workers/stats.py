"""Triton's statistics counters, written by workers into one Redis hash per model version.

HINCRBY sums them over every worker; the statistics API and the Prometheus metrics both read that
hash, so the two always agree. Field names:

  inference_count, execution_count, last_inference (ms)
  {success,fail,queue,compute_input,compute_infer,compute_output}_{count,ns}
  fail:{REJECTED,CANCELED,BACKEND,OTHER}     failures by Triton's reason
  batch:{n}, batch_ns:{n}                    executions and compute time per batch size
  lat:{i}, qlat:{i}                          request / queue latency histogram bucket counts
"""
from __future__ import annotations

import bisect
from typing import Any

from ..contract.errors import Code
from ..contract.records import InferReply

# upper bounds in microseconds of the latency histogram buckets (the last one is +Inf)
LATENCY_BUCKETS_US = (100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 50_000, 100_000, 250_000,
                      500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000)

# One command for all of a batch's counters; last_inference is set, not added.
HINCRBY_MANY = """
for i = 1, #ARGV, 2 do
  if ARGV[i] == 'last_inference' then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  else redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
"""

REASON = {Code.RESOURCE_EXHAUSTED: "REJECTED", Code.DEADLINE_EXCEEDED: "REJECTED", Code.BACKEND: "BACKEND"}


def failure_reason(code: Code) -> str:
    return REASON.get(code, "OTHER")


def record(pipe: Any, key: str, replies: list[InferReply], rows: int, started: float,
           timings_ns: tuple[int, int, int] = (0, 0, 0)) -> None:
    """Count one batch's replies into the statistics hash `key`, in one command of `pipe`."""
    counts = tally(replies, rows, started, timings_ns)
    if counts:
        args = [x for field, n in counts.items() for x in (field, n)]
        pipe.eval(HINCRBY_MANY, 1, key, *args)


def tally(replies: list[InferReply], rows: int, started: float,
          timings_ns: tuple[int, int, int] = (0, 0, 0)) -> dict[str, int]:
    """One batch's counters; `rows` > 0 when the model executed (then timings are input, infer and
    output compute nanoseconds of that execution). A reply's latency is its queue_us + compute_us."""
    counts: dict[str, int] = {}

    def add(field: str, n: int) -> None:
        counts[field] = counts.get(field, 0) + n

    ok = [r for r in replies if r.error is None]
    if rows:
        input_ns, infer_ns, output_ns = timings_ns
        add("inference_count", rows)
        add("execution_count", 1)
        add(f"batch:{rows}", 1)
        add(f"batch_ns:{rows}", infer_ns)
        if ok:
            for name, ns in (("compute_input", input_ns), ("compute_infer", infer_ns),
                             ("compute_output", output_ns)):
                add(f"{name}_count", len(ok))
                add(f"{name}_ns", ns * len(ok))
    if ok:
        total_us = queue_us = 0
        lat: dict[int, int] = {}
        qlat: dict[int, int] = {}
        for r in ok:  # per request: locals, one pass (this runs for every request served)
            total_us += r.queue_us + r.compute_us
            queue_us += r.queue_us
            b = bisect.bisect_left(LATENCY_BUCKETS_US, r.queue_us + r.compute_us)
            lat[b] = lat.get(b, 0) + 1
            b = bisect.bisect_left(LATENCY_BUCKETS_US, r.queue_us)
            qlat[b] = qlat.get(b, 0) + 1
        add("success_count", len(ok))
        add("success_ns", total_us * 1000)
        add("queue_count", len(ok))
        add("queue_ns", queue_us * 1000)
        for b, n in lat.items():
            add(f"lat:{b}", n)
        for b, n in qlat.items():
            add(f"qlat:{b}", n)
    for r in replies:
        if r.error is not None:
            add("fail_count", 1)
            add(f"fail:{failure_reason(r.error[0])}", 1)
    if rows:
        counts["last_inference"] = int(started * 1000)
    return counts
