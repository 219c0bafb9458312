"""The gateway's dispatcher on its own, against a real Redis: deadlines by one sweep, replies matched
by id, the requests in flight told to the workers, and failure logs that do not flood while Redis is
down."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.keys import FIELD, IN_FLIGHT, Keys
from despina.contract.records import InferReply, InferRequest
from despina.gateway import dispatch
from despina.gateway.dispatch import Dispatcher, Throttled


async def test_deadlines_are_swept_and_replies_matched(redis_url: str, key_prefix: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    d = Dispatcher(redis, keys)
    await d.start()
    results: dict[str, object] = {}
    try:
        stream, stats = keys.request_stream("m", 1, 1), keys.stats("m", 1)
        t0 = time.monotonic()
        for rid, timeout in (("a", 0.2), ("b", 5.0)):
            d.submit(stream, stats, InferRequest(rid, d.reply_stream, time.time() + timeout, ()), timeout,
                     lambda r, rid=rid: results.__setitem__(rid, (r, time.monotonic() - t0)))
        await asyncio.sleep(0.05)
        assert await redis.xlen(stream) == 1  # both in one entry, which says two are out
        assert (await redis.xrange(stream))[0][1][IN_FLIGHT] == b"2"
        # a worker's answer to b, and one to a request nobody waits for
        await redis.xadd(d.reply_stream, {FIELD: records.encode([InferReply("b"), InferReply("zz")])})
        for _ in range(100):
            if len(results) == 2:
                break
            await asyncio.sleep(0.02)
        (a, a_at), (b, _) = results["a"], results["b"]
        assert isinstance(a, TimeoutError) and 0.2 <= a_at < 0.2 + dispatch.SWEEP_S + 0.2
        assert isinstance(b, InferReply) and b.id == "b"
        assert d.waiting == 0 and d.dropped == 1
        # neither is out any more, the timed-out one included: the next entry says one
        d.submit(stream, stats, InferRequest("c", d.reply_stream, time.time() + 5, ()), 5.0, lambda r: None)
        await asyncio.sleep(0.05)
        assert (await redis.xrange(stream))[-1][1][IN_FLIGHT] == b"1"
    finally:
        await d.close()
        await redis.aclose()


def test_a_recurring_failure_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    throttled = Throttled(logging.ERROR)
    with caplog.at_level(logging.ERROR, logger="despina.gateway"):
        for i in range(10):
            throttled.log("queueing failed: %d", i)
        assert [r.getMessage() for r in caplog.records] == ["queueing failed: 0"]
        throttled.last -= dispatch.LOG_EVERY_S  # as if the interval had passed
        throttled.log("queueing failed: %d", 10)
    assert caplog.records[-1].getMessage() == "queueing failed: 10 (9 more like it since the last report)"
