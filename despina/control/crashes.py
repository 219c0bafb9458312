"""Loads that kill their worker: a backend that crashes the process, the kernel's OOM killer. A version a
worker was loading when it died (its last heartbeat said so) is a suspect: it is placed again only on a
worker whose other loads have ended, one suspect at a time, so that the next death names it alone and a
model loading beside it is not blamed. After LIMIT such deaths it fails, with why, and is placed on no
worker: each placement would kill another one (a process supervisor restarting them gives up on a worker
that keeps dying, and stops everything with it). A load through the API, or new files, try it again.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..contract.catalog import CatalogEntry
from ..contract.cluster import WorkerStatus
from ..contract.keys import Keys
from .state import Catalog, Workers

log = logging.getLogger("despina.control")

# how the failure a crash gave ends: a control plane that took over reads it in the catalog (the deaths it
# did not see), and places the version on no worker all the same
HELD = "; not placed again until it is loaded again or its files change"
LIMIT = 2  # deaths of a worker loading a version after which it fails (one may be bad luck: a host's OOM)


class Crashes:
    def __init__(self, redis: aioredis.Redis, keys: Keys, catalog: Catalog, workers: Workers) -> None:
        self.redis, self.keys = redis, keys
        self.catalog, self.workers = catalog, workers
        # (model, version) -> (the revision it was loading, how many workers died loading it)
        self.deaths: dict[tuple[str, int], tuple[str, int]] = {}

    async def died(self, worker_id: str, status: WorkerStatus | None, counted: set[tuple[str, int]]) -> None:
        """A worker died (its heartbeat expired): each version its last heartbeat had loading counts one,
        once for all the workers found dead at one look (`counted`: those counted at it so far). Several
        heartbeats expiring together is one event (a Redis that stalled, a node with several workers), not
        a load killing each: a model loading on two replicas then was failed by one stall. A worker told to
        stop (`leaving`, killed at the end of its grace) blames nothing."""
        if status is None or status.leaving:
            return
        loading = [(name, v, rev) for name, versions in status.detail.items() for v, s in versions.items()
                   if (rev := s.loading or (s.revision if s.state == "LOADING" else ""))]
        pipe = self.redis.pipeline(transaction=False)
        for name, v, rev in loading:
            e = self.catalog.get(name)
            if e is None or e.revisions.get(v) != rev or (name, v) in counted:
                continue  # files since replaced: their death says nothing of these
            counted.add((name, v))
            before, count = self.deaths.get((name, v), (rev, 0))
            count = count + 1 if before == rev else 1
            self.deaths[(name, v)] = (rev, count)
            others = [f"{n} version {x}" for n, x, _ in loading if (n, x) != (name, v)]
            log.error("worker %s died while loading model %s version %d (%d time%s)%s", worker_id, name, v,
                      count, "" if count == 1 else "s", f", beside {', '.join(others)}" if others else "")
            pipe.hincrby(self.keys.stats(name, v), "load_crashes", 1)  # despina_model_load_crashes_total
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:  # a count lost: the deaths, which decide, are counted above
            log.warning("counting the loads worker %s died in failed: %s", worker_id, exc)

    def forget(self, name: str) -> None:
        """A load of the model asks for it again: its deaths are forgiven."""
        for key in [k for k in self.deaths if k[0] == name]:
            del self.deaths[key]

    def _count(self, e: CatalogEntry, v: int) -> int:
        """The deaths of the version's current files; none once they serve somewhere."""
        rev, count = self.deaths.get((e.name, v), ("", 0))
        if count and (rev != e.revisions.get(v) or self.workers.ready_on(e.name, v, rev)):
            del self.deaths[(e.name, v)]
            return 0
        return count

    def why(self, count: int) -> str:
        return f"the worker loading it died {count} times (killed: out of memory?){HELD}"

    def fail(self, e: CatalogEntry) -> CatalogEntry:
        """The entry with the versions that killed LIMIT workers failed."""
        failed = dict(e.failed)
        for v in e.versions:
            count = self._count(e, v)
            if count >= LIMIT and v not in failed and v not in e.retiring:
                failed[v] = self.why(count)
                log.error("model %s version %d failed to load: %s", e.name, v, failed[v])
        return replace(e, failed=failed) if failed != e.failed else e

    def busy(self, e: CatalogEntry, homes: Iterable[str]) -> set[str]:
        """For a suspect (a death counted), the workers placement is to leave out: those where another model
        still loads (and the suspect is not), so that placement picks among the settled ones instead of
        waiting for the one it likes best. Empty for every other model (no look at the workers)."""
        if not self.deaths or not any(self._count(e, v) for v in e.versions if v not in e.retiring):
            return set()
        return {w for w in homes if w not in e.workers and not self._settled(w, e.name)}

    def hold(self, e: CatalogEntry, workers: tuple[str, ...], why: str, busy: Iterable[str] = ()
             ) -> tuple[tuple[str, ...], str]:
        """Placement's (`workers`, `why`) for the entry (fail()'s), less what its loads' deaths rule out: none
        for a model every version of which failed so; a suspect only on workers where it is, or whose other
        loads have ended (`busy`: the workers placement left out for that)."""
        current = [v for v in e.versions if v not in e.retiring]
        # any version: a worker loads every version of the model it is given, the failed one too, and dies
        if held := [v for v in current if e.failed.get(v, "").endswith(HELD)]:
            return (), f"version {held[-1]} failed: {e.failed[held[-1]]}"
        counts = [self._count(e, v) for v in current]
        if not any(counts):
            return workers, why
        kept = tuple(w for w in workers if w in e.workers or self._settled(w, e.name))
        if kept:
            return kept, why
        waiting = sorted({*workers, *busy})
        if not waiting:
            return kept, why
        return (), (f"it waits for the other loads on worker {', '.join(waiting)} to end: a worker died "
                    "while loading it")

    def _settled(self, worker_id: str, name: str) -> bool:
        """Whether every other model placed on the worker is loaded there, or failed."""
        status = self.workers.status.get(worker_id)
        if status is None:
            return False
        return all(status.ready(e.name, v) or v in e.failed or status.failed(e.name, v, e.attempt(v))
                   for e in self.catalog.entries.values() if e.name != name and worker_id in e.workers
                   and e.serving for v in e.versions)
