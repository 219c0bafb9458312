"""What a worker tells the others about itself: its capacity and the state of each model version.

A worker writes these into its own hash (`Keys.worker`) on every heartbeat; the hash expires when the
heartbeats stop. Fields: `info` (WorkerInfo JSON), `models` ({model: {version: state}} of the runners
that serve), `detail` ({model: {version: VersionStatus}}), `state` (state_digest of those two and of the
clock's warning), `cache` (artifact cache counters), `custom_metrics` (the metrics its Python models made,
msgpack; custom_metrics.py), `clock` ({"offset_s": its clock's offset to Redis's, "warning": why that is
too much, or ""}: clock.py), `leaving` ("1" once the worker was told to stop and hands its models over:
no placement gives it any more, and it lets go of what it has once that loaded elsewhere).
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    host: str = ""
    pid: int = 0
    started: float = 0.0
    cpus: int = 1
    gpus: int = 0                  # GPUs this worker may use
    memory_bytes: int = 0          # what models may take on this worker (0: unknown)

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str) -> WorkerInfo:
        d = orjson.loads(raw)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class VersionStatus:
    """One model version on one worker."""

    state: str = "UNAVAILABLE"     # READY (a runner serves `revision`), LOADING, UNLOADING, UNAVAILABLE
    revision: str = ""             # the revision that serves (READY), else the one being loaded
    loading: str = ""              # a newer revision being loaded while `revision` serves
    replaced: str = ""             # the revision `revision` replaced, still answering what it read
    error: str = ""                # why `failed` could not be loaded
    failed: str = ""               # the revision that failed
    load_ms: float = 0.0           # how long the serving runner took to load
    gpus: int = 0                  # the GPUs the serving runner's backend saw: how its KIND_AUTO resolved

    def pack(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v}

    @classmethod
    def unpack(cls, d: dict[str, Any]) -> VersionStatus:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class WorkerStatus:
    info: WorkerInfo
    detail: dict[str, dict[int, VersionStatus]] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    ensembles: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the versions it runs itself
    clock: dict[str, Any] = field(default_factory=dict)  # offset_s, warning: at its last change of state
    leaving: bool = False  # told to stop: no home for models, and it serves on until its own have another

    def version(self, model: str, version: int) -> VersionStatus | None:
        return self.detail.get(model, {}).get(version)

    def ready(self, model: str, version: int, revision: str | None = None) -> bool:
        status = self.version(model, version)
        return (status is not None and status.state == "READY"
                and (revision is None or status.revision == revision))

    def failed(self, model: str, version: int, revision: str) -> str | None:
        status = self.version(model, version)
        if status is not None and status.failed == revision and status.error:
            return status.error
        return None

    @classmethod
    def from_hash(cls, worker_id: str, h: dict[bytes, bytes]) -> WorkerStatus:
        info = WorkerInfo.loads(h[b"info"]) if b"info" in h else WorkerInfo(worker_id)
        detail = {name: {int(v): VersionStatus.unpack(s) for v, s in versions.items()}
                  for name, versions in orjson.loads(h.get(b"detail", b"{}")).items()}
        ensembles = {name: tuple(vs) for name, vs in orjson.loads(h.get(b"ensembles", b"{}")).items()}
        return cls(info, detail, orjson.loads(h.get(b"cache", b"{}")), ensembles,
                   orjson.loads(h.get(b"clock", b"{}")), h.get(b"leaving") == b"1")


def pack_detail(detail: dict[str, dict[int, VersionStatus]]) -> bytes:
    return orjson.dumps({name: {str(v): s.pack() for v, s in versions.items()}
                         for name, versions in detail.items()})


def state_digest(models: bytes, detail: bytes, clock_warning: str = "", leaving: bool = False) -> bytes:
    """The `state` field of a worker's hash: readers of `models` and `detail` (every gateway, twice a second)
    read them again only when it moved; a heartbeat rewrites them unchanged most of the time. A clock
    warning that comes or goes moves it too, so that the control plane's status shows it, and so does the
    worker's leaving, so that placement sees it."""
    tail = b"\0leaving" if leaving else b""
    return hashlib.blake2b(models + b"\0" + detail + b"\0" + clock_warning.encode() + tail,
                           digest_size=8).hexdigest().encode()
