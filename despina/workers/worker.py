"""A worker process: hosts the model versions the control plane placed on it, one ModelRunner each.

It follows the catalog (at once on a catalog event, else every second, reading it again only when its
generation moved): loads what names it, unloads what no longer does, and reloads a version whose files
changed, the old runner serving until the new one is READY (loading.py). Files of a remote registry
come through the local artifact cache. Its heartbeat hash tells the others its capacity and every
version's state; it expires when the worker dies (presence.py). Told to stop, it hands its models over
before it drains: it says it is leaving, and serves on while the control plane loads them elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

from .. import clock, cpus, logs
from ..contract.catalog import CatalogEntry, read_entries
from ..contract.cluster import WorkerInfo
from ..contract.ensemble import Ensemble, Step, is_ensemble
from ..contract.errors import ConfigError
from ..contract.keys import Keys
from ..contract.modelspec import ModelSpec
from ..counters import HINCRBY_MANY, Deferred
from ..host_metrics import GpuReader
from ..redis_client import allow_oom, trouble
from ..registry import ArtifactCache, Registry
from ..response_cache import ResponseCache
from ..settings import Settings
from .backends.base import visible_gpus
from .bls import ModelCaller
from .ensembles import EnsembleHost
from .lifeline import Lifeline
from .loading import Loading
from .presence import Key, memory_bytes
from .rate_limiter import limiter_of
from .redelivery import DeliveryPolicy
from .runner import ModelRunner
from .sweep import PendingSweep

log = logging.getLogger("despina.worker")

# Whether a control plane leads, the catalog's generation (Keys.catalog_generation) and, unless that is the
# one the worker read last (ARGV[1]), the catalog, as of one moment (a script runs alone): 400 models are
# 0.5 MB, read every second by every worker though nothing moved. No generation (a control plane of an
# earlier version, or Redis lost its data): the catalog every time. Not a MULTI: Redis 7.0 refuses every
# command of a MULTI while it is full (maxmemory), reads too, and the worker logged a refusal every few
# seconds for as long; a script without flags that only reads runs. Whether a placement saw this worker
# comes with them: that catalog, written before the mark, is then the one read. KEYS: the catalog, the
# lease, the generation, the placed workers. ARGV: the generation read last, the worker's id. (No Lua false
# in the reply: a RESP3 connection would read it as a boolean, not a nil.)
CATALOG_AND_LEASE = """
local leads = redis.call('EXISTS', KEYS[2])
local placed = redis.call('SISMEMBER', KEYS[4], ARGV[2])
local generation = redis.call('GET', KEYS[3]) or ''
if generation ~= '' and generation == ARGV[1] then return {leads, placed, generation} end
return {leads, placed, generation, redis.call('HGETALL', KEYS[1])}
"""
UNPLACED_WARN_S = 30.0  # a worker no placement has seen this long says why it is not ready


class Worker(Loading):
    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.key_prefix)
        # unique per process: a restarted worker is a new one, and the control plane requeues what
        # its predecessor had read but not answered
        base = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.id = f"{base}.{uuid.uuid4().hex[:6]}"
        self.info = WorkerInfo(self.id, socket.gethostname(), os.getpid(), clock.now(), cpus.count(),
                               visible_gpus(), memory_bytes(settings))
        self.runners: dict[Key, ModelRunner] = {}
        self.hosts: dict[Key, EnsembleHost] = {}     # ensembles run here (workers/ensembles.py)
        self.catalog: dict[str, CatalogEntry] = {}   # as of the last sync that read it
        self._generation = b""                       # the catalog's generation then (b"": none)
        self._steps: dict[tuple[str, int | None], ModelRunner | None] = {}  # step_runner's answers
        self.revision: dict[Key, str] = {}            # of the serving runner
        self.replaced: dict[Key, str] = {}            # of a runner replaced, while that one stops
        self.unloading: dict[Key, ModelRunner] = {}  # runners no longer wanted, finishing what they read
        self.load_ms: dict[Key, float] = {}
        self.loading: dict[Key, tuple[str, asyncio.Task[None]]] = {}
        self._loading_from: dict[Key, Path] = {}     # the folder each load in progress reads
        self.failures: dict[Key, tuple[str, str]] = {}  # key -> (the entry's attempt(), why it failed)
        self.fetch_errors: dict[Key, str] = {}  # a load waiting for the registry -> why (it tries again)
        self._registries: dict[str, Registry] = {}
        self._cache: ArtifactCache | None = None
        # loads run this many at once (Triton's --model-load-thread-count): a hundred cold starts together
        # shared the CPU, and every first answer came as late as the last; in turns, the first come first.
        # A version waiting for its turn is LOADING; fetching its files (from S3) does not wait for one.
        self._load_turns = asyncio.Semaphore(settings.model_load_threads)
        self.placed = False  # a placement saw this worker (Keys.placed): its readiness (health.py) needs it
        self.leads = False   # whether a control plane led at the last sync
        self.leaving = False  # told to stop, it hands its models over (_hand_over): its heartbeat says so
        self.joined = False  # its first heartbeat is written: an end before it is a failed start
        self.on_join: Callable[[], None] = lambda: None  # called then (serve hears it is up: started.py)
        self._unplaced_warn_at = time.monotonic() + UNPLACED_WARN_S
        self._stop = asyncio.Event()
        self._kick = asyncio.Event()
        self._beating = asyncio.Lock()  # one heartbeat in flight: an older one must not land last
        self._announcing: asyncio.Task[None] | None = None     # the announce on its way (_announce)
        self._next_announce: asyncio.Task[None] | None = None  # the next, shared by the calls meanwhile
        self._marked = False  # its mark was written (presence.py): found missing, Redis lost its data
        self._lost_at: float | None = None
        self._telling: set[asyncio.Task[int]] = set()  # telling gateways of the requests held (in_hand.py)
        self.beat_s = max(0.2, min(1.0, settings.worker_ttl_s / 4))
        self.lifeline = Lifeline(settings, self.keys, self.id, self.beat_s)  # while a batch holds the loop
        self.skew = clock.Skew(settings.clock_skew_warn_s, f"worker {self.id}")  # measured at each heartbeat
        self.delivery = DeliveryPolicy.from_settings(settings)
        self.deferred = Deferred(redis)  # counters of ensemble steps run here
        self.sweep = PendingSweep(redis)  # its models' entries abandoned by a dead consumer go back
        # the answers of models with response_cache to requests made here (ensemble steps, BLS calls)
        size = settings.response_cache_bytes
        self.response_cache = ResponseCache(size, settings.summary_latencies) if size else None
        self.caller = ModelCaller(self)  # models calling models (workers/bls.py)
        self.rate_limiter = limiter_of(settings)  # Triton's --rate-limit: None when off
        self.gpus = GpuReader()  # this machine's GPUs, for the control plane's /metrics

    async def run(self) -> None:
        if not await self._join():
            return  # stopped before Redis ever answered: nothing was read, nothing to drain
        self.joined = True
        self.on_join()
        self.deferred.script = await allow_oom(self.redis, HINCRBY_MANY)  # asked already: no round trip
        log.info("worker %s: %d CPU(s), %d GPU(s), %.1f GiB for models", self.id, self.info.cpus,
                 self.info.gpus, self.info.memory_bytes / 2**30)
        helpers = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._listen()),
                   asyncio.create_task(self.sweep.run()), asyncio.create_task(self.lifeline.run())]
        failed = logs.Throttled(log)
        try:
            while not self._stop.is_set():
                try:
                    await self.sync()
                    if failed.since is not None:
                        failed.recovered("worker %s: Redis is reachable again", self.id)
                except (RedisError, ConnectionError, OSError) as exc:
                    failed.log("worker %s: %s", self.id, trouble(exc))
                try:
                    await asyncio.wait_for(self._kick.wait(), 1.0)
                except TimeoutError:
                    pass
                self._kick.clear()
            await self._hand_over()
        finally:
            drained = True
            try:
                await asyncio.wait_for(self.drain(), self.settings.drain_timeout_s)
            except TimeoutError:  # a model still running: the control plane requeues what it read
                drained = False
                log.warning("worker %s: what it read was not all answered within %g s "
                            "(DESPINA_DRAIN_TIMEOUT_S); leaving it to the other workers", self.id,
                            self.settings.drain_timeout_s)
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            await self._announced()  # none may write the worker's hash again after it is deleted
            try:
                await self.redis.delete(self.keys.worker(self.id))
                if drained:  # else it stays a member without a heartbeat: dead, and its reads requeued
                    await self.redis.srem(self.keys.workers, self.id)
                await self.redis.publish(self.keys.events, f"worker:{self.id}")
            except (RedisError, ConnectionError, OSError):
                pass

    async def _join(self) -> bool:
        """Join the workers' set with a first heartbeat; while Redis is unreachable, or full (maxmemory) or
        a replica for now (READONLY, during a failover), retry every second (as every role does); any other
        command Redis refuses ends the worker with its reason. False: the worker was stopped first."""
        while not self._stop.is_set():
            try:
                await self.skew.measure(self.redis, clock.SAMPLES)  # before its first timestamp is read
                await self.redis.sadd(self.keys.workers, self.id)
                await self._heartbeat()
                return True
            except (OutOfMemoryError, ReadOnlyError) as exc:
                # passing states: a worker started to drain the backlog that filled Redis must not crash
                log.warning("worker %s: %s; retrying", self.id, trouble(exc))
            except ResponseError:
                raise  # Redis answered and refused (another program's key?): no outage to wait out
            except (RedisError, ConnectionError, OSError) as exc:
                log.warning("worker %s: %s; retrying", self.id, trouble(exc))
            try:
                await asyncio.wait_for(self._stop.wait(), 1.0)
            except TimeoutError:
                pass
        return False

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def _hand_over(self) -> None:
        """Before the drain: say it is leaving (its heartbeat), and serve on while the control plane loads its
        models on other workers and then takes them off this one (the catalog), so that a model of
        `replicas` 1 does not pause. Until the catalog places none of them here, no control plane leads, or
        DESPINA_WORKER_HANDOVER_S; with no other worker, the control plane takes them off at once."""
        seconds = self.settings.worker_handover_s
        if not (seconds and self.runners and self.leads):
            return
        self.leaving = True
        log.info("worker %s: stopping; its models move to other workers first (at most %g s)", self.id,
                 seconds)
        deadline = time.monotonic() + seconds
        failed = logs.Throttled(log)
        await self._announce()
        while self._placed_here() and self.leads and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._kick.wait(), min(1.0, left))
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                await self.sync()
            except (RedisError, ConnectionError, OSError) as exc:
                failed.log("worker %s: %s", self.id, trouble(exc))
        if self._placed_here():
            why = f"within {seconds:g} s (DESPINA_WORKER_HANDOVER_S)" if self.leads \
                else "(no control plane leads)"
            log.warning("worker %s: its models not all handed over %s; draining", self.id, why)

    def _placed_here(self) -> bool:
        """Whether the catalog (as last read) places here a model that a runner here serves."""
        return any(e.serving and self.id in e.workers and any((e.name, v) in self.runners for v in e.versions)
                   for e in self.catalog.values())

    async def drain(self) -> None:
        """Finish every request already read, reply, acknowledge, unload."""
        for _, task in self.loading.values():
            task.cancel()
        await asyncio.gather(*(t for _, t in self.loading.values()), return_exceptions=True)
        hosts, self.hosts = self.hosts, {}
        await self._stop_hosts(list(hosts.values()))
        runners, self.runners = self.runners, {}
        self._steps.clear()
        await asyncio.gather(*(r.stop() for r in runners.values()), return_exceptions=True)
        await self.caller.close()
        await self.deferred.close()

    # -- following the catalog ---------------------------------------------------------------------

    async def sync(self) -> None:
        """Load what the catalog places here and is not loaded (or changed), unload what it no longer does.

        The catalog is read again only when it moved; the rest runs every time, on the catalog as last read:
        it also starts again a load that was stopped and is wanted again, and an ensemble that could not
        start, though nothing in the catalog moved."""
        # the catalog and the lease as of one moment: a control plane that recovers from a Redis restart
        # writes the catalog, then takes the lease, and an empty catalog read before the one and a lease
        # read after the other (two round trips) unloaded everything here
        leads, placed, generation, *read = await self.redis.eval(
            CATALOG_AND_LEASE, 4, self.keys.catalog, self.keys.control_leader, self.keys.catalog_generation,
            self.keys.placed, self._generation, self.id)
        self.leads = bool(leads)
        if read:
            flat = read[0]
            raw = dict(zip(flat[::2], flat[1::2]))
            if not raw and self.runners and not leads:
                return  # Redis lost its data (restarted without persistence): serve on until republished
            if raw:
                self._catalog_back()
            entries, bad = read_entries(raw)
            for name, why in bad.items():  # (the control plane removes it at its next start)
                log.error("worker %s: catalog entry '%s' cannot be read (%s); skipped", self.id, name, why)
            self.catalog = {e.name: e for e in entries.values()}
            self._generation = generation
        if self.leaving:  # handing its models over (_hand_over): it loads none, and they stop in its drain
            return
        self._steps.clear()  # the catalog's retiring versions may have changed
        wanted: dict[Key, tuple[CatalogEntry, str]] = {}
        for entry in self.catalog.values():
            if entry.serving and self.id in entry.workers:
                for v in entry.versions:
                    wanted[(entry.name, v)] = (entry, entry.revisions.get(v, ""))
        # a load no longer wanted stops first: the unloads below wait for their runners' drains
        for key, (rev, task) in list(self.loading.items()):
            if wanted.get(key, (None, ""))[1] != rev and not task.cancelling():  # unloaded, or new files
                task.cancel()
                log.info("worker %s: stopped loading %s version %d: no longer wanted", self.id, *key)
        gone = [k for k in self.runners if k not in wanted]
        await self._sync_hosts(set(gone))
        for key in gone:
            runner = self.unloading[key] = self.runners.pop(key)
            self._steps.clear()
            self.revision.pop(key, None)
            self.load_ms.pop(key, None)
            await self._announce()
            try:
                await runner.stop()
            finally:
                del self.unloading[key]
            log.info("worker %s: unloaded %s version %d", self.id, *key)
        for key in [k for k in self.failures if k not in wanted]:
            del self.failures[key]
        for key, (entry, rev) in wanted.items():
            serving = key in self.runners and self.revision.get(key) == rev
            tried = self.failures.get(key, ("",))[0] == entry.attempt(key[1])  # a load asking again moves it
            if serving or tried or self.loading.get(key, ("",))[0] == rev:
                continue
            load = self._resize if self._in_place(key, rev) else self._load  # (Triton's instance update)
            task = asyncio.create_task(load(key, entry, rev))
            self.loading[key] = (rev, task)
        self._note_placed(bool(placed))  # after its loads are under way: none missed by a readiness probe
        if gone:
            await self._announce()

    def _note_placed(self, placed: bool) -> None:
        """Remember that a placement saw this worker. Until one does it is not ready, and Kubernetes holds a
        rolling update on it: it says why every UNPLACED_WARN_S."""
        if placed and not self.placed:
            self.placed = True
            log.info("worker %s: the control plane has placed it; ready once its %d load(s) end", self.id,
                     len(self.loading))
        elif not self.placed and time.monotonic() >= self._unplaced_warn_at:
            self._unplaced_warn_at = time.monotonic() + UNPLACED_WARN_S
            why = ("a control plane leads but has not placed models since it joined (one of an earlier "
                   "version never says so)") if self.leads else \
                "no control plane leads (is `despina control` running, on this Redis and key prefix?)"
            log.warning("worker %s is not ready: %s", self.id, why)

    # -- ensembles run here ------------------------------------------------------------------------

    def step_runner(self, step: Step, without: frozenset[Key] | set[Key] = frozenset()) -> ModelRunner | None:
        """The READY runner here that a step of an ensemble run here calls: the version it pins, else
        the highest one not retiring (else the highest retiring one), as a gateway would pick."""
        if without:
            return self._step_runner(step, without)
        key = (step.model, step.version)
        if key not in self._steps:  # forgotten at each sync and each load
            self._steps[key] = self._step_runner(step, without)
        return self._steps[key]

    def _step_runner(self, step: Step, without: frozenset[Key] | set[Key]) -> ModelRunner | None:
        if step.version is not None:
            key = (step.model, step.version)
            runner = self.runners.get(key)
            return runner if runner is not None and runner.state == "READY" and key not in without else None
        ready = [(v, r) for (name, v), r in self.runners.items()
                 if name == step.model and r.state == "READY" and (name, v) not in without]
        if not ready:
            return None
        entry = self.catalog.get(step.model)
        current = [x for x in ready if entry is None or x[0] not in entry.retiring]
        return max(current or ready, key=lambda x: x[0])[1]

    async def _sync_hosts(self, leaving: set[Key]) -> None:
        """Run here each ensemble whose steps all have a runner here (not counting `leaving`); stop
        those that no longer do, before the runners they call stop."""
        wanted: dict[Key, tuple[CatalogEntry, Ensemble, bytes]] = {}
        for entry in self.catalog.values() if self.settings.host_ensembles else ():
            if not (entry.serving and is_ensemble(entry.config)):
                continue
            if (entry.config.get("model_transaction_policy") or {}).get("decoupled"):
                continue  # several responses to a request: the gateway runs it (contract/ensemble_stream.py)
            try:
                graph = Ensemble.from_config(entry.config)
            except ConfigError:
                continue
            if all(self.step_runner(s, leaving) is not None for s in graph.steps):
                config = orjson.dumps(entry.config)
                for v in entry.versions:
                    if v not in entry.failed:
                        wanted[(entry.name, v)] = (entry, graph, config)
        stopping = [key for key, host in self.hosts.items()
                    if key not in wanted or host.config != wanted[key][2]]
        if stopping:
            hosts = [self.hosts.pop(key) for key in stopping]
            for host in hosts:
                host.state = "UNLOADING"
            await self._announce()  # gateways stop queueing here, then the hosts finish what they read
            await self._stop_hosts(hosts)
        for key, (entry, graph, config) in wanted.items():
            if key in self.hosts:
                continue
            host = EnsembleHost(self.redis, self.keys, ModelSpec.from_config(entry.config), graph, key[1],
                                self.step_runner, self.id, self.delivery, config, self.deferred, self.sweep,
                                self.settings.summary_latencies)
            try:
                await host.start()
            except (RedisError, OSError) as exc:
                log.warning("worker %s: ensemble %s cannot start here (%s)", self.id, key[0], exc)
                continue
            self.hosts[key] = host
            await self._announce()

    async def _stop_hosts(self, hosts: list[EnsembleHost]) -> None:
        await asyncio.gather(*(h.stop() for h in hosts), return_exceptions=True)
        for host in hosts:
            log.info("worker %s: ensemble %s version %d no longer runs here", self.id, host.spec.name,
                     host.version)
