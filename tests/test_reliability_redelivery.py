"""Redelivery against a real Redis: a dead consumer's requests go back one per entry with their attempt
count, only the request a worker was running alone is charged, and at max_attempts a request is
answered with an error and dead-lettered instead of run again."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.errors import Code
from despina.contract.keys import ATTEMPTS, FIELD, GROUP, Keys
from despina.contract.records import InferRequest, Tensor
from despina.control.backlog import requeue
from despina.workers.redelivery import DeliveryPolicy, Queue, marker
from despina.workers.streams import ModelStreams


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
    assert await requeue(redis, queue, "dead", DeliveryPolicy()) == 3
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
    assert await requeue(redis, queue, "w1", DeliveryPolicy()) == 3
    attempts = {records.decode_requests(f[FIELD])[0].id: int(f[ATTEMPTS])
                for _, f in await read_all(redis, queue.stream, "w2")}
    assert attempts == {"running": 2, "waiting": 1, "fresh": 1}
    assert not await redis.smembers(keys.executing("w1"))


async def test_at_max_attempts_a_request_is_answered_and_dead_lettered(redis: aioredis.Redis,
                                                                       key_prefix: str) -> None:
    keys = Keys(key_prefix)
    queue, reply = Queue(keys, "m", 1), keys.reply_stream("gw")
    await redis.xgroup_create(queue.stream, GROUP, id="0", mkstream=True)
    await redis.set(keys.queued("m", 1), 2)
    poison = await redis.xadd(queue.stream, {FIELD: payload("poison", reply_to=reply), ATTEMPTS: 2})
    await redis.xadd(queue.stream, {FIELD: payload("innocent", reply_to=reply), ATTEMPTS: 1})
    await read_all(redis, queue.stream, "w1")
    await redis.sadd(keys.executing("w1"), marker(queue.stream, poison))
    policy = DeliveryPolicy(max_attempts=3, reply_ttl_ms=5_000)
    assert await requeue(redis, queue, "w1", policy) == 2

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


async def test_runners_redeliver_what_stays_pending_past_the_visibility_timeout(
        redis: aioredis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    streams = ModelStreams(redis, keys, "m", 1, 0, "alive")
    await streams.ensure_groups()
    stream = streams.streams[0]
    await redis.xadd(stream, {FIELD: payload("a", "b")})
    await read_all(redis, stream, "silent")
    policy = DeliveryPolicy(visibility_timeout_ms=200)
    assert await streams.reclaim(policy) == 0          # not idle long enough: its reader may be alive
    await asyncio.sleep(0.25)
    assert await streams.reclaim(policy) == 2
    entries = await streams.read(10, 100)
    streams.close()
    assert [(records.decode_requests(f[FIELD])[0].id, f[ATTEMPTS]) for _, _, f in entries] == \
        [("a", b"1"), ("b", b"1")]
    pending = await redis.xpending(stream, GROUP)
    assert pending["pending"] == 2 and {c["name"] for c in pending["consumers"]} == {b"alive"}


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
    assert await requeue(redis, queue, "w1", DeliveryPolicy()) == 2
    back = [(records.decode_requests(f[FIELD]), int(f[ATTEMPTS])) for _, f in await read_all(redis, queue.stream, "w2")]
    assert [(req.id, req.outputs, req.inputs[0].shape, req.inputs[0].numpy().tolist(), attempts)
            for (req,), attempts in back] == [("a", ("y",), (1, 2), [[0.0, 1.0]], 1),
                                              ("b", ("y",), (2, 2), [[2.0, 3.0], [4.0, 5.0]], 1)]
