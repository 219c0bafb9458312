"""A worker of many models, against a real Redis: more models than its pool has connections load, serve
their state and stop together."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from onnx import TensorProto

from despina.contract.cluster import WorkerStatus
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


async def test_announces_that_come_together_share_one_heartbeat(redis_url: str, key_prefix: str) -> None:
    """Each load announces itself (a heartbeat of every model here, and an event that makes the control
    plane and every gateway read the catalog again) as it starts and as it ends: a worker given 400 models
    at once wrote 680 heartbeats and events. Calls that come while one is on its way now share the next
    one, and each call still returns only once a heartbeat with its own change is written."""
    redis = connect_worker(redis_url)
    worker = Worker(Settings(key_prefix=key_prefix), redis)
    key = worker.keys.worker(worker.id)

    async def change_and_announce(i: int) -> None:
        worker.failures[(f"m{i}", 1)] = ("r1", f"failed {i}")
        await worker._announce()
        status = WorkerStatus.from_hash(worker.id, await redis.hgetall(key))
        assert status.failed(f"m{i}", 1, "r1") == f"failed {i}"  # its change is in Redis on return

    try:
        async with redis.pubsub() as pubsub:
            await pubsub.subscribe(worker.keys.events)
            await asyncio.gather(*(change_and_announce(i) for i in range(MODELS * 4)))
            await change_and_announce(MODELS * 4)  # alone: a heartbeat of its own
            events, quiet = 0, 0
            while quiet < 3:  # (the subscription's own message reads as None too)
                got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                events, quiet = (events + 1, 0) if got is not None else (events, quiet + 1)
        assert 2 <= events <= 3, events  # the first call's, the one all the others share, the last one's
    finally:
        await worker._announced()
        await redis.delete(key, worker.keys.workers)
        await redis.aclose(close_connection_pool=True)
