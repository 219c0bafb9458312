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
        # the worker's one sweep of pending entries looks at every model's streams (workers/sweep.py)
        assert all(runner.streams in worker.sweep for runner in worker.runners.values())
    finally:
        runners = list(worker.runners.values())
        await worker.drain()
        assert not any(runner.streams in worker.sweep for runner in runners)
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


LOADS = 5
LOADING_PY = """
import json, os, time


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        folder, loads = parameters["folder"]["string_value"], int(parameters["loads"]["string_value"])
        now, done = os.path.join(folder, "now"), os.path.join(folder, "done")
        mine = os.path.join(now, args["model_name"])
        open(mine, "w").close()
        # it waits for another load to be on at the same time (unless every other load is done): two
        # loads at once meet however slow their starts, one at a time never do (then it goes on after 20 s)
        deadline = time.monotonic() + 20
        while (len(os.listdir(now)) < 2 and len(os.listdir(done)) < loads - 1
               and time.monotonic() < deadline):
            time.sleep(0.01)
        most, end = 0, time.monotonic() + 1.0  # then it stays a second: more loads at once are seen too
        while True:
            most = max(most, len(os.listdir(now)))
            if time.monotonic() > end:
                break
            time.sleep(0.01)
        with open(os.path.join(folder, "seen"), "a") as seen:  # the most loads at once, this one too
            seen.write(f"{most}\\n")
        os.remove(mine)
        open(os.path.join(done, args["model_name"]), "w").close()

    def execute(self, requests):
        return []
"""


async def test_a_worker_loads_model_load_threads_models_at_once(tmp_path: Path, redis_url: str,
                                                                key_prefix: str) -> None:
    """Loads take turns, DESPINA_MODEL_LOAD_THREADS at once (Triton's --model-load-thread-count): a hundred
    cold starts at once shared the worker's CPU, and every first answer came as late as the last."""
    loading = tmp_path / "loading"
    (loading / "now").mkdir(parents=True)
    (loading / "done").mkdir()
    redis = connect_worker(redis_url)
    worker = Worker(Settings(key_prefix=key_prefix, model_load_threads=2), redis)
    try:
        entries = []
        for i in range(LOADS):
            folder = tmp_path / f"p{i}"
            (folder / "1").mkdir(parents=True)
            (folder / "1" / "model.py").write_text(LOADING_PY)
            (folder / "config.pbtxt").write_text(
                'backend: "python"\nmax_batch_size: 0\n'
                'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
                'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n'
                f'parameters [{{ key: "folder", value: {{ string_value: "{loading}" }} }}, '
                f'{{ key: "loads", value: {{ string_value: "{LOADS}" }} }}]\n')
            entries.append(replace(load_model(folder), workers=(worker.id,)))
        await redis.hset(worker.keys.catalog, mapping={e.name: e.dumps() for e in entries})
        await worker.sync()
        assert len(worker.loading) == LOADS  # every one LOADING, waiting for its turn or loading
        await asyncio.wait_for(asyncio.gather(*(task for _, task in worker.loading.values())), 150)
        assert worker.failures == {}
        assert len(worker.runners) == LOADS
        seen = [int(n) for n in (loading / "seen").read_text().split()]
        assert max(seen) == 2, seen  # (without turns: all 5 at once; one at a time: 1)
    finally:
        await worker.drain()
        await redis.delete(worker.keys.catalog, worker.keys.worker(worker.id), worker.keys.workers)
        await redis.aclose(close_connection_pool=True)
