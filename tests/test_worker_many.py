"""A worker of many models, against a real Redis: more models than its pool has connections load, serve
their state and stop together."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from onnx import TensorProto

from despina.control.repository import load_model
from despina.examples import build_identity
from despina.redis_client import connect_worker
from despina.settings import Settings
from despina.workers.worker import Worker

MODELS = 12
POOL = 4  # connections of the worker's pool: fewer than its models, as 64 are for a worker of 400


async def test_more_models_than_the_pool_has_connections_load_together(tmp_path: Path, redis_url: str,
                                                                       key_prefix: str) -> None:
    """Each load makes its model's consumer group through the worker's pool; past the pool's size redis-py
    refused the command ("Too many connections") and the model failed to load: a worker given 400 models
    at once had most of them UNAVAILABLE for good."""
    redis = connect_worker(redis_url, max_connections=POOL)
    worker = Worker(Settings(key_prefix=key_prefix), redis)
    try:
        entries = []
        for i in range(MODELS):
            folder = tmp_path / f"m{i}"
            build_identity(folder / "1" / "model.onnx", TensorProto.FLOAT)
            (folder / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n')
            entries.append(replace(load_model(folder), workers=(worker.id,)))
        await redis.hset(worker.keys.catalog, mapping={e.name: e.dumps() for e in entries})
        await worker.sync()
        await asyncio.wait_for(asyncio.gather(*(task for _, task in worker.loading.values())), 60)
        assert worker.failures == {}
        assert sorted(name for name, _ in worker.runners) == sorted(e.name for e in entries)
        assert all(runner.state == "READY" for runner in worker.runners.values())
    finally:
        await worker.drain()
        await redis.delete(worker.keys.catalog, worker.keys.worker(worker.id), worker.keys.workers)
        await redis.aclose(close_connection_pool=True)
