"""Scale-to-zero and cold starts: which loaded models have been idle past their timeout, which models
scaled to zero have a request queued (one that a gateway queued while the model was going down), and
how long each cold start took.

A loaded model's backlog is what its own streams hold and, when a worker runs an ensemble that calls it,
what that ensemble's streams hold (requests for it that reach it through no stream of its own).
Only what may change a decision is read: a loaded model's last inference and backlog once its timeout
has passed since it was last seen used (its last inference only moves later); a model scaled to zero,
its backlog at every check while producers may still see it serving (Idle.watch_s), then at every
SWEEP-th check (1,000 models: 2,000 commands every check before).
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import clock
from ..contract.catalog import IDLE, LOADED, CatalogEntry, cold_start_failed
from ..contract.ensemble import called_by, is_ensemble
from ..contract.keys import Keys
from ..contract.sequence import DEFAULT_IDLE_US
from ..settings import Settings
from ..workers.stats import COLD_START_BUCKETS_S
from .backlog import refuse_model
from .repository import parameter
from .state import Catalog, Workers

log = logging.getLogger("despina.control")

SWEEP = 10  # models long scaled to zero: a tenth of their queues is read at each check
# after a cold start failed, a request may try it again this long after (doubling with each failure in a row,
# up to COLD_RETRY_MAX_S): a transient failure heals with a later request, a broken model is not loaded over
# and over by every request
COLD_RETRY_FIRST_S = 2.0
COLD_RETRY_MAX_S = 300.0


def backoff_s(failures: int) -> float:
    """How long after `failures` failed cold starts in a row a request may try again (the exponent capped:
    past 1,024 failures 2.0 ** n overflows)."""
    return min(COLD_RETRY_FIRST_S * 2 ** min(failures - 1, 16), COLD_RETRY_MAX_S)


class Idle:
    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys, catalog: Catalog,
                 workers: Workers) -> None:
        self.settings, self.redis, self.keys = settings, redis, keys
        self.catalog, self.workers = catalog, workers
        self.cold: dict[str, float] = {}            # model -> when its cold start began (monotonic)
        self.awake_since: dict[str, float] = {}     # model -> when it was last brought up (wall clock)
        # a model scaled to zero this long ago may still look served to producers whose view lags (a worker
        # dead with it READY looks so until its heartbeat expires): a request may be queued there
        self.watch_s = settings.worker_ttl_s + 30.0
        self._checks = 0                            # checks so far
        self._used: dict[str, float] = {}           # loaded model -> its last inference as read (wall clock)
        self._idle_since: dict[str, float] = {}     # model scaled to zero -> when first seen so (monotonic)
        self._serving: set[str] = set()             # loaded models the last check saw serving

    def timeout(self, e: CatalogEntry) -> float:
        """How long the model goes without a request before it is unloaded (0: never). A stateful model's
        worker keeps each sequence's state until it idles out (max_sequence_idle_microseconds after its last
        request): its timeout runs on that long, so that no unload drops a sequence that may go on."""
        raw = parameter(e.config, "idle_timeout_s")
        try:
            timeout = float(raw) if raw else self.settings.idle_timeout_s
        except ValueError:
            timeout = self.settings.idle_timeout_s
        sequences = e.config.get("sequence_batching")
        if timeout > 0 and sequences is not None:
            timeout += int(sequences.get("max_sequence_idle_microseconds") or DEFAULT_IDLE_US) / 1e6
        return timeout

    def woken(self, e: CatalogEntry) -> CatalogEntry:
        """The model is made to load (the entry to publish): a cold start when it was scaled to zero, marked
        in the catalog for a control plane that may take over before it ends; its idle clock starts."""
        now = clock.now()
        self.awake_since[e.name] = now
        if e.target != IDLE:
            return replace(e, target=LOADED)
        self.cold.setdefault(e.name, time.monotonic())
        log.info("model %s: cold start", e.name)
        return replace(e, target=LOADED, cold_since=now)

    def adopt(self) -> None:
        """The cold starts under way when this control plane took the lead (their mark in the catalog it
        read): timed from when they began, and failed as cold starts if their load fails. They lived in the
        leader's memory alone, so a takeover mid cold start left a failed one loaded with its versions
        failed (no backoff, no later request trying again) and a served one untimed."""
        now, ticks = clock.now(), time.monotonic()
        for e in self.catalog.entries.values():
            if e.cold_since and e.serving:
                self.cold.setdefault(e.name, ticks - max(0.0, now - e.cold_since))
                log.info("model %s: its cold start goes on under this control plane", e.name)

    async def check(self, reply_ttl_ms: int) -> tuple[list[CatalogEntry], list[str]]:
        """The loaded models idle past their timeout (to unload), and the models scaled to zero that have
        requests queued (to wake; those whose cold start failed a moment ago answer them with why)."""
        now, ticks = clock.now(), time.monotonic()
        self._checks += 1
        due: list[CatalogEntry] = []
        used: dict[str, float] = {}
        idle_since: dict[str, float] = {}
        serving: set[str] = set()
        for e in self.catalog.entries.values():
            if e.state != "READY" or is_ensemble(e.config):
                continue
            if e.target == IDLE:
                since = idle_since[e.name] = self._idle_since.get(e.name, ticks)
                if ticks - since < self.watch_s or hash(e.name) % SWEEP == self._checks % SWEEP:
                    due.append(e)
            elif e.target == LOADED and (timeout := self.timeout(e)) > 0:
                last = used[e.name] = self._used.get(e.name, 0.0)
                if not any(self.workers.ready_on(e.name, v) for v in e.versions):
                    continue  # placed on no worker yet, or still loading
                serving.add(e.name)
                if e.name not in self._serving:
                    # its idle clock starts once it serves: now, not at the last check that saw it loading
                    # (a tick before, or more: a 1 s timeout had passed by the first check that saw it serve)
                    self.awake_since[e.name] = now
                elif now - max(last, self.awake_since.setdefault(e.name, now)) > timeout \
                        and not self.cold.get(e.name):
                    due.append(e)
        self._used, self._idle_since, self._serving = used, idle_since, serving
        return await self._read(due, reply_ttl_ms) if due else ([], [])

    async def _read(self, due: list[CatalogEntry], reply_ttl_ms: int) -> tuple[list[CatalogEntry], list[str]]:
        """Read the `due` models' last inference (those loaded) and backlog: check() from them."""
        pipe = self.redis.pipeline(transaction=False)
        callers = self._callers(due)
        for e in due:
            for v in e.versions:
                if e.target == LOADED:
                    pipe.hget(self.keys.stats(e.name, v), "last_inference")
                for s in e.streams(self.keys, v):
                    pipe.xlen(s)
            for s in callers.get(e.name, ()):
                pipe.xlen(s)
        results = iter(await pipe.execute())
        backlog: dict[str, int] = {}
        for e in due:
            for v in e.versions:
                last = next(results) if e.target == LOADED else None
                if last:
                    self._used[e.name] = max(self._used.get(e.name, 0.0), int(last) / 1000)
                queued = sum(int(next(results)) for _ in e.streams(self.keys, v))
                backlog[e.name] = backlog.get(e.name, 0) + queued
            calling = sum(int(next(results)) for _ in callers.get(e.name, ()))
            backlog[e.name] = backlog.get(e.name, 0) + calling
        now = clock.now()
        unload, wake = [], []
        for old in due:
            current = self.catalog.get(old.name)  # a command may have changed it while we read
            if current is None or current.target != old.target or current.state != "READY":
                continue
            e = current
            if e.target == IDLE:
                if backlog.get(e.name) and (failed := cold_start_failed(e, now)) is not None:
                    await self.refuse_queued(e, failed.message, reply_ttl_ms)
                elif backlog.get(e.name):
                    wake.append(e.name)
                continue
            since = max(self._used.get(e.name, 0.0), self.awake_since.setdefault(e.name, now))
            if not backlog.get(e.name) and now - since > self.timeout(e) and not self.cold.get(e.name):
                log.info("model %s: no request for %.0f s; unloading it (it stays registered)", e.name,
                         now - since)
                unload.append(e)
        return unload, wake

    def _callers(self, due: list[CatalogEntry]) -> dict[str, list[str]]:
        """The streams of the ensembles that call each loaded model of `due`. A worker that runs an
        ensemble itself keeps each request in the ensemble's stream until it answers it, and calls the
        models straight, through no stream of theirs: a request queued or running there is a request for
        the models it calls (a step that came after a longer one found its model scaled to zero)."""
        loaded = {e.name for e in due if e.target == LOADED}
        found: dict[str, list[str]] = {}
        for c in self.catalog.entries.values():
            if c.state == "READY" and is_ensemble(c.config):
                for name in called_by(c.config) & loaded:
                    found.setdefault(name, []).extend(s for v in c.versions for s in c.streams(self.keys, v))
        return found

    # -- cold starts -------------------------------------------------------------------------------

    async def cold_failures(self, reply_ttl_ms: int, forget: Callable[[str], None]) -> None:
        """The models whose cold start failed on every worker that tried it (each current version failed):
        each goes back to scaled to zero with the load's error and a backoff (cold_start_failed()), the
        workers it failed on try it again next time (`forget`), and what is queued for it hears the error.
        Called before the waiters are answered: they hear it too."""
        failed = []
        for name in list(self.cold):
            e = self.catalog.get(name)
            current = [v for v in e.versions if v not in e.retiring] if e is not None else []
            if e is None or not e.serving or not current or not all(v in e.failed for v in current):
                continue
            del self.cold[name]
            failures = e.cold_failures + 1
            backoff = backoff_s(failures)
            # Triton's words for a load that failed
            why = f"load failed for model '{name}': version {current[-1]} is at UNAVAILABLE state: " \
                f"{e.failed[current[-1]]}"
            log.error("model %s: cold start failed (%d in a row); scaled to zero again, a request in %g s or "
                      "later tries again: %s", name, failures, backoff, why)
            # its failures are forgotten and `tries` moves: the workers that failed it load it again next time
            e = replace(e, target=IDLE, workers=(), failed={}, tries=e.tries + 1, cold_error=why,
                        cold_failures=failures, cold_retry_at=clock.now() + backoff, cold_since=0.0)
            self.catalog.put(e)
            forget(name)
            failed.append(e)
        # the catalog is right for all of them before anything is awaited (a flush meanwhile, a Redis error)
        for e in failed:
            told = cold_start_failed(e, clock.now())
            try:
                await self._count_failure(e)
                await self.refuse_queued(e, told.message if told is not None else e.cold_error, reply_ttl_ms)
            except (RedisError, OSError) as exc:
                log.warning("model %s: counting its failed cold start, or answering what was queued for it, "
                            "failed: %s", e.name, exc)

    async def refuse_queued(self, e: CatalogEntry, why: str, reply_ttl_ms: int) -> None:
        """Answer what is queued for a model that cannot load now with why: nobody would read it until it
        does (a request queued by a gateway that saw it serving, as it went down)."""
        await refuse_model(self.redis, self.keys, e, why, reply_ttl_ms)

    async def cold_starts(self, now: float) -> None:
        """Record the cold starts that ended (the model serves) at `now` (monotonic), and forget those
        whose load failed."""
        for name in list(self.cold):
            e = self.catalog.get(name)
            current = [v for v in e.versions if v not in e.retiring] if e is not None else []
            # a cold start whose load failed is over: timed on, it would end in a later load's READY
            if e is None or not e.serving or (current and all(v in e.failed for v in current)):
                self.cold.pop(name, None)
                if e is not None and e.cold_since:
                    self.catalog.put(replace(e, cold_since=0.0))
            elif any(self.workers.ready_on(name, v) for v in e.versions):
                # it serves: the mark goes, and a later failure backs off from the start again
                self.catalog.put(replace(e, cold_error="", cold_failures=0, cold_retry_at=0.0,
                                         cold_since=0.0))
                await self._record(e, (now - self.cold.pop(name)) * 1000)

    async def _count_failure(self, e: CatalogEntry) -> None:
        """A failed cold start in `despina:coldstart` ("failed", "last_error", "last_failed_at") and in the
        served version's statistics (cold_failed: the metrics' despina_cold_start_failures_total)."""
        key = self.keys.cold_starts
        raw = await self.redis.hget(key, e.name)
        prev = orjson.loads(raw) if raw else {"count": 0, "total_ms": 0.0}
        doc = {**prev, "failed": prev.get("failed", 0) + 1, "last_error": e.cold_error,
               "last_failed_at": clock.now()}
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, e.name, orjson.dumps(doc))
        if e.versions:
            pipe.hincrby(self.keys.stats(e.name, max(e.versions)), "cold_failed", 1)
        await pipe.execute()

    async def _record(self, e: CatalogEntry, ms: float) -> None:
        statuses = [s.version(e.name, v) for s in self.workers.status.values() for v in e.versions]
        load_ms = max((st.load_ms for st in statuses if st is not None), default=0.0)
        log.info("model %s: cold start took %.0f ms (the worker's load %.0f ms)", e.name, ms, load_ms)
        key = self.keys.cold_starts
        raw = await self.redis.hget(key, e.name)
        prev = orjson.loads(raw) if raw else {"count": 0, "total_ms": 0.0}
        doc = {**prev, "count": prev["count"] + 1, "total_ms": round(prev["total_ms"] + ms, 1),
               "last_ms": round(ms, 1), "last_load_ms": round(load_ms, 1), "last_at": clock.now()}
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, e.name, orjson.dumps(doc))
        if e.versions:  # the metrics and the status page read the served version's statistics
            stats = self.keys.stats(e.name, max(e.versions))
            pipe.hincrby(stats, "cold_count", 1)
            pipe.hincrby(stats, "cold_ns", int(ms * 1e6))
            pipe.hincrby(stats, f"cold:{bisect.bisect_left(COLD_START_BUCKETS_S, ms / 1000)}", 1)
        await pipe.execute()
