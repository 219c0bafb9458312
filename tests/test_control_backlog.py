"""What nobody would answer, against a real Redis: a dead consumer's pending entries, an unloaded
model's queue."""
from __future__ import annotations

import time

import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.errors import Code
from despina.contract.keys import FIELD, GROUP, Keys
from despina.contract.records import InferRequest
from despina.control.backlog import refuse, requeue_all
from despina.workers.redelivery import DeliveryPolicy, Queue


def request(rid: str, reply_to: str) -> bytes:
    return records.encode([InferRequest(rid, reply_to, time.time() + 60, ())])


async def test_a_dead_consumers_entries_go_back_on_the_stream(redis_url: str, key_prefix: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    queue, policy = Queue(Keys(key_prefix), "m", 1), DeliveryPolicy()
    stream = queue.stream
    try:
        await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for i in range(3):
            await redis.xadd(stream, {FIELD: request(str(i), "r")})
        read = await redis.xreadgroup(GROUP, "dead", {stream: ">"}, count=2)
        assert len(read[0][1]) == 2
        assert await requeue_all(redis, [queue], "dead", policy) == 2
        assert (await redis.xpending(stream, GROUP))["pending"] == 0
        again = await redis.xreadgroup(GROUP, "alive", {stream: ">"}, count=10)
        ids = [records.decode_requests(f[FIELD])[0].id for _, f in again[0][1]]
        assert sorted(ids) == ["0", "1", "2"]              # the unread one, then the two requeued
        assert await requeue_all(redis, [queue], "nobody", policy) == 0
        assert await requeue_all(redis, [Queue(Keys(key_prefix), "none", 1)], "dead", policy) == 0
    finally:
        await redis.aclose()


async def test_an_unloaded_models_queue_is_answered(redis_url: str, key_prefix: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    queue, reply = Queue(keys, "m", 1, 2), keys.reply_stream("gw")
    stream = queue.stream
    try:
        await redis.xadd(stream, {FIELD: records.encode([InferRequest("a", reply, time.time() + 60, ()),
                                                         InferRequest("b", reply, time.time() + 60, ())])})
        await redis.set(keys.queued("m", 1, 2), 2)   # the gateway counted them in (max_queue_size)
        await redis.hset(keys.stats("m", 1), "enqueued", 2)
        assert await refuse(redis, queue, "model 'm' was unloaded", 5_000) == 2
        assert await redis.xlen(stream) == 0
        (_, fields), = (await redis.xrange(reply))
        answers = records.decode_replies(fields[FIELD])
        assert [(a.id, a.error) for a in answers] == [("a", (Code.UNAVAILABLE, "model 'm' was unloaded")),
                                                      ("b", (Code.UNAVAILABLE, "model 'm' was unloaded"))]
        assert 0 < await redis.pttl(reply) <= 5_000  # read by nobody if its gateway died: it expires
        # answered: off the queue's count (a reload's max_queue_size is whole again) and failures, as
        # Triton counts them, so that nothing stays pending in the metrics
        assert int(await redis.get(keys.queued("m", 1, 2))) == 0
        stats = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.stats("m", 1))).items()}
        assert stats == {"enqueued": 2, "fail_count": 2, "fail:OTHER": 2}
        other = Queue(keys, "m", 1, 3)
        await redis.xadd(other.stream, {FIELD: records.encode([InferRequest("c", reply, time.time() + 60, ())])})
        assert await refuse(redis, other, "model 'm' was unloaded", 5_000) == 1
        assert not await redis.exists(keys.queued("m", 1, 3))  # a level without max_queue_size: no counter
    finally:
        await redis.aclose()
