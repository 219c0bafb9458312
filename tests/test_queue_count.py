"""The queued counters of levels with max_queue_size, as workers keep them (workers/queued.py): a request
leaves its level's count when its batch starts, or when it is answered without running; one a dead worker
had started comes back counted; whatever happens, once everything is answered the count is 0."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import uvloop
from onnx import TensorProto

from despina.contract import records
from despina.contract.keys import FIELD, GROUP, Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferRequest, Tensor
from despina.control.backlog import requeue_all
from despina.control.repository import load_model
from despina.examples import build_identity
from despina.resp import Batch, Resp
from despina.workers.intake import Pending
from despina.workers.redelivery import DeliveryPolicy, Queue
from despina.workers.runner import ModelRunner

from .test_worker_reads import Replies


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def bounded(folder: Path, policy: str = "", batching: str = "") -> ModelSpec:
    build_identity(folder / "1" / "model.onnx", TensorProto.FLOAT)
    (folder / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 8\n'
        f"dynamic_batching {{ {batching} default_queue_policy {{ max_queue_size: 10 {policy} }} }}\n")
    return ModelSpec.from_config(load_model(folder).config)


def request(rid: str, reply_to: str, deadline_s: float = 60, timeout_us: int = 0) -> InferRequest:
    x = Tensor("in", "FP32", (1, 3), np.ones((1, 3), np.float32).tobytes())
    now = time.time()
    return InferRequest(rid, reply_to, now + deadline_s, (x,), ("out",), timeout_us=timeout_us, enqueued=now)


async def queue_up(redis: aioredis.Redis, keys: Keys, reqs: list[InferRequest]) -> list[bytes]:
    """As a gateway queues them on a bounded level: one entry each, counted in."""
    stream = keys.request_stream("m", 1)
    if not await redis.exists(stream):
        await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ids = [await redis.xadd(stream, {FIELD: records.encode([r])}) for r in reqs]
    await redis.incrby(keys.queued("m", 1), len(reqs))
    return ids


async def answered_by_a_runner(redis: aioredis.Redis, keys: Keys, spec: ModelSpec, folder: Path, n: int,
                               **kw: object) -> list[str]:
    """Run a worker's runner until it has answered `n` requests; their ids (with an error's code)."""
    runner = ModelRunner(redis, keys, spec, 1, folder, "alive", **kw)  # type: ignore[arg-type]
    await runner.load()
    await runner.start()
    try:
        replies = await Replies(redis, keys.reply_stream("gw")).next(n)
    finally:
        await runner.stop()
    return sorted(r.id + (f":{r.error[0].name}" if r.error else "") for r in replies)


async def test_a_dead_workers_started_requests_come_back_counted(redis: aioredis.Redis, key_prefix: str,
                                                                 tmp_path: Path) -> None:
    """The dead worker had read three requests and started a batch of one of them: that one had left the
    count (2 left); redelivered, it is queued again (3); all answered, 0."""
    keys = Keys(key_prefix)
    spec = bounded(tmp_path / "m")
    reply_to, counter, stream = keys.reply_stream("gw"), keys.queued("m", 1), keys.request_stream("m", 1)
    reqs = [request(rid, reply_to) for rid in "abc"]
    ids = await queue_up(redis, keys, reqs)
    await redis.xreadgroup(GROUP, "dead", {stream: ">"}, count=10)
    dead = ModelRunner(redis, keys, spec, 1, tmp_path / "m", "dead")
    assert dead.writer.moves is not None
    dead.writer.moves.start([Pending(reqs[0], (stream, ids[0]), {})])  # its batch started, then it died
    pipe, out = Batch(), Resp.like(redis)
    dead.writer.moves.into(pipe)
    await out.execute(pipe.commands)
    out.close()
    assert int(await redis.get(counter)) == 2
    assert await requeue_all(redis, [Queue(keys, "m", 1)], "dead", DeliveryPolicy()) == 3
    assert int(await redis.get(counter)) == 3
    assert await answered_by_a_runner(redis, keys, spec, tmp_path / "m", 3) == ["a", "b", "c"]
    assert int(await redis.get(counter)) == 0
    assert not await redis.exists(keys.executing("alive"))


async def test_requests_answered_without_running_leave_the_count(redis: aioredis.Redis, key_prefix: str,
                                                                 tmp_path: Path) -> None:
    """One past its deadline when read, one past its queue timeout (REJECT) while the batch waits out its
    delay, one that runs: each leaves the count once."""
    keys = Keys(key_prefix)
    spec = bounded(tmp_path / "m", "default_timeout_microseconds: 60000000 allow_timeout_override: true",
                   "max_queue_delay_microseconds: 2000000")
    reply_to = keys.reply_stream("gw")
    await queue_up(redis, keys, [request("late", reply_to, deadline_s=-1),
                                 request("impatient", reply_to, timeout_us=1000)])
    got = answered_by_a_runner(redis, keys, spec, tmp_path / "m", 2, full_queue_delay=True)
    assert await got == ["impatient:RESOURCE_EXHAUSTED", "late:DEADLINE_EXCEEDED"]
    assert int(await redis.get(keys.queued("m", 1))) == 0
    await redis.delete(reply_to)  # read
    await queue_up(redis, keys, [request("runs", reply_to)])
    assert await answered_by_a_runner(redis, keys, spec, tmp_path / "m", 1) == ["runs"]
    assert int(await redis.get(keys.queued("m", 1))) == 0


async def test_each_priority_level_keeps_its_own_count(redis: aioredis.Redis, key_prefix: str,
                                                       tmp_path: Path) -> None:
    """priority_queue_policy's max_queue_size per level: each level's requests leave that level's count."""
    keys = Keys(key_prefix)
    folder = tmp_path / "m"
    build_identity(folder / "1" / "model.onnx", TensorProto.FLOAT)
    (folder / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 8\ndynamic_batching { priority_levels: 2 '
        "default_priority_level: 2 priority_queue_policy { key: 1 value { max_queue_size: 3 } } "
        "priority_queue_policy { key: 2 value { max_queue_size: 5 } } }\n")
    spec = ModelSpec.from_config(load_model(folder).config)
    reply_to = keys.reply_stream("gw")
    for level, ids in ((1, "ab"), (2, "cde")):
        stream = keys.request_stream("m", 1, level)
        await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for rid in ids:
            req = request(rid, reply_to)
            req = InferRequest(req.id, req.reply_to, req.deadline, req.inputs, req.outputs, priority=level,
                               enqueued=req.enqueued)
            await redis.xadd(stream, {FIELD: records.encode([req])})
        await redis.incrby(keys.queued("m", 1, level), len(ids))
    assert await answered_by_a_runner(redis, keys, spec, folder, 5) == ["a", "b", "c", "d", "e"]
    assert [int(await redis.get(keys.queued("m", 1, level))) for level in (1, 2)] == [0, 0]



def test_started_entries_leave_the_executing_set_once_answered(redis_url: str, key_prefix: str,
                                                               tmp_path: Path) -> None:
    """On uvloop, whose timers run before the tasks made ready in the loop's previous turn, the moves write
    due MOVES_WAIT_S after a batch started (runner._write_moves) could take the batch's start and go out in a
    task behind the replies task that the batch, run inline, had made: the SREM of its entries ran before
    their SADD, and they stayed in the worker's executing set for good (2,868 after a 5-minute soak; here
    about a third of 100 requests sent one at a time). Once each is answered, the set is empty."""
    keys = Keys(key_prefix)
    spec = bounded(tmp_path / "m")
    reply_to, stream = keys.reply_stream("gw"), keys.request_stream("m", 1)

    async def run() -> tuple[int, int]:
        redis = aioredis.Redis.from_url(redis_url)
        await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        runner = ModelRunner(redis, keys, spec, 1, tmp_path / "m", "alive")
        await runner.load()
        await runner.start()
        replies = Replies(redis, reply_to)
        try:
            for i in range(100):
                await queue_up(redis, keys, [request(str(i), reply_to)])
                assert [r.id for r in await replies.next(1)] == [str(i)]
                await asyncio.sleep(0.002)  # past MOVES_WAIT_S: the next batch's start sets its timer
        finally:
            await runner.stop()
        try:
            return await redis.scard(keys.executing("alive")), int(await redis.get(keys.queued("m", 1)))
        finally:
            await redis.aclose()

    assert uvloop.run(run()) == (0, 0)
