"""A catalog writer and a real worker on a Redis of the test's own (reliability_support.own_redis), whose
command counts (INFO commandstats) are theirs and the test's alone: for tests that count what a component
reads from Redis (tests/test_gateway_models.py, tests/test_worker_catalog.py)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import redis.asyncio as aioredis
from onnx import TensorProto

from despina.contract.keys import Keys
from despina.control.repository import load_model
from despina.control.state import Catalog
from despina.examples import build_identity
from despina.redis_client import connect, connect_worker
from despina.settings import Settings
from despina.workers.worker import Worker

from .reliability_support import own_redis


@dataclass
class Cluster:
    redis: aioredis.Redis
    keys: Keys
    catalog: Catalog   # the control plane's writer of the catalog
    worker: Worker     # a real worker, serving what the catalog places on it
    folders: Path

    async def calls(self) -> dict[str, int]:
        """Each command's calls so far (a script's commands counted all the same)."""
        stats = await self.redis.info("commandstats")
        return {name.removeprefix("cmdstat_"): s["calls"] for name, s in stats.items()}

    async def hgetalls(self) -> int:
        return (await self.calls()).get("hgetall", 0)

    def put(self, name: str) -> None:
        """Register a model (identity ONNX) on the worker, as the control plane does."""
        folder = self.folders / name
        if not folder.exists():
            build_identity(folder / "1" / "model.onnx", TensorProto.FLOAT)
            (folder / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n')
        self.catalog.put(replace(load_model(folder), workers=(self.worker.id,)))

    async def loaded(self) -> None:
        """The loads sync started, finished."""
        await asyncio.wait_for(asyncio.gather(*(task for _, task in self.worker.loading.values())), 60)

    def serving(self) -> list[str]:
        return sorted(name for name, _ in self.worker.runners)


C = TypeVar("C", bound=Cluster)


@asynccontextmanager
async def own_cluster(tmp_path: Path, prefix: str, kind: type[C]) -> AsyncIterator[C]:
    """A Cluster (`kind`: Cluster or a test's own subclass) on a Redis of its own, stopped after."""
    with own_redis(tmp_path) as server:
        redis = connect(server.url)
        worker = Worker(Settings(key_prefix=prefix), connect_worker(server.url))
        catalog = Catalog(redis, Keys(prefix))
        catalog.mark_complete()
        try:
            yield kind(redis, Keys(prefix), catalog, worker, tmp_path / "repo")
        finally:
            await worker.drain()
            await worker.redis.aclose(close_connection_pool=True)
            await redis.aclose(close_connection_pool=True)
