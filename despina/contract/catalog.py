"""The catalog: what the control plane says each model is, which versions serve, and where.

The control plane is the only writer. Workers load what names them in `workers`; gateways route by
`versions`, `retiring` and the workers' reported states.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from .errors import DespinaError, NotFound, Unavailable

LOADED, IDLE, UNLOADED = "loaded", "idle", "unloaded"  # targets
RETIRED_KEPT = 16  # the versions a model no longer loads that the index still lists, per model


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    path: str                         # a local folder, or the model folder's URL in the registry (s3://)
    config: dict[str, Any]            # Triton's JSON form, auto-completed
    versions: tuple[int, ...]         # versions to load, ascending (the policy's, plus any retiring)
    state: str = "READY"              # READY, or UNAVAILABLE when the config cannot be used
    reason: str = ""
    available: tuple[int, ...] = field(default=())  # every version folder present
    revisions: dict[int, str] = field(default_factory=dict)  # version -> digest of its files and config
    files: tuple[tuple[str, int, str], ...] = ()  # remote registries: (path, size, etag) to fetch
    target: str = LOADED              # loaded, idle (scaled to zero: loads on demand), unloaded
    workers: tuple[str, ...] = ()     # where the control plane placed the model
    retiring: tuple[int, ...] = ()    # still loaded while newer versions come up; not the default
    failed: dict[int, str] = field(default_factory=dict)  # version -> why its current files failed
    footprint: int = 0                # estimated bytes of memory the loaded versions take
    step_only: bool = False           # loaded only as a step of an ensemble, never asked for by name
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)  # output -> its label_filename's lines
    # versions loaded once and unloaded since (retired by newer ones, unloaded, scaled to zero), the latest
    # last: Triton's index lists them UNAVAILABLE "unloaded", and a request naming one is told so
    retired: tuple[int, ...] = ()
    # versions whose load failed and that the model no longer loads (its files or policy changed, or the
    # load that brought them was taken back), with the load's error, the latest last: Triton's index goes
    # on listing them UNAVAILABLE with it until a load of theirs succeeds
    dropped: dict[int, str] = field(default_factory=dict)
    # the load API's `config` it was read with, and the fingerprint of the model's files then: as Triton's,
    # a later load without one keeps it until the files change (commands.py)
    override: dict[str, Any] | None = None
    override_files: str = ""
    # the loads that asked again for versions that had failed with these same files (commands.py): a worker
    # tries such a version's files again when it moves (attempt()), as Triton's load tries a failed model
    tries: int = 0
    # a cold start that failed: the model went back to scaled to zero with its load's error (cold_error),
    # the failures in a row, and when (clock.now()) a request may try again; until then requests hear the
    # error at once. A cold start that serves, a load and new files forget it
    cold_error: str = ""
    cold_failures: int = 0
    cold_retry_at: float = 0.0
    # an ensemble unloaded because a model it calls was: as Triton's dependents, it loads again once every
    # model it calls is loaded (commands.py); an unload or load of its own ends that
    with_steps: bool = False
    # when (clock.now()) the cold start under way began, 0.0 when none is: a control plane that takes over
    # mid cold start reads it here, and times it, backs it off if it fails, as the one that began it would
    cold_since: float = 0.0

    @property
    def serving(self) -> bool:
        return self.state == "READY" and self.target == LOADED

    @property
    def loaded(self) -> bool:
        """Usable and not unloaded: serving, or scaled to zero (a request wakes it)."""
        return self.state == "READY" and self.target != UNLOADED

    def attempt(self, version: int) -> str:
        """What a worker's failure to load a version is known by: its revision, and `tries` once moved."""
        rev = self.revisions.get(version, "")
        return f"{rev}/{self.tries}" if self.tries else rev

    def streams(self, keys: Any, version: int) -> list[str]:
        """Every request stream of one version: one per priority level."""
        levels = int((self.config.get("dynamic_batching") or {}).get("priority_levels", 0) or 0)
        return [keys.request_stream(self.name, version, level) for level in range(1, max(levels, 1) + 1)]

    def dumps(self) -> bytes:
        return orjson.dumps({
            "name": self.name, "path": self.path, "config": self.config, "versions": list(self.versions),
            "state": self.state, "reason": self.reason, "available": list(self.available),
            "revisions": {str(v): r for v, r in self.revisions.items()},
            "files": [list(f) for f in self.files], "target": self.target, "workers": list(self.workers),
            "retiring": list(self.retiring), "failed": {str(v): r for v, r in self.failed.items()},
            "footprint": self.footprint, "step_only": self.step_only,
            **({"labels": {k: list(v) for k, v in self.labels.items()}} if self.labels else {}),
            **({"retired": list(self.retired)} if self.retired else {}),
            **({"dropped": {str(v): r for v, r in self.dropped.items()}} if self.dropped else {}),
            **({"override": self.override, "override_files": self.override_files}
               if self.override is not None else {}),
            **({"tries": self.tries} if self.tries else {}),
            **({"cold_error": self.cold_error, "cold_failures": self.cold_failures,
                "cold_retry_at": self.cold_retry_at} if self.cold_error else {}),
            **({"cold_since": self.cold_since} if self.cold_since else {}),
            **({"with_steps": True} if self.with_steps else {})})

    @classmethod
    def loads(cls, raw: bytes | str) -> CatalogEntry:
        d = orjson.loads(raw)
        return cls(d["name"], d["path"], d["config"], tuple(d["versions"]), d.get("state", "READY"),
                   d.get("reason", ""), tuple(d.get("available", ())),
                   {int(v): r for v, r in (d.get("revisions") or {}).items()},
                   tuple((f[0], int(f[1]), f[2]) for f in d.get("files", ())), d.get("target", LOADED),
                   tuple(d.get("workers", ())), tuple(d.get("retiring", ())),
                   {int(v): r for v, r in (d.get("failed") or {}).items()}, int(d.get("footprint", 0)),
                   bool(d.get("step_only", False)),
                   {k: tuple(v) for k, v in (d.get("labels") or {}).items()}, tuple(d.get("retired", ())),
                   {int(v): r for v, r in (d.get("dropped") or {}).items()}, d.get("override"),
                   d.get("override_files", ""), int(d.get("tries", 0)), d.get("cold_error", ""),
                   int(d.get("cold_failures", 0)), float(d.get("cold_retry_at", 0.0)),
                   bool(d.get("with_steps", False)), float(d.get("cold_since", 0.0)))


def read_entries(raw: Mapping[bytes, bytes]) -> tuple[dict[str, CatalogEntry], dict[str, str]]:
    """The catalog hash's entries by name, and those that cannot be read (name -> why: written by hand, or
    by another version), which each reader skips, saying so."""
    entries: dict[str, CatalogEntry] = {}
    bad: dict[str, str] = {}
    for key, blob in raw.items():
        name = key.decode(errors="replace")
        try:
            entries[name] = CatalogEntry.loads(blob)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            bad[name] = f"{type(exc).__name__}: {exc}"
    return entries, bad


def retire(e: CatalogEntry, gone: Iterable[int], versions: Iterable[int]) -> tuple[int, ...]:
    """`e.retired` with the versions `gone` added (the latest last, RETIRED_KEPT at most), less those the
    entry loads again (`versions`)."""
    added = sorted(set(gone))
    loads = set(versions)
    kept = [v for v in e.retired if v not in added] + added
    return tuple(v for v in kept if v not in loads)[-RETIRED_KEPT:]


def drop(e: CatalogEntry, gone: dict[int, str], versions: Iterable[int]) -> dict[int, str]:
    """`e.dropped` with the failed versions `gone` added (version -> why; the latest last, RETIRED_KEPT at
    most), less those the entry loads again (`versions`)."""
    loads = set(versions)
    kept = {v: why for v, why in e.dropped.items() if v not in gone}
    kept.update(sorted(gone.items()))
    return dict([(v, why) for v, why in kept.items() if v not in loads][-RETIRED_KEPT:])


def version_refused(e: CatalogEntry, v: int) -> DespinaError:
    """What a request naming a version that the model does not serve hears, as Triton's (its GetModel): one
    it has a record of (loaded and unloaded since, or failed to load) is 'not at ready state' (503), any
    other 'not found' (404)."""
    if v in e.retired or v in e.dropped or (e.target == UNLOADED and v in e.versions):
        return Unavailable(f"Request for unknown model: '{e.name}' version {v} is not at ready state")
    return NotFound(f"Request for unknown model: '{e.name}' version {v} is not found")


def cold_start_failed(e: CatalogEntry, now: float) -> Unavailable | None:
    """What a request for a model whose cold start failed hears until a request may try again (None from
    then on): the load's error, 503 with Retry-After the time left, as the same load's first caller heard."""
    left = e.cold_retry_at - now
    if not e.cold_error or e.target != IDLE or left <= 0:
        return None
    times = "once" if e.cold_failures == 1 else f"{e.cold_failures} times in a row"
    return Unavailable(f"{e.cold_error} (its cold start failed {times}; a request in {math.ceil(left)} s or "
                       "later tries again)", retry_after=left)


def not_loaded(name: str) -> NotFound:
    """What infer, metadata and config answer for a model in the repository that is not loaded: Triton's
    404 and words."""
    return NotFound(f"Request for unknown model: '{name}' has no available versions (it is not loaded)")


def none_loaded(e: CatalogEntry, versions: tuple[int, ...] | list[int] | None = None) -> NotFound | None:
    """What infer, metadata and config answer for a model whose every version (of `versions`, else all)
    failed to load: Triton's 404 and words (with why); None while one has not."""
    versions = e.versions if versions is None else versions
    if not versions or any(v not in e.failed for v in versions):
        return None
    v = versions[-1]
    return NotFound(f"Request for unknown model: '{e.name}' has no available versions (version {v}: "
                    f"{e.failed[v]})")


def unloaded(e: CatalogEntry, version: str | None) -> DespinaError:
    """What a request to a model unloaded through the API hears: not_loaded(), or for a version it had
    loaded, Triton's 503 (its versions stay known, UNAVAILABLE)."""
    if version and version.isdigit() and int(version) in (*e.versions, *e.retired, *e.dropped):
        return version_refused(e, int(version))
    return not_loaded(e.name)
