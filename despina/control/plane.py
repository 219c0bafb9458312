"""The control plane process: publishes the catalog and keeps the worker registry tidy."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import redis.asyncio as aioredis

from ..contract.keys import Keys
from ..settings import Settings
from .repository import scan

log = logging.getLogger("despina.control")


class ControlPlane:
    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.key_prefix)
        self._stop = asyncio.Event()

    async def publish(self) -> None:
        """Scan the repository and replace the catalog with what it holds (mode 'none')."""
        entries = await asyncio.to_thread(scan, Path(self.settings.model_repository))
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.catalog)
        if entries:
            pipe.hset(self.keys.catalog, mapping={n: e.dumps() for n, e in entries.items()})
        pipe.publish(self.keys.events, b"catalog")
        await pipe.execute()
        ready = sorted(n for n, e in entries.items() if e.state == "READY")
        log.info("catalog: %d models (%s)", len(entries), ", ".join(ready) or "none ready")

    async def run(self) -> None:
        await self.publish()
        while not self._stop.is_set():
            try:
                await self.reap_workers()
            except (ConnectionError, OSError) as exc:
                log.warning("control: Redis unreachable (%s)", exc)
            try:
                await asyncio.wait_for(self._stop.wait(), 2.0)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    async def reap_workers(self) -> None:
        """Forget workers whose heartbeat key expired."""
        members = await self.redis.smembers(self.keys.workers)
        for wid in members:
            name = wid.decode()
            if not await self.redis.exists(self.keys.worker(name)):
                await self.redis.srem(self.keys.workers, name)
                log.warning("worker %s stopped sending heartbeats; removed", name)
