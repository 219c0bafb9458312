"""How a worker reads its model's stream, against a real Redis: the next read goes out with a batch's
replies when nothing read could join a batch before them, and at once whenever it could (a batch on a
thread, one with nothing to send), so that no request waits for a read that is not coming; and the same
for an ensemble run in the worker, whose read waits for replies only while every request out is here."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.ensemble import Ensemble
from despina.contract.errors import Code
from despina.contract.keys import FIELD, IN_FLIGHT, Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.control.repository import load_model
from despina.counters import Deferred
from despina.examples import build_mlp
from despina.redis_client import connect_worker
from despina.workers import ensembles, execution
from despina.workers import runner as runner_module
from despina.workers.ensembles import EnsembleHost
from despina.workers.redelivery import DeliveryPolicy
from despina.workers.runner import ModelRunner
from despina.workers.streams import LONG_BLOCK_MS, READ_BLOCK_MS, ModelStreams

ROW = np.ones((1, 256), np.float32)


class Replies:
    """A gateway's reply stream: the replies it gets, in turn."""

    def __init__(self, redis: aioredis.Redis, stream: str) -> None:
        self.redis, self.stream = redis, stream
        self.last = "0-0"

    async def next(self, n: int, timeout: float = 5.0) -> list[InferReply]:
        got: list[InferReply] = []
        async with asyncio.timeout(timeout):
            while len(got) < n:
                for _, entries in await self.redis.xread({self.stream: self.last}, block=100) or ():
                    for entry_id, fields in entries:
                        self.last = entry_id
                        got += records.decode_replies(fields[FIELD])
        return got


def counted(streams: Any) -> list[int]:
    """How many times `streams` sent a read with replies (a one-element list, counted as it goes)."""
    count = [0]
    send_with = streams.send_with

    def counting(*args: Any) -> Any:
        sent = send_with(*args)
        count[0] += sent is not None
        return sent
    streams.send_with = counting
    return count


async def enqueue(redis: aioredis.Redis, stream: str, reply_stream: str, rid: str, in_flight: bytes = b"1",
                  deadline_s: float = 60.0) -> None:
    """A gateway's entry of one request (W1's row), saying it has `in_flight` out for the model."""
    req = InferRequest(rid, reply_stream, time.time() + deadline_s,
                       (Tensor("x", "FP32", (1, 256), ROW.tobytes()),), enqueued=time.time())
    await redis.xadd(stream, {FIELD: records.encode([req]), IN_FLIGHT: in_flight})


class Worker:
    """A runner of the reference MLP reading its stream in Redis, and a gateway's side of it."""

    def __init__(self, runner: ModelRunner, redis: aioredis.Redis, reply_stream: str) -> None:
        self.runner, self.redis = runner, redis
        self.gateway = Replies(redis, reply_stream)
        self.sent_with_replies = counted(runner.streams)

    async def enqueue(self, rid: str, deadline_s: float = 60.0) -> None:
        await enqueue(self.redis, self.runner.streams.streams[0], self.gateway.stream, rid, deadline_s=deadline_s)

    async def replies(self, n: int) -> list[InferReply]:
        return await self.gateway.next(n)


@pytest.fixture
async def worker(tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
                 ) -> AsyncIterator[Worker]:
    # a read left waiting for replies that never go would wait this long: the tests would time out
    monkeypatch.setattr(runner_module, "READ_WAITS_S", 60.0)
    monkeypatch.setattr(ensembles, "READ_WAITS_S", 60.0)
    redis = aioredis.Redis.from_url(redis_url)
    deferred = Deferred(redis)
    try:  # a runner that fails to load or start leaves no connection open
        runner = await mlp_runner(tmp_path, redis, key_prefix, deferred)
        try:
            yield Worker(runner, redis, f"{key_prefix}:replies")
        finally:
            await runner.stop()
    finally:
        await deferred.close()
        await redis.aclose()


async def mlp_runner(tmp_path: Path, redis: aioredis.Redis, key_prefix: str, deferred: Deferred | None = None
                     ) -> ModelRunner:
    """The reference MLP's runner, loaded and reading its stream."""
    folder = tmp_path / "mlp"
    build_mlp(folder / "1" / "model.onnx")
    # a batch that may still be joined waits 30 s: a read that does not go out shows as a timeout
    (folder / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n'
                                         'dynamic_batching { max_queue_delay_microseconds: 30000000 }\n')
    runner = ModelRunner(redis, Keys(key_prefix), ModelSpec.from_config(load_model(folder).config), 1,
                         folder, "w", deferred=deferred)
    await runner.load()
    await runner.start()
    return runner


async def test_a_stop_ends_the_read_blocked_on_an_empty_stream_at_once(tmp_path: Path, redis_url: str,
                                                                       key_prefix: str) -> None:
    """An idle runner's read blocks LONG_BLOCK_MS (each end of a block wakes the worker and Redis for
    nothing); a stop ends it with CLIENT UNBLOCK instead of waiting it out, and what came before is
    answered."""
    redis = aioredis.Redis.from_url(redis_url)
    try:  # a runner that fails to load leaves no connection open
        runner = await mlp_runner(tmp_path, redis, key_prefix)
        worker = Worker(runner, redis, f"{key_prefix}:replies")
        try:
            await worker.enqueue("before")
            (reply,) = await worker.replies(1)
            assert reply.id == "before" and reply.error is None
            # the first read blocked READ_BLOCK_MS (the connection's id is known once it is open); the one
            # in flight now blocks LONG_BLOCK_MS
            await asyncio.sleep(READ_BLOCK_MS / 1000 + 0.3)
            assert runner.streams.block_ms == LONG_BLOCK_MS
            reader = runner._tasks[1]
            started = time.monotonic()
            await runner.stop()
            # the read ended by itself, not cancelled: whatever it had brought would have been answered
            assert reader.done() and not reader.cancelled()
            assert time.monotonic() - started < LONG_BLOCK_MS / 1000 / 3
        finally:
            if runner.state != "UNAVAILABLE":  # an assertion failed before the stop
                await runner.stop()
    finally:
        await redis.aclose()


async def test_where_redis_refuses_client_unblock_the_read_blocks_a_second(tmp_path: Path, redis_url: str,
                                                                           key_prefix: str) -> None:
    """A user that may not run CLIENT UNBLOCK (an ACL, a managed Redis): reads block READ_BLOCK_MS, as a
    stop has to wait them out, and a stop still ends the runner."""
    admin = aioredis.Redis.from_url(redis_url)
    user = f"{key_prefix}-user"
    await admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                            commands=["+@all", "-client|unblock"])
    redis = aioredis.Redis.from_url(redis_url, username=user, password="pw")
    runner = None
    try:
        runner = await mlp_runner(tmp_path, redis, key_prefix)
        worker = Worker(runner, redis, f"{key_prefix}:replies")
        await worker.enqueue("r")
        (reply,) = await worker.replies(1)
        assert reply.id == "r" and reply.error is None
        await asyncio.sleep(READ_BLOCK_MS / 1000 + 0.3)  # the first read's block is over: the next one's
        reading = runner.streams._reader
        # connected, its id asked for and refused: that, not a missing connection, keeps the block short
        assert reading is not None and reading.connected and reading.client_id is None
        assert runner.streams.block_ms == READ_BLOCK_MS
        reader = runner._tasks[1]
        await runner.stop()
        assert reader.done() and not reader.cancelled()
    finally:
        if runner is not None and runner.state != "UNAVAILABLE":
            await runner.stop()
        await redis.aclose()
        await admin.acl_deluser(user)
        await admin.aclose()


async def test_the_next_read_goes_out_with_a_batchs_replies(worker: Worker, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    # every batch whose cost is known runs on the loop: timed by the wall clock, one call stalled on a
    # loaded machine (23 ms once, against 0.1 ms) sent the batches after it to a thread, and their reads alone
    monkeypatch.setattr(execution, "INLINE_BELOW_US", float("inf"))
    for i in range(12):  # one at a time, as from a lone client
        await worker.enqueue(f"r{i}")
        (reply,) = await worker.replies(1)
        assert reply.id == f"r{i}" and reply.error is None
    # the first batch ran on a thread (the model's cost was not known yet): its read went alone
    assert worker.sent_with_replies[0] == 11


async def test_a_request_the_worker_fails_to_take_is_answered_and_the_model_reads_on(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error as a request is queued (a bug; a correlation ID too wide for its control was
    one) stopped the model's read loop without a word: that request and every later one hung."""
    put = worker.runner.batcher.put

    def failing(item: Any) -> None:
        if item.payload.request.id == "boom":
            raise OverflowError("a bug")
        put(item)
    monkeypatch.setattr(worker.runner.batcher, "put", failing)
    await worker.enqueue("boom")
    (reply,) = await worker.replies(1)
    assert reply.id == "boom" and reply.error == (Code.INTERNAL, "model 'mlp': OverflowError: a bug")
    for rid in ("after", "and after"):
        await worker.enqueue(rid)
        (reply,) = await worker.replies(1)
        assert reply.id == rid and reply.error is None


async def slow_on_a_thread(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The model takes 0.3 s a batch, on the instance's thread (its cost per row said to be long); the
    function returned makes it quick again."""
    backend = await runner.execution.instances.get()
    execute = backend.execute

    def slow(*args: Any) -> Any:
        time.sleep(0.3)
        return execute(*args)
    monkeypatch.setattr(backend, "execute", slow)
    runner.execution.instances.put_nowait(backend)
    monkeypatch.setattr(runner.execution, "row_us", 1e9)
    return lambda: monkeypatch.setattr(backend, "execute", execute)


async def test_a_batch_on_a_thread_lets_the_read_go_at_once(worker: Worker, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Requests that come while a batch runs on a thread are read meanwhile (they form the next batch)."""
    runner = worker.runner
    await slow_on_a_thread(runner, monkeypatch)
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
    undo = await slow_on_a_thread(runner, monkeypatch)
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
    undo()
    await worker.enqueue("next")
    (reply,) = await worker.replies(1)
    assert reply.id == "next" and reply.error is None


ENSEMBLE = """platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling { step [ { model_name: "mlp" model_version: -1
  input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }
"""


async def test_an_ensemble_reads_with_its_replies_only_while_all_that_is_out_is_here(
        worker: Worker, tmp_path: Path, key_prefix: str) -> None:
    folder = tmp_path / "ens"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(ENSEMBLE)
    config = load_model(folder).config
    runner = worker.runner
    host = EnsembleHost(worker.redis, Keys(key_prefix), ModelSpec.from_config(config), Ensemble.from_config(config),
                        1, lambda step: runner, "w", DeliveryPolicy(), deferred=runner.deferred)
    gateway = Replies(worker.redis, f"{key_prefix}:ens-replies")
    sent_with_replies = counted(host.streams)
    stream = host.streams.streams[0]

    await host.start()
    try:
        for i in range(8):  # one at a time: all that is out is here
            await enqueue(worker.redis, stream, gateway.stream, f"e{i}")
            (reply,) = await gateway.next(1)
            assert reply.id == f"e{i}" and reply.error is None
        assert sent_with_replies[0] >= 6
        # two out, one here: the read goes at once, the second is read, and the step's batch (which
        # waits for it) runs
        await enqueue(worker.redis, stream, gateway.stream, "a", b"2")
        await asyncio.sleep(0.05)
        await enqueue(worker.redis, stream, gateway.stream, "b", b"2")
        assert sorted(r.id for r in await gateway.next(2)) == ["a", "b"]
    finally:
        await host.stop(drain_s=0)


async def test_more_models_than_the_pool_has_connections_stop_at_once_and_leave_their_groups(
        redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A worker's models share its pool of Redis connections, which refused a command past its size rather
    than queue it. A worker of 200 models (the pool holds 64) stopped with 142 warnings "ending a blocked
    read failed (Too many connections)", each read then waited out (a second more per stop), and a model
    whose leave was refused stayed a consumer of its group for good. Here 12 models share 4 connections
    of a worker's pool, which waits for a free one."""
    redis = connect_worker(redis_url, max_connections=4)
    keys = Keys(key_prefix)
    models = [ModelStreams(redis, keys, f"m{i}", 1, 1, "w") for i in range(12)]
    stopping = asyncio.Event()

    async def read(streams: ModelStreams) -> None:
        while not stopping.is_set():
            await streams.read(1, streams.block_ms)

    try:
        for streams in models:
            await streams.ensure_groups()
        readers = [asyncio.create_task(read(streams)) for streams in models]
        await asyncio.sleep(READ_BLOCK_MS / 1000 + 0.3)  # the first reads' blocks are over: now the long ones
        assert all(streams.block_ms == LONG_BLOCK_MS for streams in models)
        stopping.set()
        started = time.monotonic()
        await asyncio.gather(*(streams.end_read(reader) for streams, reader in zip(models, readers)))
        assert all(reader.done() and not reader.cancelled() for reader in readers)
        assert time.monotonic() - started < READ_BLOCK_MS / 1000
        for streams in models:
            streams.close()
        await asyncio.gather(*(streams.leave() for streams in models))
        assert "failed" not in caplog.text
        for streams in models:
            (group,) = await redis.xinfo_groups(streams.streams[0])
            assert group["consumers"] == 0, streams.streams[0]
    finally:
        stopping.set()
        await redis.aclose(close_connection_pool=True)
