"""A worker process: hosts the models placed on it, one ModelRunner per model version."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from pathlib import Path

import orjson
import redis.asyncio as aioredis

from ..contract.catalog import CatalogEntry
from ..contract.errors import DespinaError
from ..contract.keys import Keys
from ..contract.modelconfig import ModelSpec
from ..settings import Settings
from .runner import ModelRunner

log = logging.getLogger("despina.worker")

HEARTBEAT_S = 1.0
WORKER_TTL_S = 5


class Worker:
    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.key_prefix)
        self.id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.runners: dict[tuple[str, int], ModelRunner] = {}
        self.failed: dict[tuple[str, int], str] = {}
        self._loaded_from: dict[tuple[str, int], bytes] = {}
        self._stop = asyncio.Event()

    async def run(self) -> None:
        await self.redis.sadd(self.keys.workers, self.id)
        await self._heartbeat()
        beat = asyncio.create_task(self._heartbeat_loop())
        try:
            while not self._stop.is_set():
                try:
                    await self.sync()
                except (ConnectionError, OSError) as exc:
                    log.warning("worker %s: Redis unreachable (%s)", self.id, exc)
                try:
                    await asyncio.wait_for(self._stop.wait(), 0.5)
                except TimeoutError:
                    pass
        finally:
            await self.drain()
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
            try:
                await self.redis.delete(self.keys.worker(self.id))
                await self.redis.srem(self.keys.workers, self.id)
            except (ConnectionError, OSError):
                pass

    def stop(self) -> None:
        self._stop.set()

    async def drain(self) -> None:
        """Finish every request already read, reply, acknowledge, unload."""
        runners, self.runners = self.runners, {}
        await asyncio.gather(*(r.stop() for r in runners.values()), return_exceptions=True)

    async def sync(self) -> None:
        """Make the loaded set match the catalog: load what is new or changed, unload what went away."""
        raw = await self.redis.hgetall(self.keys.catalog)
        wanted: dict[tuple[str, int], tuple[CatalogEntry, bytes]] = {}
        for blob in raw.values():
            entry = CatalogEntry.loads(blob)
            if entry.state != "READY":
                continue
            for v in entry.versions:
                wanted[(entry.name, v)] = (entry, blob)
        for key in [k for k in self.runners if k not in wanted or self._loaded_from[k] != wanted[k][1]]:
            runner = self.runners.pop(key)
            self._loaded_from.pop(key, None)
            await runner.stop()
            log.info("worker %s: unloaded %s version %d", self.id, *key)
        for key, (entry, blob) in wanted.items():
            if key in self.runners or self.failed.get(key) == blob:
                continue
            await self._load(key, entry, blob)

    async def _load(self, key: tuple[str, int], entry: CatalogEntry, blob: bytes) -> None:
        started = time.monotonic()
        spec = ModelSpec.from_config(entry.config)
        consumer = f"{self.id}"
        runner = ModelRunner(self.redis, self.keys, spec, key[1], Path(entry.path), consumer,
                             self.settings.intra_op_threads)
        try:
            await runner.load()
            await runner.start()
        except DespinaError as exc:
            log.error("worker %s: %s", self.id, exc.message)
            self.failed[key] = blob
            await runner.stop()
            await self._heartbeat()
            return
        self.runners[key] = runner
        self._loaded_from[key] = blob
        self.failed.pop(key, None)
        await self._heartbeat()
        log.info("worker %s: loaded %s version %d in %.2f s", self.id, key[0], key[1],
                 time.monotonic() - started)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._heartbeat()
            except (ConnectionError, OSError):
                pass

    async def _heartbeat(self) -> None:
        models: dict[str, dict[str, str]] = {}
        for (name, version), runner in self.runners.items():
            models.setdefault(name, {})[str(version)] = runner.state
        for (name, version) in self.failed:
            models.setdefault(name, {}).setdefault(str(version), "UNAVAILABLE")
        info = {"id": self.id, "host": socket.gethostname(), "pid": os.getpid(), "devices": ["cpu"]}
        key = self.keys.worker(self.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={"info": orjson.dumps(info), "models": orjson.dumps(models),
                                "seen": time.time()})
        pipe.expire(key, WORKER_TTL_S)
        pipe.sadd(self.keys.workers, self.id)
        await pipe.execute()
