"""How a worker loads a model version (part of Worker, worker.py): its files fetched (a remote registry's
through the local artifact cache, tried again while the registry cannot serve them), a runner built,
loaded in its turn and started; a version whose files changed replaces the old runner once it serves."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from redis.exceptions import RedisError

from ..contract.catalog import CatalogEntry
from ..contract.errors import DespinaError, Unavailable
from ..contract.instance_groups import same_but_instances
from ..contract.modelspec import ModelSpec
from ..counters import Deferred
from ..registry import ArtifactCache, FileInfo, ModelFiles, Registry, open_model_registry
from ..registry.given import given_digest, read_given
from . import checksums
from .bls import ModelCaller
from .presence import Key, Presence
from .rate_limiter import RateLimiter
from .redelivery import DeliveryPolicy
from .runner import ModelRunner
from .sweep import PendingSweep

log = logging.getLogger("despina.worker")

SLOW_LOAD_S = 20.0  # a load still running after this is logged (once), with how long it has taken
FETCH_RETRY_S = (1.0, 30.0)  # a fetch the registry cannot serve now is tried again: first wait, longest


class Loading(Presence):
    """Worker's loads. The state it uses is Worker's (set in its __init__)."""

    delivery: DeliveryPolicy
    deferred: Deferred
    caller: ModelCaller
    rate_limiter: RateLimiter | None
    sweep: PendingSweep
    _steps: dict[tuple[str, int | None], ModelRunner | None]
    _load_turns: asyncio.Semaphore
    _registries: dict[str, Registry]

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
                                 caller=self.caller, response_cache=self.response_cache, sweep=self.sweep,
                                 summaries=self.settings.summary_latencies, rate_limiter=self.rate_limiter)
            async with self._load_turns:
                await runner.load()
            await runner.start()
        except asyncio.CancelledError:
            if runner is not None:
                await runner.stop()
            raise
        except Exception as exc:
            self._failed(key, entry, exc)
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

    def _failed(self, key: Key, entry: CatalogEntry, exc: Exception) -> None:
        message = exc.message if isinstance(exc, DespinaError) else f"model '{key[0]}': {exc}"
        if not isinstance(exc, DespinaError):
            log.exception("worker %s: loading %s version %d failed", self.id, *key)
        log.error("worker %s: %s", self.id, message)
        self.failures[key] = (entry.attempt(key[1]), message)

    def _in_place(self, key: Key, rev: str) -> bool:
        """Whether the runner serving `key` takes the entry's revision `rev` in place (_resize)."""
        runner = self.runners.get(key)
        return runner is not None and runner.resizable and same_but_instances(self.revision.get(key, ""), rev)

    async def _resize(self, key: Key, entry: CatalogEntry, rev: str) -> None:
        """Triton's in-place instance update: the runner serving `key` adds or removes instances as the
        entry's instance groups say, its files and the rest of its config being those it loaded (_in_place).
        It serves all along; should it fail, it serves on as it was, and the new revision failed."""
        runner = self.runners[key]
        log.info("worker %s: updating the instances of %s version %d in place", self.id, *key)
        try:
            await self._announce()
            async with self._load_turns:
                await runner.resize(ModelSpec.from_config(entry.config))
        except Exception as exc:
            self._failed(key, entry, exc)
        else:
            self.revision[key] = rev
            self.failures.pop(key, None)
            self._steps.clear()
            log.info("worker %s: %s version %d runs %d instance(s)", self.id, *key, runner.execution.count)
        finally:
            if self.loading.get(key, ("", None))[0] == rev:
                del self.loading[key]
            await self._announce()

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
        if self._cache is None:
            self._cache = ArtifactCache.from_settings(self.settings)
        model = ModelFiles(entry.name, entry.path, tuple(FileInfo(*f) for f in entry.files))
        checked = checksums.listed_paths(entry.config)  # of any version: Triton's agent sees the whole folder
        registry = self._registries.get(entry.path)
        if given_digest(entry.path) is not None:  # a load's given files: from Redis, those of this version
            wanted = [f.path for f in model.of_versions([version], checked)]
            registry = await read_given(self.redis, self.keys, entry.name, entry.path, wanted, self._cache)
        elif registry is None:
            registry, _ = open_model_registry(entry.path, self.settings, self._cache)
            self._registries[entry.path] = registry
        return await asyncio.to_thread(registry.folder, model, [version], checked)
