"""Triton's latency summaries (--metrics-config summary_latencies=true): recent latencies, kept by each
worker for its requests, by whoever runs an ensemble (a worker or a gateway) for its requests, and by each
response cache (a gateway's or a worker's) for its lookups.

Per model version a worker keeps, for the last MAX_AGE_S seconds, how many requests took about how long:
counts in buckets whose bounds grow by GAMMA (each bucket's middle is within 1% of every latency in it),
for the request, its queue wait and its compute input, infer and output. Its heartbeat carries them (a
gateway's report, every 5 s, its ensembles'); the control plane adds every process's together and
answers a quantile from the sum (metrics.py). Counts add
where quantile sketches would not: the cluster's quantile is one over every worker's requests.
The window slides as Triton's (prometheus-cpp's) does: AGE_BUCKETS windows of MAX_AGE_S / AGE_BUCKETS
each, the oldest dropped as a new one starts. Nothing of this runs unless the setting is on.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from .contract.records import GROUPED, InferReply, requests_in

GAMMA = 1.02
_LOG_GAMMA = math.log(GAMMA)
MAX_AGE_S = 60.0    # prometheus-cpp's default, which Triton 2.51 keeps
AGE_BUCKETS = 5
QUANTITIES = ("request", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
              "cache_miss")

Counts = dict[int, int]           # bucket -> requests; bucket 0 holds latencies under 1 us
Exported = dict[str, list[int]]   # quantity -> [bucket, count, bucket, count, ...]


def middle(index: int) -> float:
    """A latency that stands for bucket `index`: within 1% of every one counted in it."""
    if index == 0:
        return 0.0
    high = GAMMA ** (index - 1)
    return 2 * high / (1 + GAMMA) if index > 1 else 1.0


class LatencyWindow:
    """One model version's latencies over the last MAX_AGE_S seconds on this worker."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._span = MAX_AGE_S / AGE_BUCKETS
        self._windows: list[tuple[float, dict[str, Counts]]] = []  # (start, counts), the newest last
        self.request: Counts = {}
        self.queue: Counts = {}
        self.compute_input: Counts = {}
        self.compute_infer: Counts = {}
        self.compute_output: Counts = {}
        self.cache_hit: Counts = {}     # a response cache's lookups that found the answer (response_cache.py)
        self.cache_miss: Counts = {}    # and those that did not: lookup and insert
        self._turn()

    def _turn(self) -> None:
        """Start a new window (its counts become the ones `add` is given), and forget those too old."""
        now = self._now()
        self._windows = [w for w in self._windows if now - w[0] < MAX_AGE_S]
        fresh: tuple[Counts, ...] = tuple({} for _ in QUANTITIES)
        (self.request, self.queue, self.compute_input, self.compute_infer, self.compute_output,
         self.cache_hit, self.cache_miss) = fresh
        self._windows.append((now, dict(zip(QUANTITIES, fresh, strict=True))))

    def turn_if_due(self) -> None:
        """Called once per batch, before its `add`s."""
        if self._now() - self._windows[-1][0] >= self._span:
            self._turn()

    @staticmethod
    def add(counts: Counts, us: float, n: int = 1) -> None:
        index = 0 if us < 1 else int(math.ceil(math.log(us) / _LOG_GAMMA)) + 1
        counts[index] = counts.get(index, 0) + n

    def export(self) -> Exported:
        """The counts of the last MAX_AGE_S seconds, by quantity (those with none left out)."""
        now = self._now()
        self._windows = [w for w in self._windows if now - w[0] < MAX_AGE_S] or self._windows[-1:]
        out: Exported = {}
        for quantity in QUANTITIES:
            total: Counts = {}
            for start, counts in self._windows:
                if now - start >= MAX_AGE_S:
                    continue
                for index, n in counts[quantity].items():
                    total[index] = total.get(index, 0) + n
            if total:
                out[quantity] = [x for item in sorted(total.items()) for x in item]
        return out


def observe(window: LatencyWindow, replies: list[InferReply], rows: int, timings_ns: tuple[int, int, int],
            later: int = 0) -> None:
    """One batch's latencies, as stats.tally counts them into the counters: a succeeded request's
    latency and queue wait, and each request the execution computed its compute input, infer and output,
    those whose replies come later (`later`, a decoupled model's) included: their batch has no reply."""
    window.turn_if_due()
    ok = [r for r in replies if r.error is None]
    if not ok and (replies or not later):  # every request failed, or none ran
        return
    grouped = any(r.id[:1] == GROUPED for r in replies)  # a gateway's several requests sent as one
    add = window.add
    output_us = least_us = 0
    if rows:
        input_ns, infer_ns, output_ns = timings_ns
        output_us = -(-output_ns // 1000)
        least_us = -(-(input_ns + infer_ns + output_ns) // 1000)
        computed = (sum(requests_in(r.id) for r in ok) if grouped else len(ok)) + later
        add(window.compute_input, input_ns / 1000, computed)
        add(window.compute_infer, infer_ns / 1000, computed)
        add(window.compute_output, output_ns / 1000, computed)
    request, queue = window.request, window.queue
    for r in ok:
        k = requests_in(r.id) if grouped else 1
        add(request, r.queue_us + max(r.compute_us + output_us, least_us), k)
        add(queue, r.queue_us, k)


def observe_ensemble(window: LatencyWindow, us: int, queue_us: int,
                     compute_ns: tuple[int, int, int] | list[int]) -> None:
    """An ensemble request that succeeded, as stats.ensemble_counts counts it: its latency, its own queue
    wait, and its steps' compute input, infer and output, each summed."""
    window.turn_if_due()
    add = window.add
    add(window.request, us)
    add(window.queue, queue_us)
    add(window.compute_input, compute_ns[0] / 1000)
    add(window.compute_infer, compute_ns[1] / 1000)
    add(window.compute_output, compute_ns[2] / 1000)


def quantiles(exports: Iterable[Exported], quantity: str, qs: Iterable[float]) -> list[float]:
    """The qs-quantiles of `quantity` over several windows' exports (every worker's), their counts summed
    once: NaN when they hold none, as Triton's summary shows before any request. Rounded to a microsecond,
    as Triton's are."""
    total: Counts = {}
    for exported in exports:
        flat = exported.get(quantity, ())
        for i in range(0, len(flat), 2):
            total[flat[i]] = total.get(flat[i], 0) + flat[i + 1]
    seen = sum(total.values())
    indexes = sorted(total)
    out = []
    for q in qs:
        if not seen:
            out.append(math.nan)
            continue
        rank = max(1, math.ceil(q * seen))  # the smallest latency that at least q of them do not exceed
        running = 0
        for index in indexes:
            running += total[index]
            if running >= rank:
                break
        out.append(float(round(middle(index))))
    return out


def parse_quantiles(text: str) -> tuple[float, ...]:
    """--metrics-config summary_quantiles=<quantile>:<error>,...; raises ValueError saying what is wrong."""
    out: list[float] = []
    for item in text.split(","):
        q, sep, error = item.strip().partition(":")
        if not sep:
            raise ValueError(f"{item.strip()!r} has no ':'; the format is <quantile>:<error>,...")
        try:
            value, err = float(q), float(error)
        except ValueError:
            raise ValueError(f"{item.strip()!r}: quantile and error must be numbers") from None
        if not 0 <= value <= 1 or not 0 <= err <= 1:
            raise ValueError(f"{item.strip()!r}: quantile and error must be between 0 and 1")
        out.append(value)
    return tuple(out)
