"""A worker process: hosts the model versions the control plane placed on it, one ModelRunner each.

It follows the catalog (at once on a catalog event, else every second, reading it again only when its
generation moved): loads what names it, unloads what no longer does, and reloads a version whose files
changed, the old runner serving until the new one is READY. Files of a remote registry come through the
local artifact cache. Its heartbeat hash tells the others its capacity and every version's state; it
expires when the worker dies.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

from .. import cpus, logs
from ..contract.catalog import CatalogEntry
from ..contract.cluster import VersionStatus, WorkerInfo, pack_detail, state_digest
from ..contract.ensemble import Ensemble, Step, is_ensemble
from ..contract.errors import ConfigError, DespinaError, Unavailable
from ..contract.keys import Keys
from ..contract.modelconfig import ModelSpec
from ..contract.records import packb
from ..counters import HINCRBY_MANY, Deferred
from ..metrics import GpuReader
from ..redis_client import allow_oom, trouble
from ..registry import ArtifactCache, FileInfo, ModelFiles, Registry, open_model_registry
from ..registry.cache import touch
from ..response_cache import ResponseCache
from ..settings import Settings
from .backends.base import visible_gpus
from .bls import ModelCaller
from .ensembles import EnsembleHost
from .redelivery import DeliveryPolicy
from .runner import ModelRunner
from .sweep import PendingSweep

log = logging.getLogger("despina.worker")

Key = tuple[str, int]
SLOW_LOAD_S = 20.0  # a load still running after this is logged (once), with how long it has taken
TRIM_S = 60.0       # how often the artifact cache is brought back under its limit (besides after a fetch)
FETCH_RETRY_S = (1.0, 30.0)  # a fetch the registry cannot serve now is tried again: first wait, longest

# The heartbeat: the worker's hash, its TTL, and its membership, in one step. It runs while Redis is full
# (allow_oom): a full queue must be refused as such, not end with live workers taken for dead. KEYS: the
# worker's hash, the workers' set; ARGV: TTL in ms, worker id, then the hash's fields and values.
HEARTBEAT = """
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
"""

# Whether a control plane leads, the catalog's generation (Keys.catalog_generation) and, unless that is the
# one the worker read last (ARGV[1]), the catalog, as of one moment (a script runs alone): 400 models are
# 0.5 MB, read every second by every worker though nothing moved. No generation (a control plane of an
# earlier version, or Redis lost its data): the catalog every time. Not a MULTI: Redis 7.0 refuses every
# command of a MULTI while it is full (maxmemory), reads too, and the worker logged a refusal every few
# seconds for as long; a script without flags that only reads runs. KEYS: the catalog, the lease, the
# generation. (No Lua false in the reply: a RESP3 connection would read it as a boolean, not a nil.)
CATALOG_AND_LEASE = """
local leads = redis.call('EXISTS', KEYS[2])
local generation = redis.call('GET', KEYS[3]) or ''
if generation ~= '' and generation == ARGV[1] then return {leads, generation} end
return {leads, generation, redis.call('HGETALL', KEYS[1])}
"""


class Worker:
    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.key_prefix)
        # unique per process: a restarted worker is a new one, and the control plane requeues what
        # its predecessor had read but not answered
        base = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.id = f"{base}.{uuid.uuid4().hex[:6]}"
        self.info = WorkerInfo(self.id, socket.gethostname(), os.getpid(), time.time(), cpus.count(),
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
        self.failures: dict[Key, tuple[str, str]] = {}  # key -> (revision, why it failed)
        self.fetch_errors: dict[Key, str] = {}  # a load waiting for the registry -> why (it tries again)
        self._registries: dict[str, Registry] = {}
        self._cache: ArtifactCache | None = None
        # loads run this many at once (Triton's --model-load-thread-count): a hundred cold starts together
        # shared the CPU, and every first answer came as late as the last; in turns, the first come first.
        # A version waiting for its turn is LOADING; fetching its files (from S3) does not wait for one.
        self._load_turns = asyncio.Semaphore(settings.model_load_threads)
        self._stop = asyncio.Event()
        self._kick = asyncio.Event()
        self._beating = asyncio.Lock()  # one heartbeat in flight: an older one must not land last
        self._announcing: asyncio.Task[None] | None = None     # the announce on its way (_announce)
        self._next_announce: asyncio.Task[None] | None = None  # the next, shared by the calls meanwhile
        self.beat_s = max(0.2, min(1.0, settings.worker_ttl_s / 4))
        self.delivery = DeliveryPolicy.from_settings(settings)
        self.deferred = Deferred(redis)  # counters of ensemble steps run here
        self.sweep = PendingSweep(redis)  # its models' entries abandoned by a dead consumer go back
        # the answers of models with response_cache to requests made here (ensemble steps, BLS calls)
        size = settings.response_cache_bytes
        self.response_cache = ResponseCache(size) if size else None
        self.caller = ModelCaller(self)  # models calling models (workers/bls.py)
        self.gpus = GpuReader()  # this machine's GPUs, for the control plane's /metrics

    async def run(self) -> None:
        if not await self._join():
            return  # stopped before Redis ever answered: nothing was read, nothing to drain
        self.deferred.script = await allow_oom(self.redis, HINCRBY_MANY)  # asked already: no round trip
        log.info("worker %s: %d CPU(s), %d GPU(s), %.1f GiB for models", self.id, self.info.cpus,
                 self.info.gpus, self.info.memory_bytes / 2**30)
        helpers = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._listen()),
                   asyncio.create_task(self.sweep.run())]
        failed = logs.Throttled(log)
        try:
            while not self._stop.is_set():
                try:
                    await self.sync()
                except (RedisError, ConnectionError, OSError) as exc:
                    failed.log("worker %s: %s", self.id, trouble(exc))
                try:
                    await asyncio.wait_for(self._kick.wait(), 1.0)
                except TimeoutError:
                    pass
                self._kick.clear()
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
        leads, generation, *read = await self.redis.eval(
            CATALOG_AND_LEASE, 3, self.keys.catalog, self.keys.control_leader, self.keys.catalog_generation,
            self._generation)
        if read:
            flat = read[0]
            raw = dict(zip(flat[::2], flat[1::2]))
            if not raw and self.runners and not leads:
                return  # Redis lost its data (restarted without persistence): serve on until republished
            self.catalog = {e.name: e for e in map(CatalogEntry.loads, raw.values())}
            self._generation = generation
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
            if serving or self.failures.get(key, ("",))[0] == rev or self.loading.get(key, ("",))[0] == rev:
                continue
            task = asyncio.create_task(self._load(key, entry, rev))
            self.loading[key] = (rev, task)
        if gone:
            await self._announce()

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
                                self.step_runner, self.id, self.delivery, config, self.deferred, self.sweep)
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

    async def _load(self, key: Key, entry: CatalogEntry, rev: str) -> None:
        started = time.monotonic()
        log.info("worker %s: loading %s version %d", self.id, *key)
        slow = asyncio.get_running_loop().call_later(
            SLOW_LOAD_S, lambda: log.warning("worker %s: %s version %d is still loading after %.0f s",
                                             self.id, *key, time.monotonic() - started))
        runner: ModelRunner | None = None
        try:
            # (in the try: a load stopped while it announces itself must leave `loading` all the same)
            await self._announce()
            path = self._loading_from[key] = await self._fetch(key, entry)
            runner = ModelRunner(self.redis, self.keys, ModelSpec.from_config(entry.config), key[1], path,
                                 self.id, self.settings.intra_op_threads, delivery=self.delivery,
                                 deferred=self.deferred, full_queue_delay=self.settings.full_queue_delay,
                                 caller=self.caller, response_cache=self.response_cache, sweep=self.sweep)
            async with self._load_turns:
                await runner.load()
            await runner.start()
        except asyncio.CancelledError:
            if runner is not None:
                await runner.stop()
            raise
        except Exception as exc:
            message = exc.message if isinstance(exc, DespinaError) else f"model '{key[0]}': {exc}"
            if not isinstance(exc, DespinaError):
                log.exception("worker %s: loading %s version %d failed", self.id, *key)
            log.error("worker %s: %s", self.id, message)
            self.failures[key] = (rev, message)
            if runner is not None:
                await runner.stop()
        else:
            old, old_rev = self.runners.get(key), self.revision.get(key, "")
            self.runners[key], self.revision[key] = runner, rev
            self._steps.clear()
            self.load_ms[key] = (time.monotonic() - started) * 1000
            self.failures.pop(key, None)
            log.info("worker %s: loaded %s version %d in %.0f ms", self.id, key[0], key[1], self.load_ms[key])
            await self._count_load(key)
            self._kick.set()  # an ensemble may now run here
            if old is not None:
                self.replaced[key] = old_rev  # until it has answered all it read (gateways' caches ask)
                try:
                    await self._announce()
                    await old.stop()  # after the new one serves: no gap
                finally:
                    self.replaced.pop(key, None)
        finally:
            slow.cancel()
            self.fetch_errors.pop(key, None)
            self._loading_from.pop(key, None)
            if self.loading.get(key, ("", None))[0] == rev:
                del self.loading[key]
            await self._announce()

    async def _fetch(self, key: Key, entry: CatalogEntry) -> Path:
        """_folder, tried again while the registry cannot serve the files (unreachable, refusing, failing):
        the version stays LOADING with the reason, and loads once the store is back, not failed for good."""
        wait = FETCH_RETRY_S[0]
        while True:
            try:
                return await self._folder(entry, key[1])
            except Unavailable as exc:
                if key not in self.fetch_errors:
                    log.warning("worker %s: %s version %d waits for the registry: %s", self.id, *key,
                                exc.message)
                self.fetch_errors[key] = exc.message
                await self._announce()
            await asyncio.sleep(wait)
            wait = min(wait * 2, FETCH_RETRY_S[1])

    async def _folder(self, entry: CatalogEntry, version: int) -> Path:
        """The local folder to load from: the registry's own, or the cache's copy of a remote one."""
        if not entry.files:
            return Path(entry.path)
        registry = self._registries.get(entry.path)
        if registry is None:
            if self._cache is None:
                self._cache = ArtifactCache.from_settings(self.settings)
            registry, _ = open_model_registry(entry.path, self.settings, self._cache)
            self._registries[entry.path] = registry
        model = ModelFiles(entry.name, entry.path, tuple(FileInfo(*f) for f in entry.files))
        return await asyncio.to_thread(registry.folder, model, [version])

    # -- telling the others ------------------------------------------------------------------------

    async def _listen(self) -> None:
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.keys.events)
                    await logs.follow(self.redis, self.keys)  # what was set while this one was away
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None and message.get("data") == logs.EVENT:
                            await logs.follow(self.redis, self.keys)
                            continue
                        if message is not None and message.get("data") == b"catalog":
                            self._kick.set()
            except asyncio.CancelledError:
                raise
            except (RedisError, ConnectionError, OSError):
                await asyncio.sleep(1.0)

    async def _count_load(self, key: Key) -> None:
        """Model load durations, for the despina_model_load_duration_seconds metric, and the last one, for
        Triton's nv_model_load_duration_secs."""
        stats = self.keys.stats(*key)
        took_ns = int(self.load_ms[key] * 1e6)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(stats, "load_count", 1)
            pipe.hincrby(stats, "load_ns", took_ns)
            pipe.hset(stats, "load_last_ns", took_ns)
            await pipe.execute()
        except (RedisError, OSError):
            pass

    async def _heartbeat_loop(self) -> None:
        trimmed = time.monotonic()
        while True:
            await asyncio.sleep(self.beat_s)
            if self._cache is not None:
                self._keep_cached_folders()
                if time.monotonic() - trimmed >= TRIM_S:
                    trimmed = time.monotonic()
                    await asyncio.to_thread(self._cache.trim)
            try:
                await self._heartbeat()
            except (RedisError, ConnectionError, OSError):
                pass

    def _keep_cached_folders(self) -> None:
        """Mark the cache folders this worker serves or loads from as in use: no trim removes them."""
        assert self._cache is not None
        for path in {*(r.path for r in self.runners.values()), *self._loading_from.values()}:
            if self._cache.holds(path):
                touch(path)

    async def _announce(self) -> None:
        """Heartbeat now and say so on the events channel: the control plane and gateways look at once.
        The calls that come while one is on its way share the next one, which starts once that one is
        written: each load announces itself twice, and a worker loading 400 models at once wrote 680
        heartbeats of all of them, each making the control plane and every gateway read the catalog."""
        if self._next_announce is None:
            self._next_announce = asyncio.ensure_future(self._announce_after(self._announcing))
        await asyncio.shield(self._next_announce)

    async def _announce_after(self, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        # from here on, what changes is for the next announce: this one reads the state now
        self._announcing, self._next_announce = self._next_announce, None
        try:
            await self._heartbeat()
            await self.redis.publish(self.keys.events, f"worker:{self.id}")
        except (RedisError, ConnectionError, OSError):
            pass

    async def _announced(self) -> None:
        """Wait for the announces on their way (a caller cancelled while it waited left its own going)."""
        pending = [t for t in (self._announcing, self._next_announce) if t is not None]
        if pending:
            await asyncio.wait(pending)

    def detail(self) -> dict[str, dict[int, VersionStatus]]:
        out: dict[str, dict[int, VersionStatus]] = {}
        # an unloading runner is reported until it has answered what it read: the control plane answers
        # what is left on the model's streams then, not requests this runner is still running
        for key in {*self.runners, *self.loading, *self.failures, *self.unloading}:
            runner = self.runners.get(key)
            loading = self.loading.get(key, ("", None))[0]
            failed_rev, error = self.failures.get(key, ("", ""))
            if runner is not None:
                status = VersionStatus(runner.state, self.revision.get(key, ""), loading,
                                       self.replaced.get(key, ""),
                                       error=error or self.fetch_errors.get(key, ""), failed=failed_rev,
                                       load_ms=round(self.load_ms.get(key, 0.0), 1))
            else:
                state = "LOADING" if loading else "UNLOADING" if key in self.unloading else "UNAVAILABLE"
                status = VersionStatus(state, loading, error=error or self.fetch_errors.get(key, ""),
                                       failed=failed_rev)
            out.setdefault(key[0], {})[key[1]] = status
        return out

    async def _heartbeat(self) -> None:
        async with self._beating:
            # NVML's calls block (a few per GPU): off the loop the batches run on, and only where it answers
            gpus = await asyncio.to_thread(self.gpus.readings) if self.gpus.active else []
            models: dict[str, dict[str, str]] = {}
            for (name, version), runner in self.runners.items():
                models.setdefault(name, {})[str(version)] = runner.state
            ensembles: dict[str, list[int]] = {}
            for (name, version), host in self.hosts.items():
                models.setdefault(name, {})[str(version)] = host.state
                if host.state == "READY":
                    ensembles.setdefault(name, []).append(version)
            # the metrics Python models made themselves, by model and version: a version unloaded here
            # is gone from the next heartbeat, and a dead worker's go with its hash. msgpack, as
            # orjson would write a gauge's NaN or infinity as null.
            custom: dict[str, dict[str, list[dict[str, Any]]]] = {}
            for (name, version), runner in self.runners.items():
                if families := runner.custom_metrics():
                    custom.setdefault(name, {})[str(version)] = families
            packed, detail = orjson.dumps(models), pack_detail(self.detail())
            fields: dict[str, str | bytes | float] = {
                "info": self.info.dumps(), "models": packed, "detail": detail,
                "state": state_digest(packed, detail), "ensembles": orjson.dumps(ensembles),
                "cache": orjson.dumps(self._cache.stats.as_dict() if self._cache else {}),
                "response_cache": orjson.dumps(self.response_cache.figures() if self.response_cache else {}),
                "gpus": orjson.dumps(gpus), "custom_metrics": packb(custom), "seen": time.time()}
            await self.redis.eval(await allow_oom(self.redis, HEARTBEAT), 2, self.keys.worker(self.id),
                                  self.keys.workers, int(self.settings.worker_ttl_s * 1000), self.id,
                                  *(x for pair in fields.items() for x in pair))


def memory_bytes(settings: Settings) -> int:
    """Memory this worker may give models: the setting, else the cgroup's limit, else the machine's."""
    if settings.worker_memory_mb:
        return settings.worker_memory_mb * 1024 * 1024
    try:
        raw = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if raw.isdigit():
            return int(raw)
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
