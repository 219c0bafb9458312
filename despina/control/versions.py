"""A model's new files meet its old ones: which versions keep serving while the new ones load."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..contract.catalog import IDLE, LOADED, CatalogEntry, drop, retire


def transition(old: CatalogEntry | None, new: CatalogEntry, target: str,
               ready: Callable[[int], bool]) -> CatalogEntry:
    """The entry to publish when the registry's model changes from `old` to `new`.

    A new version loads beside the old ones; the old ones that serve now stay loaded (`retiring`) until
    the new ones are READY, and keep serving if they fail. New files that cannot even be read leave a
    serving model as it is, with the reason. A version that failed to load and is loaded no more is
    remembered with its error (`dropped`). The loads' `tries` carry over (workers know failures by it), and
    so does a failed cold start's backoff while the model stays scaled to zero on the same files, and the
    mark of a cold start under way (a load's entry drops it: a load is no cold start, commands.py).
    """
    entry = _next(old, new, target, ready)
    entry = replace(entry, dropped=dropped_since(old, entry, ready),
                    tries=old.tries if old is not None else 0)
    if old is None:
        return entry
    cold = bool(old.cold_since) and target == LOADED and entry.state == "READY"
    same = (old.state, old.revisions) == (new.state, new.revisions)
    if old.cold_error and (target == IDLE or cold) and same:
        # the same files, read again (a new leader): a failed cold start's backoff goes on, and its count of
        # failures in a row through the next cold start; new files end it. Forgotten, a restarting control
        # plane had a broken model loaded again by each first request
        entry = replace(entry, cold_error=old.cold_error, cold_failures=old.cold_failures,
                        cold_retry_at=old.cold_retry_at)
    if cold:  # read again by a leader that took over: a third one, if it comes to that, carries it on too
        entry = replace(entry, cold_since=old.cold_since)
    return entry


def try_again(e: CatalogEntry) -> CatalogEntry:
    """The entry a load publishes: the versions it loads that failed with these same files are tried again,
    as Triton's load tries a model whose load failed (a resource it lacked may be there now). Their failures
    are forgotten and `tries` moves, so that the workers that failed them load them again. An entry with no
    such version is left as it is: a model that serves, its files unchanged, is not loaded again."""
    again = [v for v in e.failed if v in e.versions and v not in e.retiring]
    if not again:
        return e
    return replace(e, failed={v: why for v, why in e.failed.items() if v not in again}, tries=e.tries + 1)


def _next(old: CatalogEntry | None, new: CatalogEntry, target: str,
          ready: Callable[[int], bool]) -> CatalogEntry:
    if new.state != "READY":
        if old is not None and old.state == "READY" and old.target != IDLE:
            return replace(old, reason=f"the repository's current files cannot be used: {new.reason}")
        return replace(new, target=target, retired=retired_since(old, new, ready=ready))
    if old is None or old.state != "READY" or old.target != LOADED or target != LOADED:
        workers = old.workers if old is not None and target == LOADED else ()
        return replace(new, target=target, workers=workers, retired=retired_since(old, new, ready=ready))
    keep = tuple(v for v in old.versions if v not in new.versions and v not in old.failed and ready(v))
    gone = {str(v) for v in keep}
    files = {f[0]: f for f in new.files}
    files.update({f[0]: f for f in old.files if f[0].split("/", 1)[0] in gone})  # what the old one runs
    return replace(
        new, target=LOADED, workers=old.workers, retiring=keep, retired=retired_since(old, new, keep, ready),
        versions=tuple(sorted(set(new.versions) | set(keep))),
        revisions={**{v: old.revisions[v] for v in keep if v in old.revisions}, **new.revisions},
        failed={v: why for v, why in old.failed.items()
                if v in new.revisions and new.revisions[v] == old.revisions.get(v)},
        files=tuple(sorted(files.values())),
        footprint=max(new.footprint, old.footprint) if keep else new.footprint)  # kept: room for either


def retired_since(old: CatalogEntry | None, new: CatalogEntry, keep: tuple[int, ...] = (),
                  ready: Callable[[int], bool] = lambda v: False) -> tuple[int, ...]:
    """The versions the model loaded once and does not now: those it did before, and those of the old entry
    that the new one neither loads nor keeps serving (`keep`), as Triton's index goes on listing them. A
    failed version counts only where its earlier files serve (`ready`)."""
    if old is None:
        return ()
    gone = [v for v in old.versions if v not in old.failed or ready(v)] if old.state == "READY" else []
    return retire(old, gone, (*new.versions, *keep))


def dropped_since(old: CatalogEntry | None, new: CatalogEntry,
                  ready: Callable[[int], bool] = lambda v: False) -> dict[int, str]:
    """The failed versions of `old` that `new` neither loads nor still lists as failed, added to those
    dropped before (less what `new` loads): Triton keeps each one's record, UNAVAILABLE with its load's
    error. One whose earlier files still serve (`ready`) is not: it is unloaded (retired) instead."""
    if old is None:
        return new.dropped
    gone = {v: why for v, why in old.failed.items()
            if v not in new.versions and v not in new.failed and not ready(v)}
    return drop(old, gone, new.versions)
