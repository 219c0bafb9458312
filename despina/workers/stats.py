"""Triton's statistics counters, written by workers into one Redis hash per model version.

HINCRBY sums them over every worker; the statistics API and the Prometheus metrics both read that
hash, so the two always agree. A batch's counters go out with its replies; while more batches follow
at once, several batches' counters go out together (counters.Deferred, at most DEFER_S late), and the
last batch of a burst takes everything with it. Field names:

  inference_count, execution_count, last_inference (ms)
  {success,fail,queue,compute_input,compute_infer,compute_output}_{count,ns}
  fail:{REJECTED,CANCELED,BACKEND,OTHER}     failures by Triton's reason
  batch:{n}, batch_{in,,out}_ns:{n}           executions, and their compute input / infer / output time,
                                             per batch size
  lat:{i}, qlat:{i}                          request / queue latency histogram bucket counts
  cold_count, cold_ns, cold:{i}              cold starts, their time and its histogram bucket counts (written
                                             by the control plane, control/idle.py)
"""
from __future__ import annotations

import bisect
import functools
from typing import Any

from ..contract.errors import Code, DespinaError
from ..contract.records import GROUPED, InferReply, requests_in
from ..counters import record_counts

# upper bounds in microseconds of the latency histogram buckets (the last one is +Inf)
LATENCY_BUCKETS_US = (100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 50_000, 100_000, 250_000,
                      500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000)
# upper bounds in seconds of the cold-start histogram buckets (the last one is +Inf): a model loads in
# milliseconds from the local cache and in minutes from a slow store (DESPINA_LOAD_TIMEOUT_S, 300 s)
COLD_START_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# the field names, made once: formatting them cost a batch six f-strings
LAT = tuple(f"lat:{b}" for b in range(len(LATENCY_BUCKETS_US) + 1))
QLAT = tuple(f"qlat:{b}" for b in range(len(LATENCY_BUCKETS_US) + 1))

REASON = {Code.RESOURCE_EXHAUSTED: "REJECTED", Code.DEADLINE_EXCEEDED: "REJECTED", Code.BACKEND: "BACKEND",
          Code.CANCELLED: "CANCELED"}


def failure_reason(code: Code) -> str:
    return REASON.get(code, "OTHER")


def record(pipe: Any, key: str, replies: list[InferReply], rows: int, started: float,
           timings_ns: tuple[int, int, int] = (0, 0, 0)) -> None:
    """Count one batch's replies into the statistics hash `key`, in one command of `pipe`."""
    record_counts(pipe, key, tally(replies, rows, started, timings_ns))


def tally(replies: list[InferReply], rows: int, started: float,
          timings_ns: tuple[int, int, int] = (0, 0, 0), later: int = 0,
          failed_runs_count: bool = False, inferred: int | None = None) -> dict[str, int]:
    """One batch's counters; `rows` > 0 when the model executed (then timings are input, infer and
    output compute nanoseconds of that execution). A reply's latency is its queue_us + compute_us, and
    when the model executed, what the execution spent after compute_us was taken (its outputs split, its
    replies made) and at least the execution's whole time: as in Triton, a request's latency ends after its
    compute_output, so what it leaves over queue and compute (perf_analyzer's "overhead") is not negative.
    `later`: requests of the execution whose replies come later (a decoupled model's), counted in its
    compute as Triton counts a request's compute, their success with their final reply.
    `failed_runs_count`: an execution whose every request failed still counts as an execution, in
    execution_count and in batch_stats with its compute time (Triton 2.51's Python backend reports it;
    its onnxruntime, PyTorch and TensorFlow backends do not).
    `inferred`: the rows of the execution that count as inferences where not all of `rows` do (a decoupled
    execution that raised for some requests: those are counted in `later` neither).
    (Every field is set once, the failures' excepted: this runs for every batch.)"""
    counts: dict[str, int] = {}
    ok = [r for r in replies if r.error is None]
    if not ok and replies:  # no inference; an execution only where Triton's backend reports one
        if rows and failed_runs_count:
            counts["execution_count"] = 1
            _count_batch(counts, rows, timings_ns)
        rows = 0
    n = len(ok)
    grouped = any(r.id[:1] == GROUPED for r in replies)  # a gateway's several requests sent as one
    if grouped:
        n = sum(requests_in(r.id) for r in ok)
    output_us = least_us = 0
    if rows:
        input_ns, infer_ns, output_ns = timings_ns
        output_us = -(-output_ns // 1000)  # rounded up, as the execution's least
        least_us = -(-(input_ns + infer_ns + output_ns) // 1000)
        if inferred is None or inferred:
            counts["inference_count"] = rows if inferred is None else inferred
        counts["execution_count"] = 1
        _count_batch(counts, rows, timings_ns)
        if computed := n + later:
            counts["compute_input_count"] = counts["compute_infer_count"] = computed
            counts["compute_output_count"] = computed
            counts["compute_input_ns"] = input_ns * computed
            counts["compute_infer_ns"] = infer_ns * computed
            counts["compute_output_ns"] = output_ns * computed
    if n:
        total_us = queue_us = 0
        get = counts.get
        for r in ok:  # per request: locals, one pass
            k = requests_in(r.id) if grouped else 1
            queued = r.queue_us
            took = queued + max(r.compute_us + output_us, least_us)
            total_us += took * k
            queue_us += queued * k
            name = LAT[bisect.bisect_left(LATENCY_BUCKETS_US, took)]
            counts[name] = get(name, 0) + k
            name = QLAT[bisect.bisect_left(LATENCY_BUCKETS_US, queued)]
            counts[name] = get(name, 0) + k
        counts["success_count"] = counts["queue_count"] = n
        counts["success_ns"] = total_us * 1000
        counts["queue_ns"] = queue_us * 1000
    if len(ok) < len(replies):
        for r in replies:
            if r.error is not None:
                k = requests_in(r.id) if grouped else 1
                reason = f"fail:{failure_reason(r.error[0])}"
                counts["fail_count"] = counts.get("fail_count", 0) + k
                if took := r.queue_us + r.compute_us:
                    counts["fail_ns"] = counts.get("fail_ns", 0) + took * 1000 * k
                counts[reason] = counts.get(reason, 0) + k
    if rows:
        counts["last_inference"] = int(started * 1000)
    return counts


def _count_batch(counts: dict[str, int], rows: int, timings_ns: tuple[int, int, int]) -> None:
    """An execution of `rows` and its compute input / infer / output time, in its batch size's fields."""
    names = _batch_fields(rows)
    input_ns, infer_ns, output_ns = timings_ns
    counts[names[0]] = 1
    counts[names[1]] = infer_ns
    if input_ns:
        counts[names[2]] = input_ns
    if output_ns:
        counts[names[3]] = output_ns


@functools.lru_cache(maxsize=4096)  # batch sizes are few (max_batch_size); a model without one, any rows
def _batch_fields(rows: int) -> tuple[str, str, str, str]:
    """The names of a batch size's fields: batch:, batch_ns:, batch_in_ns:, batch_out_ns:."""
    return f"batch:{rows}", f"batch_ns:{rows}", f"batch_in_ns:{rows}", f"batch_out_ns:{rows}"


def ensemble_counts(error: DespinaError | None, us: int, rows: int, into: dict[str, int] | None = None,
                    compute_ns: tuple[int, int, int] | list[int] = (0, 0, 0), queue_us: int = 0
                    ) -> dict[str, int]:
    """An ensemble request's own counters, counted as a model counts a request, as Triton's ensemble
    scheduler does: `queue_us` its own wait before its graph began (on the ensemble's stream, for a
    worker that runs it; none where the gateway starts it as it arrives; its steps queue, and count it,
    at their models), one execution of its rows per request that succeeded, `us` its latency,
    `compute_ns` its steps' compute input, infer and output, each the sum of its steps' (as Triton's; a
    step whose reply does not split it, a decoupled one's, counted as infer: ensemble_run.Run.computed).
    Clients such as perf_analyzer find the version that served by its queue count.
    Added into `into` (a fresh dict when None), which is returned: this runs once per request, so it
    adds the few fields itself instead of going through `tally`."""
    counts: dict[str, int] = {} if into is None else into
    get = counts.get
    if error is None:
        lat = LAT[bisect.bisect_left(LATENCY_BUCKETS_US, us)]
        qlat = QLAT[bisect.bisect_left(LATENCY_BUCKETS_US, queue_us)] if queue_us else _QLAT_NONE
        batch, batch_ns, batch_in_ns, batch_out_ns = _batch_fields(max(rows, 1))
        input_ns, infer_ns, output_ns = compute_ns
        for field, n in (("success_count", 1), ("success_ns", us * 1000), ("queue_count", 1),
                         ("queue_ns", queue_us * 1000), (lat, 1), (qlat, 1), ("inference_count", rows),
                         ("execution_count", 1), ("compute_input_count", 1), ("compute_infer_count", 1),
                         ("compute_output_count", 1), ("compute_input_ns", input_ns),
                         ("compute_infer_ns", infer_ns), ("compute_output_ns", output_ns), (batch, 1),
                         (batch_ns, infer_ns), (batch_in_ns, input_ns), (batch_out_ns, output_ns)):
            counts[field] = get(field, 0) + n
    else:  # whatever failed its step (its backend, its queue), Triton 2.51 counts an ensemble's OTHER
        reason = "fail:CANCELED" if error.code == Code.CANCELLED else "fail:OTHER"
        counts["fail_count"] = get("fail_count", 0) + 1
        if us:
            counts["fail_ns"] = get("fail_ns", 0) + us * 1000
        counts[reason] = get(reason, 0) + 1
    return counts


_QLAT_NONE = QLAT[bisect.bisect_left(LATENCY_BUCKETS_US, 0)]  # the queue latency bucket of no wait

# an ensemble request that succeeded, as ensemble_counts takes it: its latency (µs), its own queue time (µs),
# its rows, and its steps' compute input, infer and output (ns)
Success = tuple[int, int, int, int, int, int]


def ensemble_successes(successes: list[Success], into: dict[str, int]) -> dict[str, int]:
    """ensemble_counts of each request in `successes`, added into `into` (returned) in one pass: a worker
    that runs an ensemble answers many of its requests at once, and per request the fields' sums were most
    of its counting."""
    get = into.get
    bisect_left, buckets = bisect.bisect_left, LATENCY_BUCKETS_US
    total_us = queue_us = inferences = input_sum = infer_sum = output_sum = 0
    latencies: dict[str, int] = {}
    by_rows: dict[int, list[int]] = {}  # rows -> [executions, infer, input, output ns]
    for us, queued, rows, input_ns, infer_ns, output_ns in successes:
        total_us += us
        queue_us += queued
        inferences += rows
        input_sum += input_ns
        infer_sum += infer_ns
        output_sum += output_ns
        lat = LAT[bisect_left(buckets, us)]
        latencies[lat] = latencies.get(lat, 0) + 1
        qlat = QLAT[bisect_left(buckets, queued)]
        latencies[qlat] = latencies.get(qlat, 0) + 1
        batch = by_rows.get(rows)
        if batch is None:
            by_rows[rows] = [1, infer_ns, input_ns, output_ns]
        else:
            batch[0] += 1
            batch[1] += infer_ns
            batch[2] += input_ns
            batch[3] += output_ns
    n = len(successes)
    for field, value in (("success_count", n), ("success_ns", total_us * 1000), ("queue_count", n),
                         ("queue_ns", queue_us * 1000), ("inference_count", inferences),
                         ("execution_count", n), ("compute_input_count", n), ("compute_infer_count", n),
                         ("compute_output_count", n),
                         ("compute_input_ns", input_sum), ("compute_infer_ns", infer_sum),
                         ("compute_output_ns", output_sum), *latencies.items()):
        into[field] = get(field, 0) + value
    for rows, sums in by_rows.items():
        for field, value in zip(_batch_fields(max(rows, 1)), sums):
            into[field] = get(field, 0) + value
    return into
