"""The gateway's view of models: the catalog and which versions some live worker has READY.

Refreshed in the background (on a catalog event, else twice a second), so that a request never pays
a Redis round trip to learn what it is calling.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis

from ..contract.catalog import CatalogEntry
from ..contract.errors import InvalidArgument, NotFound, Unavailable
from ..contract.keys import Keys
from ..contract.modelconfig import ModelSpec

log = logging.getLogger("despina.gateway")

REFRESH_S = 0.5


@dataclass(frozen=True)
class Model:
    entry: CatalogEntry
    spec: ModelSpec


class ModelView:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.models: dict[str, Model] = {}
        self.ready: dict[str, set[int]] = {}     # model -> versions READY on some live worker
        self.connected = False
        self._blobs: dict[str, bytes] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self.refresh()
        except (ConnectionError, OSError) as exc:
            log.warning("gateway: Redis unreachable at start (%s)", exc)
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.connected = False
                log.warning("gateway: refreshing the model view failed (%s)", exc)

    async def refresh(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.catalog)
        pipe.smembers(self.keys.workers)
        catalog, workers = await pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        for wid in workers:
            pipe.hget(self.keys.worker(wid.decode()), "models")
        states = await pipe.execute() if workers else []
        models: dict[str, Model] = {}
        for name_raw, blob in catalog.items():
            name = name_raw.decode()
            old = self.models.get(name)
            if old is not None and self._blobs.get(name) == blob:
                models[name] = old
                continue
            entry = CatalogEntry.loads(blob)
            spec = ModelSpec.from_config(entry.config) if entry.state == "READY" else None
            models[name] = Model(entry, spec)  # type: ignore[arg-type]
            self._blobs[name] = blob
        ready: dict[str, set[int]] = {}
        for state in states:
            if not state:
                continue
            for name, versions in orjson.loads(state).items():
                for v, s in versions.items():
                    if s == "READY":
                        ready.setdefault(name, set()).add(int(v))
        self.models, self.ready, self.connected = models, ready, True

    def get(self, name: str) -> Model:
        model = self.models.get(name)
        if model is None:
            raise NotFound(f"unknown model '{name}'")
        return model

    def resolve(self, name: str, version: str | None) -> tuple[Model, int]:
        """The model and the version to run: the one named, else the highest READY one."""
        model = self.get(name)
        if model.entry.state != "READY":
            raise Unavailable(f"model '{name}' is unavailable: {model.entry.reason}")
        if version:
            if not version.isdigit():
                raise InvalidArgument(f"model version '{version}' is not a number")
            v = int(version)
            if v not in model.entry.versions:
                raise NotFound(f"unknown version {v} of model '{name}'")
            if v not in self.ready.get(name, ()):
                raise Unavailable(f"model '{name}' version {v} is not ready")
            return model, v
        ready = [v for v in model.entry.versions if v in self.ready.get(name, ())]
        if not ready:
            raise Unavailable(f"model '{name}' is not ready")
        return model, max(ready)

    def is_ready(self, name: str, version: str | None) -> bool:
        try:
            self.resolve(name, version)
        except (NotFound, Unavailable, InvalidArgument):
            return False
        return True
