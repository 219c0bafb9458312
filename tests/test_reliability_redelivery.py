"""Redelivery against a real Redis: a dead consumer's requests go back one per entry with their attempt
count, only the request a worker was running alone is charged, and at max_attempts a request is
answered with an error and dead-lettered instead of run again."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from onnx import TensorProto

from despina.contract import records
from despina.contract.errors import Code
from despina.contract.keys import ATTEMPTS, FIELD, GROUP, Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferRequest, Tensor
from despina.control.backlog import requeue_all
from despina.control.repository import load_model
from despina.examples import build_identity
from despina.workers.redelivery import DeliveryPolicy, Queue, marker
from despina.workers.runner import ModelRunner
from despina.workers.streams import ModelStreams
from despina.workers.sweep import PendingSweep

from .test_worker_reads import Replies


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def payload(*ids: str, reply_to: str = "r") -> bytes:
    return records.encode([InferRequest(i, reply_to, time.time() + 60, ()) for i in ids])


async def read_all(redis: aioredis.Redis, stream: str, consumer: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    got = await redis.xreadgroup(GROUP, consumer, {stream: ">"}, count=100)
    return got[0][1] if got else []


async def test_a_dead_consumers_entry_comes_back_one_request_per_entry(redis: aioredis.Redis,
                                                                       key_prefix: str) -> None:
    queue = Queue(Keys(key_prefix), "m", 1)
    await redis.xgroup_create(queue.stream, GROUP, id="0", mkstream=True)
    await redis.xadd(queue.stream, {FIELD: payload("a", "b", "c")})
    await read_all(redis, queue.stream, "dead")
    assert await requeue_all(redis, [queue], "dead", DeliveryPolicy()) == 3
    entries = await read_all(redis, queue.stream, "alive")
    assert [(records.decode_requests(f[FIELD])[0].id, f[ATTEMPTS]) for _, f in entries] == \
        [("a", b"1"), ("b", b"1"), ("c", b"1")]
    assert (await redis.xpending(queue.stream, GROUP))["pending"] == 3  # alive's, none left of dead's
    assert await redis.xlen(queue.stream) == 3


async def test_only_the_request_running_alone_is_charged(redis: aioredis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    queue = Queue(keys, "m", 1)
    await redis.xgroup_create(queue.stream, GROUP, id="0", mkstream=True)
    running = await redis.xadd(queue.stream, {FIELD: payload("running"), ATTEMPTS: 1})
    await redis.xadd(queue.stream, {FIELD: payload("waiting"), ATTEMPTS: 1})
    await redis.xadd(queue.stream, {FIELD: payload("fresh")})
    await read_all(redis, queue.stream, "w1")
    await redis.sadd(keys.executing("w1"), marker(queue.stream, running))
    assert await requeue_all(redis, [queue], "w1", DeliveryPolicy()) == 3
    attempts = {records.decode_requests(f[FIELD])[0].id: int(f[ATTEMPTS])
                for _, f in await read_all(redis, queue.stream, "w2")}
    assert attempts == {"running": 2, "waiting": 1, "fresh": 1}
    assert not await redis.smembers(keys.executing("w1"))


async def test_at_max_attempts_a_request_is_answered_and_dead_lettered(redis: aioredis.Redis,
                                                                       key_prefix: str) -> None:
    keys = Keys(key_prefix)
    queue, reply = Queue(keys, "m", 1), keys.reply_stream("gw")
    await redis.xgroup_create(queue.stream, GROUP, id="0", mkstream=True)
    await redis.set(keys.queued("m", 1), 1)  # the innocent one: the poison's batch had started (marked)
    poison = await redis.xadd(queue.stream, {FIELD: payload("poison", reply_to=reply), ATTEMPTS: 2})
    await redis.xadd(queue.stream, {FIELD: payload("innocent", reply_to=reply), ATTEMPTS: 1})
    await read_all(redis, queue.stream, "w1")
    await redis.sadd(keys.executing("w1"), marker(queue.stream, poison))
    policy = DeliveryPolicy(max_attempts=3, reply_ttl_ms=5_000)
    assert await requeue_all(redis, [queue], "w1", policy) == 2

    (_, fields), = await redis.xrange(reply)
    (answer,) = records.decode_replies(fields[FIELD])
    assert answer.id == "poison" and answer.error is not None and answer.error[0] == Code.BACKEND
    assert "dead-lettered after 3 attempts" in answer.error[1]
    assert 0 < await redis.pttl(reply) <= 5_000
    (_, dead), = await redis.xrange(keys.dead_letters("m", 1))
    assert records.decode_requests(dead[FIELD])[0].id == "poison"
    assert dead[ATTEMPTS] == b"3" and dead[b"worker"] == b"w1"
    left = await read_all(redis, queue.stream, "w2")
    assert [records.decode_requests(f[FIELD])[0].id for _, f in left] == ["innocent"]
    stats = await redis.hgetall(keys.stats("m", 1))
    assert stats[b"fail:BACKEND"] == b"1" and stats[b"fail_count"] == b"1"
    assert await redis.get(keys.queued("m", 1)) == b"1"


async def test_the_sweep_redelivers_what_stays_pending_past_the_visibility_timeout(
        redis: aioredis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    streams = ModelStreams(redis, keys, "m", 1, 0, "alive")
    await streams.ensure_groups()
    stream = streams.streams[0]
    await redis.xadd(stream, {FIELD: payload("a", "b")})
    await read_all(redis, stream, "silent")
    sweep = PendingSweep(redis)
    sweep.add(streams, DeliveryPolicy(visibility_timeout_ms=200), "model m")
    assert await sweep.sweep() == 0          # not idle long enough: its reader may be alive
    await asyncio.sleep(0.25)
    assert await sweep.sweep() == 2
    entries = await streams.read(10, 100)
    streams.close()
    assert [(records.decode_requests(f[FIELD])[0].id, f[ATTEMPTS]) for _, _, f in entries] == \
        [("a", b"1"), ("b", b"1")]
    pending = await redis.xpending(stream, GROUP)
    assert pending["pending"] == 2 and {c["name"] for c in pending["consumers"]} == {b"alive"}


def identity(folder: Path, priority_levels: int) -> ModelSpec:
    build_identity(folder / "1" / "model.onnx", TensorProto.FLOAT)
    levels = f"dynamic_batching {{ priority_levels: {priority_levels} default_priority_level: 1 }}" if priority_levels > 1 else ""
    (folder / "config.pbtxt").write_text(f'backend: "onnxruntime"\nmax_batch_size: 8\n{levels}\n')
    return ModelSpec.from_config(load_model(folder).config)


async def test_one_sweep_redelivers_for_every_model_by_its_own_visibility_timeout(
        redis: aioredis.Redis, key_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A worker's models share its one sweep of their pending entries (workers/sweep.py), each by its own
    visibility timeout: what a dead consumer read from every stream of every model (one with two priority
    levels) comes back and is answered, and no runner looks for such entries on its own."""
    keys = Keys(key_prefix)
    gateway = keys.reply_stream("gw")
    sweep = PendingSweep(redis)
    timeouts = {"fast": (200, 1), "levels": (300, 2), "slow": (1200, 1)}  # ms, priority levels
    runners: list[ModelRunner] = []
    sent: dict[str, tuple[str, int]] = {}  # request id -> (stream, visibility timeout)
    try:
        for name, (timeout_ms, levels) in timeouts.items():
            runner = ModelRunner(redis, keys, identity(tmp_path / name, levels), 1, tmp_path / name, "alive",
                                 delivery=DeliveryPolicy(visibility_timeout_ms=timeout_ms), sweep=sweep)
            await runner.load()
            for stream in runner.streams.streams:  # what the dead consumer read before it died
                rid = f"{name}-{len(sent)}"
                x = Tensor("in", "FP32", (1, 3), np.full((1, 3), len(sent), np.float32).tobytes())
                request = InferRequest(rid, gateway, time.time() + 60, (x,), ("out",), enqueued=time.time())
                await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
                await redis.xadd(stream, {FIELD: records.encode([request])})
                await read_all(redis, stream, "dead")
                sent[rid] = (stream, timeout_ms)
            await runner.start()
            runners.append(runner)
        await asyncio.sleep(1.4)  # past every model's visibility timeout: nobody but the sweep redelivers
        assert [(await redis.xpending(s, GROUP))["consumers"] for s, _ in sent.values()] == \
            [[{"name": b"dead", "pending": 1}]] * len(sent)
        with caplog.at_level(logging.WARNING, logger="despina.worker"):
            sweeping = asyncio.create_task(sweep.run())
            replies = await Replies(redis, gateway).next(len(sent))
            sweeping.cancel()
        assert sorted((r.id, r.error, r.outputs[0].numpy().tolist()) for r in replies) == \
            [(rid, None, [[float(i)] * 3]) for i, rid in enumerate(sent)]
        # each stream's entry was taken by its model's own timeout
        assert sorted(r.getMessage() for r in caplog.records) == sorted(
            f"requeued 1 requests that dead had read on {stream} (pending over {timeout_ms} ms)"
            for stream, timeout_ms in sent.values())
    finally:
        for runner in runners:
            await runner.stop()


async def test_the_sweep_goes_on_after_an_error_it_did_not_expect(
        redis: aioredis.Redis, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A bug met in one sweep (here: the first redelivery raises) is logged, and the next sweep redelivers:
    the sweep is the worker's only one, and its end would leave every model's abandoned entries pending."""
    streams = ModelStreams(redis, Keys(key_prefix), "m", 1, 1, "alive")
    stream = streams.streams[0]
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    await redis.xadd(stream, {FIELD: payload("a")})
    await read_all(redis, stream, "dead")
    real, calls = streams.redeliver, []

    async def broken_once(*args: object) -> int:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a bug in the sweep")
        return await real(*args)  # type: ignore[arg-type]

    streams.redeliver = broken_once  # type: ignore[method-assign]
    sweep = PendingSweep(redis)
    sweep.add(streams, DeliveryPolicy(visibility_timeout_ms=100), "model m")
    with caplog.at_level(logging.ERROR, logger="despina.worker"):
        sweeping = asyncio.create_task(sweep.run())
        try:
            deadline = time.monotonic() + 10
            while not (back := await read_all(redis, stream, "other")):
                assert time.monotonic() < deadline, "the entry never came back"
                await asyncio.sleep(0.05)
        finally:
            sweeping.cancel()
    assert len(calls) == 2 and [records.decode_requests(f[FIELD])[0].id for _, f in back] == ["a"]
    assert "sweeping the pending entries of its streams failed" in caplog.text


async def test_a_grouped_request_comes_back_as_its_clients_requests(redis: aioredis.Redis,
                                                                      key_prefix: str) -> None:
    """One client's rows may be what killed the worker: each client's request comes back on its own, to run
    alone and be charged alone, not the whole group dead-lettered for it."""
    keys = Keys(key_prefix)
    queue = Queue(keys, "m", 1)
    await redis.xgroup_create(queue.stream, GROUP, id="0", mkstream=True)
    x = Tensor("x", "FP32", (3, 2), np.arange(6, dtype=np.float32).tobytes())
    group = InferRequest(records.grouped_id([("a", 1), ("b", 2)]), "r", time.time() + 60, (x,), ("y",))
    running = await redis.xadd(queue.stream, {FIELD: records.encode([group])})
    await read_all(redis, queue.stream, "w1")
    await redis.sadd(keys.executing("w1"), marker(queue.stream, running))
    assert await requeue_all(redis, [queue], "w1", DeliveryPolicy()) == 2
    back = [(records.decode_requests(f[FIELD]), int(f[ATTEMPTS])) for _, f in await read_all(redis, queue.stream, "w2")]
    assert [(req.id, req.outputs, req.inputs[0].shape, req.inputs[0].numpy().tolist(), attempts)
            for (req,), attempts in back] == [("a", ("y",), (1, 2), [[0.0, 1.0]], 1),
                                              ("b", ("y",), (2, 2), [[2.0, 3.0], [4.0, 5.0]], 1)]
