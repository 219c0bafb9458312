"""The live status page: models, versions, placement, queue depth, rates, latency, batch sizes, workers.

The control plane samples the statistics hashes every few seconds and keeps a window of samples;
rates, percentiles and recent batch-size histograms are differences between two samples.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import redis.asyncio as aioredis

from ..contract.catalog import IDLE, CatalogEntry
from ..contract.cluster import WorkerStatus
from ..contract.ensemble import is_ensemble
from ..contract.keys import Keys
from ..metrics import collect
from ..workers.stats import LATENCY_BUCKETS_US

PERIOD_S = 2.0
RATE_S = 10.0            # requests/s over this much
RECENT_S = 300.0         # latency percentiles and batch sizes over this much: the oldest sample kept


class StatusTracker:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.samples: deque[tuple[float, dict[str, dict[str, int]]]] = deque()
        self.catalog: dict[str, CatalogEntry] = {}
        self.workers: list[WorkerStatus] = []
        self.backlog: dict[str, int] = {}

    async def sample(self) -> None:
        data = await collect(self.redis, self.keys)
        now = time.time()
        stats = {f"{m['model']}:{m['version']}": m["stats"] for m in data["models"]}
        self.backlog = {f"{m['model']}:{m['version']}": sum(m["backlog"]) for m in data["models"]}
        self.samples.append((now, stats))
        # an older sample is never read (_since), and each holds every model version's counters
        while self.samples and now - self.samples[0][0] > RECENT_S:
            self.samples.popleft()
        self.catalog = data["catalog"]
        self.workers = [WorkerStatus.from_hash(wid, h) for wid, h in data["heartbeats"].items()]

    def _since(self, seconds: float) -> tuple[float, dict[str, dict[str, int]]] | None:
        if not self.samples:
            return None
        newest = self.samples[-1][0]
        for sample in self.samples:
            if newest - sample[0] <= seconds:
                return sample
        return self.samples[-1]

    def snapshot(self) -> dict[str, Any]:
        now, current = self.samples[-1] if self.samples else (time.time(), {})
        rate_base, recent_base = self._since(RATE_S), self._since(RECENT_S)
        models = []
        for name, entry in sorted(self.catalog.items()):
            for version in entry.versions or (-1,):  # -1: a row for a model with no version (0 is one)
                key = f"{name}:{version}"
                stats = current.get(key, {})
                models.append({
                    "name": name, "version": version if version >= 0 else None, "state": entry.state,
                    "target": entry.target,
                    "reason": entry.failed.get(version) or (entry.cold_error if entry.target == IDLE else "")
                    or entry.reason,
                    "versions": list(entry.versions),
                    "ensemble": is_ensemble(entry.config), "failed": version in entry.failed,
                    # an ensemble's: the workers that run it themselves (none: gateways chain its steps)
                    "workers": [w.info.id for w in self.workers
                                if w.ready(name, version) or version in w.ensembles.get(name, ())],
                    "placed": list(entry.workers), "queue": self.backlog.get(key, 0),
                    "requests_per_s": _rate(rate_base, now, key, stats),
                    **_latency(recent_base, key, stats),
                    "batch_sizes": _batches(recent_base, key, stats),
                    "success": stats.get("success_count", 0), "failures": stats.get("fail_count", 0),
                    "cold_starts": stats.get("cold_count", 0),
                    "cold_start_failures": stats.get("cold_failed", 0),
                    "load_crashes": stats.get("load_crashes", 0),  # workers that died loading it
                    "cold_start_ms": round(stats.get("cold_ns", 0) / 1e6 / stats["cold_count"], 1)
                    if stats.get("cold_count") else None,
                })
        # leaving: told to stop (SIGTERM), it hands its models over to the others and serves until they have
        workers = [{"id": w.info.id, "state": "leaving" if w.leaving else "serving", "host": w.info.host,
                    "pid": w.info.pid, "cpus": w.info.cpus, "gpus": w.info.gpus,
                    "memory_bytes": w.info.memory_bytes,
                    "models": {m: {str(v): s.state for v, s in vs.items()} for m, vs in w.detail.items()},
                    "ensembles": {m: list(vs) for m, vs in w.ensembles.items()},
                    "clock_offset_s": w.clock.get("offset_s", 0.0),
                    "clock_warning": w.clock.get("warning", "")}
                   for w in self.workers]
        return {"time": now, "models": models, "workers": workers}


def _delta(base: tuple[float, dict[str, dict[str, int]]] | None, key: str, stats: dict[str, int],
           field: str) -> int:
    old = base[1].get(key, {}).get(field, 0) if base else 0
    return stats.get(field, 0) - old


def _rate(base: tuple[float, dict[str, dict[str, int]]] | None, now: float, key: str,
          stats: dict[str, int]) -> float:
    if base is None or now <= base[0]:
        return 0.0
    done = _delta(base, key, stats, "success_count") + _delta(base, key, stats, "fail_count")
    return round(done / (now - base[0]), 1)


def _latency(base: tuple[float, dict[str, dict[str, int]]] | None, key: str, stats: dict[str, int]
             ) -> dict[str, float | None]:
    counts = [_delta(base, key, stats, f"lat:{i}") for i in range(len(LATENCY_BUCKETS_US) + 1)]
    return {"p50_ms": _percentile(counts, 0.50), "p99_ms": _percentile(counts, 0.99)}


def _percentile(counts: list[int], q: float) -> float | None:
    """Linear interpolation inside the histogram bucket that holds the q-th request."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if seen + n >= rank and n:
            low = LATENCY_BUCKETS_US[i - 1] if i else 0
            high = LATENCY_BUCKETS_US[i] if i < len(LATENCY_BUCKETS_US) else LATENCY_BUCKETS_US[-1] * 2
            return round((low + (high - low) * (rank - seen) / n) / 1000, 2)
        seen += n
    return None


def _batches(base: tuple[float, dict[str, dict[str, int]]] | None, key: str, stats: dict[str, int]
             ) -> dict[str, int]:
    sizes = sorted(int(k.split(":", 1)[1]) for k in stats if k.startswith("batch:"))
    out = {str(s): _delta(base, key, stats, f"batch:{s}") for s in sizes}
    return {s: n for s, n in out.items() if n}
