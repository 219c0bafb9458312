"""What a worker tells the others (part of Worker, worker.py): its heartbeat hash (capacity, every
version's state, its caches, GPUs and models' own metrics), which expires when the worker dies, and an
event on each change, so that the control plane and the gateways look at once; what it hears (catalog
and log-level events); and the cache folders it keeps from the artifact cache's trim, which it runs, with
the trim of unpacked Python environments."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import clock, logs
from ..contract.cluster import VersionStatus, WorkerInfo, pack_detail, state_digest
from ..contract.keys import DATA_LOST_EVENT, Keys
from ..contract.records import packb
from ..host_metrics import GpuReader
from ..redis_client import allow_oom
from ..registry import ArtifactCache
from ..registry.cache import touch
from ..response_cache import ResponseCache
from ..settings import Settings
from . import in_hand
from .backends import python_env
from .ensembles import EnsembleHost
from .lifeline import Lifeline
from .runner import ModelRunner

log = logging.getLogger("despina.worker")

Key = tuple[str, int]
TRIM_S = 60.0       # how often the artifact cache is brought back under its limit (besides after a fetch)

# The heartbeat: the worker's hash, its TTL, and its membership, in one step, with its mark renewed (1) or,
# found missing, set again (0: Redis lost its data, or this is the first). It runs while Redis is full
# (allow_oom): a full queue must be refused as such, not end with live workers taken for dead. KEYS: the
# worker's hash, the workers' set, its mark; ARGV: TTL in ms, worker id, the mark's TTL in ms, then the hash's
# fields and values.
HEARTBEAT = """
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
if redis.call('PEXPIRE', KEYS[3], ARGV[3]) == 1 then return 1 end
redis.call('SET', KEYS[3], 1, 'PX', ARGV[3])
return 0
"""


class Presence:
    """Worker's heartbeat and events. The state it uses is Worker's (set in its __init__)."""

    settings: Settings
    redis: aioredis.Redis
    keys: Keys
    id: str
    info: WorkerInfo
    runners: dict[Key, ModelRunner]
    hosts: dict[Key, EnsembleHost]
    revision: dict[Key, str]
    replaced: dict[Key, str]
    unloading: dict[Key, ModelRunner]
    load_ms: dict[Key, float]
    loading: dict[Key, tuple[str, asyncio.Task[None]]]
    failures: dict[Key, tuple[str, str]]
    fetch_errors: dict[Key, str]
    response_cache: ResponseCache | None
    gpus: GpuReader
    beat_s: float
    skew: clock.Skew
    lifeline: Lifeline
    leaving: bool
    _loading_from: dict[Key, Path]
    _cache: ArtifactCache | None
    _kick: asyncio.Event
    _beating: asyncio.Lock
    _announcing: asyncio.Task[None] | None
    _next_announce: asyncio.Task[None] | None
    _marked: bool  # its mark was written: found missing now, Redis lost its data
    _lost_at: float | None  # when it was found to have lost its data, until the catalog is back
    _telling: set[asyncio.Task[int]]

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
                        if message is not None and message.get("data") == DATA_LOST_EVENT:
                            await self._announce()  # a gateway found Redis lost its data: look now
            except asyncio.CancelledError:
                raise
            except (RedisError, ConnectionError, OSError):
                await asyncio.sleep(1.0)

    async def _heartbeat_loop(self) -> None:
        trimmed = time.monotonic()
        while True:
            await asyncio.sleep(self.beat_s)
            if self._cache is not None:
                self._keep_cached_folders()
            if time.monotonic() - trimmed >= TRIM_S:
                trimmed = time.monotonic()
                await asyncio.to_thread(self._trim)
            try:
                await self._heartbeat()
                # after it: the heartbeat is the worker's life to the others, and a measurement that fails
                # must not cost one (a warning it finds shows in the next)
                await self.skew.measure(self.redis)
            except (RedisError, ConnectionError, OSError):
                pass

    def _trim(self) -> None:
        """The artifact cache back under its limit; unpacked Python environments unused for their lease
        removed (those of models updated since), whether or not this worker ran any."""
        if self._cache is not None:
            self._cache.trim()
        python_env.trim()

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
                                       load_ms=round(self.load_ms.get(key, 0.0), 1),
                                       gpus=runner.execution.gpus)
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
            # requests in batches executing now, by model and version: the metrics' pending count is
            # Triton's, requests awaiting execution (metrics.py); a dead worker's go with its hash
            executing: dict[str, dict[str, int]] = {}
            for (name, version), runner in self.runners.items():
                if runner.executing:
                    executing.setdefault(name, {})[str(version)] = runner.executing
            packed, detail, warning = orjson.dumps(models), pack_detail(self.detail()), self.skew.warning()
            fields: dict[str, str | bytes | float] = {
                "info": self.info.dumps(), "models": packed, "detail": detail,
                "state": state_digest(packed, detail, warning, self.leaving), "leaving": int(self.leaving),
                "ensembles": orjson.dumps(ensembles),
                "clock": orjson.dumps({"offset_s": round(clock.offset(), 3), "warning": warning}),
                "cache": orjson.dumps(self._cache.stats.as_dict() if self._cache else {}),
                "response_cache": orjson.dumps(self.response_cache.figures() if self.response_cache else {}),
                "gpus": orjson.dumps(gpus), "custom_metrics": packb(custom),
                "executing": orjson.dumps(executing), "seen": clock.now()}
            if self.settings.summary_latencies:  # its requests' recent latencies (summaries.py)
                latencies: dict[str, dict[str, Any]] = {}
                for (name, version), runner in self.runners.items():
                    if runner.summary is not None:
                        latencies.setdefault(name, {})[str(version)] = runner.summary.export()
                for (name, version), host in self.hosts.items():  # the ensembles it runs
                    if host.summary is not None:
                        latencies.setdefault(name, {})[str(version)] = host.summary.export()
                fields["summaries"] = packb(latencies)
            mark_ms = int(self.settings.reply_ttl_s * 1000)
            kept = await self.redis.eval(await allow_oom(self.redis, HEARTBEAT), 3, self.keys.worker(self.id),
                                         self.keys.workers, self.keys.worker_mark(self.id),
                                         int(self.settings.worker_ttl_s * 1000), self.id, mark_ms,
                                         *(x for pair in fields.items() for x in pair))
            self.lifeline.beaten = time.monotonic()
            lost, self._marked = self._marked and not kept, True
            if lost:
                self._data_lost()

    def _data_lost(self) -> None:
        """Its mark was gone: Redis lost its data, and the requests queued with it. Each gateway is told
        which of its requests this worker still holds (in_hand.py), so that it keeps them waiting."""
        self._lost_at = time.monotonic()
        log.warning("worker %s: Redis lost its data (restarted without it, flushed, or failed over to a "
                    "replica that had none): it serves on, and tells the gateways of the requests it holds",
                    self.id)
        runners = [*self.runners.values(), *self.unloading.values()]
        task = asyncio.ensure_future(in_hand.tell_gateways(self.redis, self.id, runners,
                                                           int(self.settings.reply_ttl_s * 1000)))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)
        # the catalog read again whatever its generation: the control plane may have published it again before
        # this worker saw the loss, and that read is what says Redis has its data again (_catalog_back)
        self._generation = b""
        self._kick.set()

    def _catalog_back(self) -> None:
        """The catalog was read again after Redis lost its data: say so, once."""
        if self._lost_at is not None:
            log.warning("worker %s: Redis has its data again: the catalog is published again, %.1f s after "
                        "the loss was found", self.id, time.monotonic() - self._lost_at)
            self._lost_at = None



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
