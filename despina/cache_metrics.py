"""Triton's server-wide response cache gauges (nv_cache_*, shown when a cache is configured), for the
whole deployment: every process keeps its own cache (response_cache.py), so entries, evictions and
utilization are the sum over the processes that report one, and hits and misses the sum over the
model versions' statistics (the same counts as nv_cache_num_hits_per_model)."""
from __future__ import annotations

from typing import Any, Protocol

# name and HELP, Triton 2.51's word for word
GAUGES = (
    ("nv_cache_util", "Cache utilization [0.0 - 1.0]"),
    ("nv_cache_num_entries", "Number of responses stored in response cache"),
    ("nv_cache_num_hits", "Number of cache hits in response cache"),
    ("nv_cache_num_misses", "Number of cache misses in response cache"),
    ("nv_cache_num_lookups", "Number of cache lookups in response cache"),
    ("nv_cache_num_evictions", "Number of cache evictions in response cache"),
    ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds"),
    ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds"),
)


class Out(Protocol):
    def family(self, name: str, kind: str, help_: str) -> None: ...
    def sample(self, name: str, labels: dict[str, str], value: float) -> None: ...


def figures(processes: dict[str, dict[str, Any]], models: list[dict[str, Any]]) -> dict[str, float]:
    """The gauges' values. A miss's lookup is timed together with its insert (response_cache.through):
    the lookup duration is the hits', the insertion duration the misses' lookup and insert, so that the
    two add up to Triton's two."""
    held = sum(f.get("bytes", 0) for f in processes.values())
    capacity = sum(f.get("capacity_bytes", 0) for f in processes.values())
    hits = sum(m["stats"].get("cache_hit_count", 0) for m in models)
    misses = sum(m["stats"].get("cache_miss_count", 0) for m in models)
    return {
        "nv_cache_util": held / capacity if capacity else 0.0,
        "nv_cache_num_entries": sum(f.get("entries", 0) for f in processes.values()),
        "nv_cache_num_hits": hits,
        "nv_cache_num_misses": misses,
        "nv_cache_num_lookups": hits + misses,
        "nv_cache_num_evictions": sum(f.get("evictions", 0) for f in processes.values()),
        "nv_cache_lookup_duration": sum(m["stats"].get("cache_hit_ns", 0) for m in models) // 1000,
        "nv_cache_insertion_duration": sum(m["stats"].get("cache_miss_ns", 0) for m in models) // 1000,
    }


def render(out: Out, processes: dict[str, dict[str, Any]], models: list[dict[str, Any]]) -> None:
    """The gauges, where some process reports a response cache (as Triton shows them only with one)."""
    if not processes:
        return
    values = figures(processes, models)
    for name, help_ in GAUGES:
        out.family(name, "gauge", help_)
        out.sample(name, {}, values[name])
