"""Bringing the workers to the catalog, one tick at a time: placement, failures, version switches,
scale-to-zero (idle.py), dead workers (backlog.py), and answering those who wait for a model to come up."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import redis.asyncio as aioredis

from .. import clock
from ..contract.catalog import IDLE, LOADED, CatalogEntry, cold_start_failed, retire
from ..contract.ensemble import is_ensemble
from ..contract.errors import Code, DespinaError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from ..contract.keys import Keys
from ..settings import Settings
from ..workers.redelivery import DeliveryPolicy
from .backlog import requeue_worker
from .crashes import HELD, Crashes
from .ensembles import Ensembles
from .idle import Idle
from .lease import Lease, LeaseLost
from .placement import (
    FixedWorkers,
    committed,
    eligible,
    ensemble_mates,
    handing_over,
    need,
    out_of_memory,
    partners,
    place,
    replicas,
    uncommitted,
)
from .state import Catalog, Workers

log = logging.getLogger("despina.control")

RETRY_SLACK_S = 0.25   # how early a failed cold start is tried again (a caller on its own clock)
RETIRE_GRACE_S = 1.5   # an old version stays loaded this long after the new one is READY: gateways
                       # that have not seen the switch yet still find it serving


@dataclass
class Waiter:
    name: str
    kind: str                     # "wake": one READY version; "load": every version settled; "unload"
    version: int | None
    future: asyncio.Future[int]
    no_room_fails: bool = False   # "load": fail at once when memory alone keeps it off every worker


def failed_load(w: Waiter, message: str) -> DespinaError:
    """What a waiter hears of a model that failed to load: the load API answers 400, as Triton's (the
    model, its config or its files are at fault); a request that woke the model, 503."""
    return InvalidArgument(message) if w.kind == "load" else Unavailable(message)


class Lifecycle:
    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys, catalog: Catalog,
                 workers: Workers, lease: Lease | None = None) -> None:
        self.settings, self.redis, self.keys = settings, redis, keys
        self.lease = lease  # asked before a dead worker's requests are requeued: twice would run them twice
        self.catalog, self.workers = catalog, workers
        self.ensembles = Ensembles(catalog, workers)
        self.excluded: dict[str, set[str]] = {}     # model -> workers its current files failed on
        self.retire_at: dict[str, float] = {}
        self.waiters: list[Waiter] = []
        self.idle = Idle(settings, redis, keys, catalog, workers)  # scale-to-zero and cold starts
        self.crashes = Crashes(redis, keys, catalog, workers)  # loads that killed their worker
        self.shortfall: dict[str, str] = {}         # model -> why it has fewer workers than it should
        self.no_room: set[str] = set()              # models that memory alone keeps off every worker
        self.fixed = FixedWorkers(settings.workers) if settings.fixed_workers else None
        self.unfit: dict[str, str] = {}             # model -> why none of a fixed set of workers can hold it
        self.delivery = DeliveryPolicy.from_settings(settings)
        self._idle_checked = 0.0
        self._held_until = 0.0
        self._steady: tuple[object, ...] | None = None  # _inputs() after a pass that changed nothing

    @property
    def busy(self) -> bool:
        """Something is in motion: tick often."""
        return bool(self.waiters or self.retire_at or self.idle.cold)

    # -- one tick ----------------------------------------------------------------------------------

    def hold(self, seconds: float) -> None:
        """Place nothing and unload nothing for a while: the workers are not all known yet."""
        self._held_until = time.monotonic() + seconds
        self.workers.forget_placed()

    async def tick(self, members: set[bytes] | None = None) -> None:
        """Place, version, scale and answer; `members` is the workers' set where the caller read it."""
        counted: set[tuple[str, int]] = set()
        for wid, last in (await self.workers.refresh(members)).items():
            await self._requeue_from(wid)
            await self.crashes.died(wid, last, counted)
        if self.fixed is not None:
            self.fixed.see(self.workers.infos)
        now = time.monotonic()
        if now < self._held_until:
            await self.catalog.flush()
            # a wake of a model some worker has READY moves nothing: answered now, not after the hold
            await self._answer(now, held=True)
            return
        # the models are reconciled again only when something they are reconciled from moved: the last
        # pass changed nothing, so the same inputs would give the same again (400 models: 5 ms of CPU a tick,
        # 20 ticks a second while anything loads). A version switch waits for a time: it passes every tick.
        inputs = self._inputs()
        if self.retire_at or inputs != self._steady:
            self._place_all(now)
            after = self._inputs()
            self._steady = after if after == inputs else None
        # failed cold starts: in the catalog before the waiters hear of them (a gateway told so reads it so),
        # and before the ensembles that call them are checked (none is failed for what a request may heal)
        await self.idle.cold_failures(self.delivery.reply_ttl_ms, self.retry)
        self.ensembles.check()
        if now - self._idle_checked >= min(1.0, max(self.settings.idle_timeout_s / 4, 0.1)):
            self._idle_checked = now
            await self._scale_to_zero()
        await self.catalog.flush()
        await self.workers.mark_placed(self.catalog.holder)  # after the catalog that places them
        await self._answer(now)

    def _inputs(self) -> tuple[object, ...]:
        """What a pass of _place_all() decides from: the catalog, the workers, what earlier passes kept."""
        fixed = (self.fixed.most_alive, len(self.fixed.capacities)) if self.fixed is not None else None
        return (self.catalog.changes, self.workers.changes, fixed,
                {n: set(w) for n, w in self.excluded.items()}, dict(self.shortfall), set(self.no_room),
                dict(self.unfit), dict(self.retire_at))

    def _place_all(self, now: float) -> None:
        placed: dict[tuple[tuple[str, ...], str], list[str]] = {}  # (workers, why) -> models newly so
        # what each worker was given and who shares an ensemble, found once and kept up to date as each
        # model is placed: found again for each model, a tick of n models took n^2 steps (2,000 models:
        # 1.4 s of the control plane's loop, ticks of 50 ms apart while a model loads)
        used = committed(self.catalog.entries.values())
        mates = ensemble_mates(self.catalog.entries.values())
        for entry in list(self.catalog.entries.values()):
            if entry.serving and not is_ensemble(entry.config):
                others = uncommitted(used, entry)
                entry = self._reconcile(entry, now, placed, others, mates)
                self.catalog.put(entry)
                used = committed([entry], others)
        for (workers, why), names in placed.items():  # one line for all the models when the workers stop
            log.log(logging.WARNING if why else logging.INFO, "model%s %s placed on %s%s",
                    "s" if len(names) > 1 else "", ", ".join(names), ", ".join(workers) or "no worker",
                    f" ({why})" if why else "")

    def _reconcile(self, e: CatalogEntry, now: float, placed: dict[tuple[tuple[str, ...], str], list[str]],
                   used: dict[str, int], mates: dict[str, set[str]]) -> CatalogEntry:
        """The entry placed and its versions switched; `used` is what the other models take per worker,
        `mates` ensemble_mates() of the catalog."""
        e = self.crashes.fail(self._note_failures(e, used))
        excluded = self.excluded.get(e.name, set())
        try:
            count = replicas(e, self.settings.model_replicas)
        except DespinaError as exc:
            self.shortfall[e.name] = exc.message
            return replace(e, workers=())
        leaving = self.workers.leaving
        kept_workers = tuple(w for w in e.workers if w not in excluded and w not in leaving)
        kept = e if kept_workers == e.workers else replace(e, workers=kept_workers)  # (a copy costs)
        near = partners(e.name, mates, self.catalog.entries)
        homes = self.workers.homes
        busy = self.crashes.busy(e, homes)  # (a model whose load killed a worker: where nothing else loads)
        workers, why = self.crashes.hold(e, *place(kept, homes, used, count, excluded | busy, near), busy)
        workers += handing_over(e, workers, self.workers.status, self.workers.leaving)
        if workers != e.workers or why != self.shortfall.get(e.name, ""):
            placed.setdefault((workers, why), []).append(e.name)
        if why:
            self.shortfall[e.name] = why
        else:
            self.shortfall.pop(e.name, None)
        if not workers and why and out_of_memory(kept, homes, used, excluded):
            self.no_room.add(e.name)
        else:
            self.no_room.discard(e.name)
        placed_e = e if workers == e.workers else replace(e, workers=workers)
        return self._switch_versions(self._fail_unfit(placed_e), now)

    def _fail_unfit(self, e: CatalogEntry) -> CatalogEntry:
        """With a fixed set of workers (DESPINA_FIXED_WORKERS, serve's), once all of them have come, a
        version none of them could hold fails, as Triton's load of it does: no worker that could take it
        will join, and its loads and requests would wait for nothing."""
        if self.fixed is None:
            return e
        why = self.fixed.unfit(e)
        before = self.unfit.pop(e.name, None)
        failed = dict(e.failed)
        for v in e.versions:
            mine = v in failed and failed[v] == before
            if v in e.retiring or not (why or mine):
                continue
            if not why:  # a worker that can take it came after all (started by hand): it loads there
                del failed[v]
            elif (v not in failed or mine) and not self.workers.ready_on(e.name, v, e.revisions.get(v)):
                if v not in failed:
                    log.error("model %s version %d cannot load on any worker: %s (the workers are a fixed "
                              "set: DESPINA_FIXED_WORKERS)", e.name, v, why)
                failed[v] = why
        if why:
            self.unfit[e.name] = why
        return replace(e, failed=failed) if failed != e.failed else e

    def _note_failures(self, e: CatalogEntry, used: dict[str, int]) -> CatalogEntry:
        """Record versions whose current files failed on every worker that tried them; a worker that
        serves nothing of the model after a failure is left out, so another one gets a try."""
        failed = dict(e.failed)
        for wid in e.workers:
            status = self.workers.status.get(wid)
            if status is None:
                continue
            errors = [status.failed(e.name, v, e.attempt(v)) for v in e.versions]
            # every version failed there and nothing of the model serves there: another worker's turn
            if errors and all(errors) and not any(status.ready(e.name, v) for v in e.versions):
                self.excluded.setdefault(e.name, set()).add(wid)
        for v in e.versions:
            rev, attempt = e.revisions.get(v, ""), e.attempt(v)
            tried = {w: err for w, s in self.workers.status.items() if (err := s.failed(e.name, v, attempt))}
            live = [w for w in e.workers if w in self.workers.status]
            if v in failed and self.workers.ready_on(e.name, v, rev):  # another worker managed it
                del failed[v]
            if tried and v not in failed and all(w in tried for w in live) \
                    and not any(self.workers.status[w].ready(e.name, v, rev) for w in live) \
                    and not self._next_try(e, live, tried, used):
                serving = any(self.workers.status[w].ready(e.name, v) for w in live)
                message = next(iter(tried.values()))
                failed[v] = f"the new files failed to load; the previous ones serve: {message}" \
                    if serving else message
                log.error("model %s version %d failed to load: %s", e.name, v, message)
        return replace(e, failed=failed) if failed != e.failed else e

    def _next_try(self, e: CatalogEntry, live: list[str], tried: dict[str, str],
                  used: dict[str, int]) -> bool:
        """Whether placement will give the model to a worker that has not tried its files yet: a worker
        it failed on is left out, and another one with room for it takes its place (`used`: what the
        other models take)."""
        excluded = self.excluded.get(e.name, set())
        if not any(w in excluded for w in live):
            return False
        n = need(e)
        return any(wid not in tried and wid not in excluded and eligible(n, info, used.get(wid, 0)) is None
                   for wid, info in self.workers.homes.items())

    def _switch_versions(self, e: CatalogEntry, now: float) -> CatalogEntry:
        """Once every new version is READY everywhere (or failed), the retiring ones go, after a grace."""
        if not e.retiring:
            return e
        new = [v for v in e.versions if v not in e.retiring and v not in e.failed]
        if not new:  # every new version failed: the old ones serve on, as the default again
            self.retire_at.pop(e.name, None)
            return replace(e, retiring=())
        live = [w for w in e.workers if w in self.workers.status]
        if not live or not all(self.workers.status[w].ready(e.name, v, e.revisions.get(v)) for v in new
                               for w in live):
            return e
        due = self.retire_at.setdefault(e.name, now + RETIRE_GRACE_S)
        if now < due:
            return e
        del self.retire_at[e.name]
        log.info("model %s: version %s serves; version %s unloaded", e.name, ",".join(map(str, new)),
                 ",".join(map(str, e.retiring)))
        gone = {str(v) for v in e.retiring}
        serving = tuple(v for v in e.versions if v not in e.retiring)
        return replace(e, versions=serving, retiring=(), retired=retire(e, e.retiring, serving),
                       revisions={v: r for v, r in e.revisions.items() if v not in e.retiring},
                       files=tuple(f for f in e.files if f[0].split("/", 1)[0] not in gone))

    # -- waking and waiting ------------------------------------------------------------------------

    def wake(self, name: str) -> CatalogEntry:
        """Make a registered model load (a cold start when it was idle)."""
        e = self.catalog.get(name)
        if e is None:
            raise NotFound(f"unknown model '{name}'")
        if e.state != "READY":
            raise Unavailable(f"model '{name}' is unavailable: {e.reason}")
        if e.target not in (IDLE, LOADED):
            raise FailedPrecondition(f"model '{name}' is not loaded; load it with "
                                     f"POST /v2/repository/models/{name}/load")
        if e.cold_error.endswith(HELD):  # its load killed workers: only a load or new files try it again
            raise Unavailable(e.cold_error)
        if (failed := cold_start_failed(e, clock.now() + RETRY_SLACK_S)) is not None:
            raise failed  # it failed a moment ago: tried again only once its backoff is over
        e = self.idle.woken(e)
        self.catalog.put(e)
        return e

    def forget(self, name: str) -> None:
        """A new revision of the model, or a load of it: as retry(), and the workers that died loading it
        are forgiven."""
        self.crashes.forget(name)
        self.retry(name)

    def retry(self, name: str) -> None:
        """Workers that failed the model may try again, and where it found no room says nothing of its next
        load (until the next tick places it)."""
        self.excluded.pop(name, None)
        self.no_room.discard(name)
        self.unfit.pop(name, None)

    async def wait(self, name: str, kind: str, version: int | None, timeout: float,
                   no_room_fails: bool = False) -> int:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = Waiter(name, kind, version, future, no_room_fails)
        self.waiters.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            entry = self.catalog.get(name)
            held_up = [self.workers.held_up(name, v) for v in entry.versions] if entry is not None else []
            why = self.shortfall.get(name) or next((h for h in held_up if h), "") \
                or (entry.reason if entry is not None else "")
            why = f": {why}" if why else ""
            raise Unavailable(f"model '{name}' did not {'unload' if kind == 'unload' else 'load'} "
                              f"within {timeout:g} s{why}") from None
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)

    async def _answer(self, now: float, held: bool = False) -> None:
        """Answer the waiters that have their answer; while placement is held (`held`), only wakes: the
        workers not yet heard from may still host what an unload waits to see gone."""
        for w in list(self.waiters):
            if w.future.done() or (held and w.kind != "wake"):
                continue
            try:
                outcome = self._settled(w)
            except DespinaError as exc:
                w.future.set_exception(exc)
                continue
            if outcome is not None:
                w.future.set_result(outcome)
        await self.idle.cold_starts(now)  # after the waiters: they are answered first

    def _settled(self, w: Waiter) -> int | None:
        """The waiter's answer when it has one, None while it must wait; raises when it cannot be."""
        e = self.catalog.get(w.name)
        if w.kind == "unload":
            return 0 if not self.workers.hosting(w.name) else None
        if e is None:
            raise NotFound(f"unknown model '{w.name}'")
        if not e.serving:
            raise cold_start_failed(e, clock.now()) or Unavailable(
                f"model '{w.name}' is {e.target if e.state == 'READY' else 'unavailable'}"
                f"{': ' + e.reason if e.reason else ''}")
        if is_ensemble(e.config):
            v = w.version if w.version is not None else max(e.versions)
            state, why = self.ensembles.state(e, v)
            if state == "LOADING":
                return None
            if v in e.failed:
                raise failed_load(w, f"ensemble '{w.name}' cannot serve: {why}")
            return v  # READY, or a model it calls is idle: the first request wakes it
        if w.kind == "wake":
            if w.version is not None:
                if self.workers.ready_on(w.name, w.version):
                    return w.version
                if w.version in e.failed:
                    raise Unavailable(f"model '{w.name}' version {w.version} failed to load: "
                                      f"{e.failed[w.version]}")
                return None
            current = [v for v in e.versions if v not in e.retiring]
            for group in (current, list(e.retiring)):
                ready = [v for v in group if self.workers.ready_on(w.name, v)]
                if ready:
                    return max(ready)
            if current and all(v in e.failed for v in current):
                raise Unavailable(f"model '{w.name}' failed to load: {e.failed[current[-1]]}")
            return None
        current = [v for v in e.versions if v not in e.retiring]
        live = [x for x in e.workers if x in self.workers.status]
        pending = [v for v in current if v not in e.failed
                   and not (live and all(self.workers.status[x].ready(w.name, v, e.revisions.get(v))
                                         for x in live))]
        failed = [v for v in current if v in e.failed]
        # (a model too big for any of a fixed set of workers has failed: it is asked for no room all the same)
        if (pending or failed) and w.no_room_fails and w.name in self.no_room:
            why = self.shortfall.get(w.name, "")
            raise DespinaError(f"model '{w.name}' does not fit on any worker: {why}", Code.RESOURCE_EXHAUSTED)
        if pending:
            return None
        if failed:
            raise failed_load(w, f"failed to load '{w.name}' version {failed[-1]}: {e.failed[failed[-1]]}")
        return current[-1]

    # -- scale to zero -----------------------------------------------------------------------------

    async def _scale_to_zero(self) -> None:
        """Unload models idle past their timeout; bring back idle models whose stream has a backlog."""
        unload, wake = await self.idle.check(self.delivery.reply_ttl_ms)
        for name in wake:
            try:
                self.wake(name)
            except DespinaError as exc:  # unloaded, gone or failed while the check read the queues
                log.debug("model %s: not woken for its queue: %s", name, exc.message)
        for e in unload:
            self.retire_at.pop(e.name, None)
            keep = tuple(v for v in e.versions if v not in e.retiring)
            self.catalog.put(replace(e, target=IDLE, workers=(), versions=keep, retiring=(),
                                     retired=retire(e, e.retiring, keep),
                                     revisions={v: r for v, r in e.revisions.items() if v in keep}))

    # -- dead workers ------------------------------------------------------------------------------

    async def _requeue_from(self, worker_id: str) -> None:
        if self.lease is not None and not await self.lease.confirm():
            raise LeaseLost(f"not requeueing what worker {worker_id} had read: another control plane leads")
        await requeue_worker(self.redis, self.keys, list(self.catalog.entries.values()), worker_id,
                             self.delivery)
