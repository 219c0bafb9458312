"""How a worker reads its model's stream, against a real Redis: the next read goes out with a batch's
replies when nothing read could join a batch before them, and at once whenever it could (a batch on a
thread, one with nothing to send), so that no request waits for a read that is not coming."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.keys import FIELD, IN_FLIGHT, Keys
from despina.contract.modelconfig import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.control.repository import load_model
from despina.examples import build_mlp
from despina.workers import runner as runner_module
from despina.workers.runner import ModelRunner
from despina.workers.stats import Deferred

ROW = np.ones((1, 256), np.float32)


class Worker:
    """A runner of the reference MLP reading its stream in Redis, and a gateway's side of it."""

    def __init__(self, runner: ModelRunner, redis: aioredis.Redis, reply_stream: str) -> None:
        self.runner, self.redis, self.reply_stream = runner, redis, reply_stream
        self.last = "0-0"
        self.sent_with_replies = 0
        send_with = runner.streams.send_with

        def counting(*args: Any) -> Any:
            sent = send_with(*args)
            self.sent_with_replies += sent is not None
            return sent
        runner.streams.send_with = counting  # type: ignore[method-assign]

    async def enqueue(self, rid: str, deadline_s: float = 60.0) -> None:
        req = InferRequest(rid, self.reply_stream, time.time() + deadline_s,
                           (Tensor("x", "FP32", (1, 256), ROW.tobytes()),), enqueued=time.time())
        await self.redis.xadd(self.runner.streams.streams[0], {FIELD: records.encode([req]), IN_FLIGHT: b"1"})

    async def replies(self, n: int, timeout: float = 5.0) -> list[InferReply]:
        """The next `n` replies the gateway gets."""
        got: list[InferReply] = []
        async with asyncio.timeout(timeout):
            while len(got) < n:
                for _, entries in await self.redis.xread({self.reply_stream: self.last}, block=100) or ():
                    for entry_id, fields in entries:
                        self.last = entry_id
                        got += records.decode_replies(fields[FIELD])
        return got


@pytest.fixture
async def worker(tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
                 ) -> AsyncIterator[Worker]:
    # a read left waiting for replies that never go would wait this long: the tests would time out
    monkeypatch.setattr(runner_module, "READ_WAITS_S", 60.0)
    folder = tmp_path / "mlp"
    build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n'
                                         'dynamic_batching { max_queue_delay_microseconds: 1000 }\n')
    redis = aioredis.Redis.from_url(redis_url)
    deferred = Deferred(redis)
    runner = ModelRunner(redis, Keys(key_prefix), ModelSpec.from_config(load_model(folder).config), 1,
                         folder, "w", deferred=deferred)
    await runner.load()
    await runner.start()
    yield Worker(runner, redis, f"{key_prefix}:replies")
    await runner.stop()
    await deferred.close()
    await redis.aclose()


async def test_the_next_read_goes_out_with_a_batchs_replies(worker: Worker) -> None:
    for i in range(12):  # one at a time, as from a lone client
        await worker.enqueue(f"r{i}")
        (reply,) = await worker.replies(1)
        assert reply.id == f"r{i}" and reply.error is None
    # the first batch ran on a thread (the model's cost was not known yet): its read went alone
    assert worker.sent_with_replies >= 10


async def test_a_batch_on_a_thread_lets_the_read_go_at_once(worker: Worker, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Requests that come while a batch runs on a thread are read meanwhile (they form the next batch)."""
    runner = worker.runner
    backend = await runner.instances.get()
    execute = backend.execute

    def slow(*args: Any) -> Any:
        time.sleep(0.3)
        return execute(*args)
    monkeypatch.setattr(backend, "execute", slow)
    runner.instances.put_nowait(backend)
    monkeypatch.setattr(runner, "_row_us", 1e9)  # expected long: it runs on a thread
    await worker.enqueue("first")
    await asyncio.sleep(0.1)
    await worker.enqueue("second")
    await asyncio.sleep(0.1)
    # read while the first batch still runs: delivered to this worker, not yet answered
    (group,) = await worker.redis.xinfo_groups(runner.streams.streams[0])
    assert group["pending"] == 2 and group["lag"] == 0
    assert sorted(r.id for r in await worker.replies(2)) == ["first", "second"]


async def test_a_batch_with_nothing_for_redis_lets_the_read_go(worker: Worker,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The read waiting for a batch's replies is let go when that batch has none for Redis (an ensemble
    step run in this worker): a request that comes next is still read and answered."""
    runner = worker.runner
    await worker.enqueue("warm")
    await worker.replies(1)
    backend = await runner.instances.get()
    execute = backend.execute

    def slow(*args: Any) -> Any:
        time.sleep(0.3)
        return execute(*args)
    monkeypatch.setattr(backend, "execute", slow)
    runner.instances.put_nowait(backend)
    monkeypatch.setattr(runner, "_row_us", 1e9)
    answered: list[InferReply] = []
    # a step made in this worker runs on a thread; meanwhile a request past its deadline comes, is
    # answered at once, and the read after it waits for the running batch, which sends nothing
    runner.submit([Tensor("x", "FP32", (1, 256), ROW.tobytes())], (), time.time() + 60, answered.append,
                  settled=lambda: True)
    await asyncio.sleep(0.05)
    await worker.enqueue("late", deadline_s=-1)
    (late,) = await worker.replies(1)
    assert late.id == "late" and late.error is not None
    async with asyncio.timeout(5):
        while not answered:
            await asyncio.sleep(0.01)
    monkeypatch.setattr(backend, "execute", execute)
    await worker.enqueue("next")
    (reply,) = await worker.replies(1)
    assert reply.id == "next" and reply.error is None
