"""Which workers load a model: instance_group kind and GPUs, memory, keeping an ensemble's models
together, and spreading the load.

Pure functions of the catalog and the workers' reported capacity, so each rule is testable alone.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from ..contract.catalog import CatalogEntry
from ..contract.cluster import WorkerInfo, WorkerStatus
from ..contract.ensemble import called_by, is_ensemble
from ..contract.errors import ConfigError
from ..contract.modelconfig import parameter_int
from .repository import parameter


@dataclass(frozen=True)
class Need:
    gpus: int = 0              # GPUs a worker must have (KIND_GPU: the highest index named, plus one)
    prefers_gpu: bool = False  # KIND_AUTO: a GPU when there is one
    memory: int = 0            # bytes


def need(entry: CatalogEntry) -> Need:
    gpus, prefers = 0, False
    for group in entry.config.get("instance_group") or [{}]:
        kind = group.get("kind") or "KIND_AUTO"
        if kind == "KIND_GPU":
            gpus = max(gpus, max((int(g) for g in group.get("gpus") or ()), default=0) + 1)
        elif kind == "KIND_AUTO":
            prefers = True
    return Need(gpus, prefers and gpus == 0, entry.footprint)


def replicas(entry: CatalogEntry, default: int) -> int:
    """How many workers should load the model: its `replicas` parameter, else the default; 0 = all. A
    stateful model (sequence_batching) loads on one: a sequence's requests must meet its state there."""
    raw = parameter(entry.config, "replicas")
    if "sequence_batching" in entry.config:
        if raw is not None and str(raw).strip() != "1":
            raise ConfigError(f"model '{entry.name}': a model with sequence_batching runs on one worker "
                              f"(its sequences keep their state there); parameter 'replicas' must be 1")
        return 1
    if raw is None:
        return default
    return parameter_int(entry.name, "'replicas'", str(raw))


def committed(entries: Iterable[CatalogEntry], base: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes each worker has been given, by the catalog's placement (added to `base`'s)."""
    used = dict(base or {})
    for e in entries:
        if e.serving:
            for w in e.workers:
                used[w] = used.get(w, 0) + e.footprint
    return used


def uncommitted(used: Mapping[str, int], entry: CatalogEntry) -> dict[str, int]:
    """`used` (committed() of the catalog) without what `entry` takes: what every other model takes."""
    rest = dict(used)
    if entry.serving:
        for w in entry.workers:
            rest[w] = rest.get(w, 0) - entry.footprint
    return rest


def eligible(n: Need, worker: WorkerInfo, used: int) -> str | None:
    """Why `worker` cannot take a model with need `n`, or None when it can."""
    if n.gpus > worker.gpus:
        return f"worker {worker.id} has {worker.gpus} GPU(s), the model needs {n.gpus}"
    if worker.memory_bytes and used + n.memory > worker.memory_bytes:
        free = max(0, worker.memory_bytes - used)
        return (f"worker {worker.id} has {free / 2**20:.0f} MiB free, the model needs "
                f"{n.memory / 2**20:.0f} MiB")
    return None


def out_of_memory(entry: CatalogEntry, workers: Mapping[str, WorkerInfo], used: Mapping[str, int],
                  exclude: Iterable[str] = ()) -> bool:
    """Whether memory alone keeps the model off every live worker: each has the GPUs it needs and would
    take it, but for the room its other models take (or it is too big for the worker altogether)."""
    n = need(entry)
    excluded = set(exclude)
    live = [(wid, info) for wid, info in workers.items() if wid not in excluded]
    return bool(live) and all(n.gpus <= info.gpus and bool(info.memory_bytes)
                              and used.get(wid, 0) + n.memory > info.memory_bytes for wid, info in live)


class FixedWorkers:
    """A fixed set of `expected` workers (serve's own, DESPINA_FIXED_WORKERS) and what those seen offer: once
    they have all come, a model none of them could hold is known as such. A worker that restarts comes
    back as it was: what it offered counts while it is away."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.most_alive = 0
        self.capacities: dict[tuple[int, int], WorkerInfo] = {}  # (GPUs, memory) -> a worker offering them

    def see(self, live: Mapping[str, WorkerInfo]) -> None:
        self.most_alive = max(self.most_alive, len(live))
        for info in live.values():
            self.capacities.setdefault((info.gpus, info.memory_bytes), info)

    def unfit(self, entry: CatalogEntry) -> str:
        """Why none of the set could take the model even with nothing else loaded on it (the GPUs its
        instance_group needs, the memory it takes); "" when one could, or while they have not all come."""
        infos = list(self.capacities.values())
        if self.most_alive < self.expected or not infos:
            return ""
        n = need(entry)
        most_gpus = max(i.gpus for i in infos)
        if n.gpus > most_gpus:
            have = f"no worker has that many (at most {most_gpus})" if most_gpus else "no GPUs are available"
            return f"instance_group kind KIND_GPU needs {n.gpus} GPU(s), but {have}"
        with_gpus = [i for i in infos if i.gpus >= n.gpus]
        if all(i.memory_bytes and n.memory > i.memory_bytes for i in with_gpus):
            most = max(i.memory_bytes for i in with_gpus)
            return (f"the model needs {n.memory / 2**20:.0f} MiB of memory, but no worker has that much for "
                    f"models (at most {most / 2**20:.0f} MiB; DESPINA_WORKER_MEMORY_MB)")
        return ""


def ensemble_mates(entries: Iterable[CatalogEntry]) -> dict[str, set[str]]:
    """Per model, the models that share an ensemble with it (partners() of each model reads these:
    found once for all the models a tick places, not once per model)."""
    mates: dict[str, set[str]] = {}
    for e in entries:
        if is_ensemble(e.config):
            called = called_by(e.config)
            for m in called:
                mates.setdefault(m, set()).update(called - {m})
    return mates


def partners(name: str, mates: Mapping[str, set[str]], entries: Mapping[str, CatalogEntry]) -> dict[str, int]:
    """Per worker, how many of the models that share an ensemble with model `name` (`mates`, from
    ensemble_mates()) it has: a worker with every model an ensemble calls runs the ensemble itself (one
    trip through Redis, not one per step)."""
    near: dict[str, int] = {}
    for mate in mates.get(name, ()):
        e = entries.get(mate)
        if e is not None and e.serving:
            for w in e.workers:
                near[w] = near.get(w, 0) + 1
    return near


def place(entry: CatalogEntry, workers: Mapping[str, WorkerInfo], used: Mapping[str, int], count: int,
          exclude: Iterable[str] = (), near: Mapping[str, int] | None = None) -> tuple[tuple[str, ...], str]:
    """The model's placement: its live workers kept, more added up to `count` (0 = every eligible one).

    Returns the workers and, when it falls short, why. Preferred: a GPU worker for KIND_AUTO, a CPU-only
    worker otherwise (GPUs stay free for what needs them), then the worker with the most of the models
    that share an ensemble with it (`near`, from partners()), then the fewest bytes committed.
    """
    near = near or {}
    n = need(entry)
    kept = [w for w in entry.workers if w in workers]
    excluded = set(exclude)
    reasons = []
    candidates = []
    for wid, info in workers.items():
        if wid in kept or wid in excluded:
            continue
        why = eligible(n, info, used.get(wid, 0))
        if why:
            reasons.append(why)
            continue
        gpu_mismatch = (info.gpus == 0) if (n.prefers_gpu or n.gpus) else (info.gpus > 0)
        candidates.append((gpu_mismatch, -near.get(wid, 0), used.get(wid, 0), wid))
    candidates.sort()
    wanted = len(kept) + len(candidates) if count == 0 else count
    chosen = tuple(kept + [c[-1] for c in candidates][:max(0, wanted - len(kept))])
    if len(chosen) >= max(wanted, 1):
        return chosen, ""
    if not workers:
        return chosen, "no worker is running"
    if excluded and not reasons and not candidates:
        return chosen, f"it failed to load on worker(s) {', '.join(sorted(excluded))}"
    return chosen, "; ".join(reasons) or f"{len(chosen)} of {wanted} workers available"


def handing_over(entry: CatalogEntry, homes: tuple[str, ...], status: Mapping[str, WorkerStatus],
                 leaving: Set[str]) -> tuple[str, ...]:
    """The `leaving` workers (told to stop) that keep the model while they hand it over: those of its
    workers that serve it, until each of its new `homes` (place()'s, from the workers not leaving) has
    loaded every version, or failed to. With no home for it, none: a worker has nothing to wait for."""
    serving = tuple(w for w in entry.workers if w in leaving and w in status
                    and any(status[w].ready(entry.name, v) for v in entry.versions))
    if not serving or not homes:
        return ()
    for wid in homes:
        for v in entry.versions:
            rev = entry.revisions.get(v)
            if v not in entry.failed and not (status[wid].ready(entry.name, v, rev)
                                              or status[wid].failed(entry.name, v, entry.attempt(v))):
                return serving
    return ()
