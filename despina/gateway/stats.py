"""Triton's statistics extension: per model version counters, summed over every worker in Redis."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..contract.catalog import CatalogEntry
from ..contract.errors import InvalidArgument

if TYPE_CHECKING:
    from .app import Gateway

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")


async def model_statistics(gw: Gateway, model: str | None, version: str | None) -> dict[str, Any]:
    """As Triton answers: the versions loaded; InvalidArgument (Triton's 400) for a model or version
    that is not (unknown, unloaded, or failed to load)."""
    if model is None:  # in Triton's order: by name, then version (its models are in a sorted map)
        targets = sorted((m.entry.name, v) for m in gw.view.models.values() for v in _loaded(m.entry))
    else:
        known = gw.view.models.get(model)
        loaded = _loaded(known.entry) if known is not None else []
        if not loaded:
            raise InvalidArgument(f"requested model '{model}' is not available")
        if version is not None:
            if not version.isdigit() or int(version) not in loaded:
                raise InvalidArgument(f"requested model version is not available for model '{model}'")
            targets = [(model, int(version))]
        else:
            targets = [(model, v) for v in loaded]
    pipe = gw.redis.pipeline(transaction=False)
    for name, v in targets:
        pipe.hgetall(gw.keys.stats(name, v))
        pipe.hgetall(gw.keys.stats_base(name, v))
    raw = await pipe.execute() if targets else []
    return {"model_stats": [_one(name, v, _since(raw[2 * i], raw[2 * i + 1]))
                            for i, (name, v) in enumerate(targets)]}


def _loaded(entry: CatalogEntry) -> list[int]:
    # the versions Triton would call READY: of a usable model not unloaded, those that did not fail
    if not entry.loaded:
        return []
    return [v for v in entry.versions if v not in entry.failed]


def _since(now: dict[bytes, bytes], base: dict[bytes, bytes]) -> dict[str, int]:
    """The counters since the version's last load (Keys.stats_base), as Triton's statistics start again at
    a load: a last_inference unchanged since is none. Counters below their base (Redis lost them) are
    whole."""
    c = {k.decode(): int(v) for k, v in now.items()}
    b = {k.decode(): int(v) for k, v in base.items()}
    if not b or any(c.get(k, 0) < b.get(k, 0) for k in ("inference_count", "execution_count", "fail_count")):
        return c
    since = {k: n - b.get(k, 0) for k, n in c.items()}  # (fields that are no counters are not read)
    last = c.get("last_inference", 0)
    since["last_inference"] = 0 if last == b.get("last_inference") else last
    return {k: n for k, n in since.items() if n}  # (a batch size not run since is not listed)


def _one(name: str, version: int, c: dict[str, int]) -> dict[str, Any]:
    stats = {d: {"count": c.get(f"{d}_count", 0), "ns": c.get(f"{d}_ns", 0)} for d in DURATIONS}
    batches = sorted(int(k.split(":", 1)[1]) for k in c if k.startswith("batch:"))
    return {
        "name": name,
        "version": str(version),
        "last_inference": c.get("last_inference", 0),
        "inference_count": c.get("inference_count", 0),
        "execution_count": c.get("execution_count", 0),
        "inference_stats": stats,
        # per response index, from backends that report each response (Triton's test backend); neither
        # its Python nor its ONNX Runtime backend does, and Triton sends {} for theirs
        "response_stats": {},
        "batch_stats": [{"batch_size": b,
                         "compute_input": {"count": c[f"batch:{b}"], "ns": c.get(f"batch_in_ns:{b}", 0)},
                         "compute_infer": {"count": c[f"batch:{b}"], "ns": c.get(f"batch_ns:{b}", 0)},
                         "compute_output": {"count": c[f"batch:{b}"], "ns": c.get(f"batch_out_ns:{b}", 0)}}
                        for b in batches],
        "memory_usage": [],
    }
