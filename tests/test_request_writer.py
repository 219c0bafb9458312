"""The gateway's request writes when Redis refuses some commands of a pipeline: each request is answered as
its own command went (its entry refused: Redis's error; added: its answer as usual), and the enqueued
counts say what was really queued."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.errors import Code, DespinaError
from despina.contract.keys import FIELD, Keys
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.gateway.dispatch import Dispatcher

from .reliability_support import own_redis


class Writer:
    """A started dispatcher (no holds), what its callers got, and a worker's answers by hand."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.d = Dispatcher(redis, keys, hold_us=0)
        self.results: dict[str, object] = {}

    def submit(self, rid: str, model: str, rows: int = 1, width: int = 4, group_rows: int = 0,
               bound: int = 0) -> None:
        x = Tensor("x", "FP32", (rows, width), bytes(4 * rows * width))
        self.d.submit(self.keys.request_stream(model, 1), self.keys.stats(model, 1),
                      InferRequest(rid, self.d.reply_stream, time.time() + 60, (x,)), 60.0,
                      lambda r: self.results.__setitem__(rid, r),
                      (self.keys.queued(model, 1), bound) if bound else None, group_rows)

    async def until(self, check: Callable[[], bool]) -> None:
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out; results: {self.results}")

    async def answer(self, *rids: str) -> None:
        await self.redis.xadd(self.d.reply_stream, {FIELD: records.encode([InferReply(r) for r in rids])})
        await self.until(lambda: all(isinstance(self.results.get(r), InferReply) for r in rids))

    async def enqueued(self, model: str) -> int:
        return int(await self.redis.hget(self.keys.stats(model, 1), "enqueued") or 0)


@pytest.fixture
async def writer_on() -> AsyncIterator[Callable[[str, str], Awaitable[Writer]]]:
    made: list[tuple[Writer, aioredis.Redis]] = []

    async def make(url: str, prefix: str) -> Writer:
        redis = aioredis.Redis.from_url(url)
        writer = Writer(redis, Keys(prefix))
        made.append((writer, redis))
        await writer.d.start()
        return writer

    yield make
    for writer, redis in made:
        await writer.d.close()
        await redis.aclose()


async def test_an_entry_redis_refuses_fails_its_own_requests_only(
        writer_on: Callable[[str, str], Awaitable[Writer]], redis_url: str, key_prefix: str) -> None:
    """Model m's stream is another program's string (WRONGTYPE): m's requests, grouped ones and one with a
    bounded queue included, get that error; o's, in the same pipeline, are queued and answered. The whole
    pipeline used to fail, every request in it answered 503 while o's still ran on a worker."""
    w = await writer_on(redis_url, key_prefix)
    await w.redis.set(w.keys.request_stream("m", 1), "not a stream")
    w.submit("m1", "m", group_rows=8)
    w.submit("m2", "m", group_rows=8)  # grouped with m1: one request in one entry
    w.submit("m3", "m", bound=10)
    w.submit("o1", "o")
    w.submit("o2", "o", bound=10)
    await w.until(lambda: {"m1", "m2", "m3"} <= set(w.results))
    for rid in ("m1", "m2", "m3"):
        error = w.results[rid]
        assert isinstance(error, DespinaError) and error.code == Code.INTERNAL, error
        assert "WRONGTYPE" in error.message and "--key-prefix" in error.message, error.message
    await asyncio.sleep(0.1)
    assert "o1" not in w.results and "o2" not in w.results  # queued: waiting for their answers
    assert await w.redis.xlen(w.keys.request_stream("o", 1)) == 2
    await w.answer("o1", "o2")
    assert w.d.waiting == 0
    # m's HINCRBY went through with its refused XADD: taken back (the bounded ones count in their script)
    assert await w.enqueued("m") == 0 and await w.enqueued("o") == 2


async def test_a_request_redis_refuses_for_memory_is_503_with_its_message(
        writer_on: Callable[[str, str], Awaitable[Writer]], tmp_path: Path) -> None:
    """A Redis at its maxmemory (noeviction, the default) refuses the XADD that holds a large request
    (its 4 MB are in memory while the command waits to run) and takes the small one before it: the
    large one's client gets 503 with Redis's words, the small one its answer."""
    with own_redis(tmp_path) as server:
        w = await writer_on(server.url, "p")
        used = (await w.redis.info("memory"))["used_memory"]
        await w.redis.config_set("maxmemory", used + (2 << 20))
        try:
            w.submit("small", "m")
            w.submit("large", "o", width=1 << 20)
            await w.until(lambda: "large" in w.results)
        finally:
            await w.redis.config_set("maxmemory", 0)
        error = w.results["large"]
        assert isinstance(error, DespinaError) and error.code == Code.UNAVAILABLE, error
        assert "OOM command not allowed when used memory > 'maxmemory'" in error.message, error.message
        assert "small" not in w.results
        await w.answer("small")
        assert await w.enqueued("m") == 1 and await w.enqueued("o") == 0


async def test_counters_that_rode_with_refused_requests_are_written_while_redis_is_full(
        writer_on: Callable[[str, str], Awaitable[Writer]], tmp_path: Path) -> None:
    """The gateway's own counters (here a refusal of its own) ride with its next requests; Redis full, it
    refuses them with the requests, and they are written again as allow_oom lets them. They were lost."""
    with own_redis(tmp_path) as server:
        w = await writer_on(server.url, "p")
        await w.redis.config_set("maxmemory", 1)
        try:
            w.d.refused(w.keys.stats("m", 1))
            w.submit("a", "m")
            await w.until(lambda: "a" in w.results)
            assert isinstance(w.results["a"], DespinaError) and w.results["a"].code == Code.UNAVAILABLE
            counted = await w.redis.hgetall(w.keys.stats("m", 1))
        finally:
            await w.redis.config_set("maxmemory", 0)
        assert counted == {b"fail_count": b"1", b"fail:REJECTED": b"1", b"refused": b"1"}, counted


async def test_a_cancellation_reaches_the_workers_while_redis_is_full(
        writer_on: Callable[[str, str], Awaitable[Writer]], tmp_path: Path) -> None:
    """A client that goes away is named in the gateway's cancelled set, which a decoupled model's worker
    reads with each response (and stops): Redis full, the SADD was refused and the model streamed on to
    nobody. Written now as allow_oom lets it (a few bytes), as the gateway's counters are."""
    with own_redis(tmp_path) as server:
        w = await writer_on(server.url, "p")
        w.submit("a", "m")
        await w.until(lambda: w.d.waiting == 1)
        cancelled = w.keys.cancelled(w.d.reply_stream)
        await w.redis.config_set("maxmemory", 1)
        try:
            w.d.cancel("a")
            for _ in range(500):
                if await w.redis.sismember(cancelled, "a"):
                    break
                await asyncio.sleep(0.01)
            named = await w.redis.sismember(cancelled, "a")
        finally:
            await w.redis.config_set("maxmemory", 0)
        assert named and 0 < await w.redis.pttl(cancelled) <= w.d.reply_ttl_ms
        assert isinstance(w.results["a"], DespinaError) and w.results["a"].code == Code.CANCELLED


async def test_the_cancelled_set_keeps_only_the_recent_cancellations(
        writer_on: Callable[[str, str], Awaitable[Writer]], redis_url: str, key_prefix: str) -> None:
    """Each cancellation renewed the cancelled set's time to live, so a gateway whose clients kept going away
    (a stop button under a stream) kept every id it ever named there: 200 after 8 waves of 25 cancellations
    0.4 s apart, the reply TTL 1.5 s, and growing for as long as it served. An id is named for the reply
    TTL now, as long as when the set expired a TTL after it; the next cancellation after that takes it out."""
    w = await writer_on(redis_url, key_prefix)
    w.d.reply_ttl_ms = 1500  # (over the 1 s in which the gateway renews its mark)
    cancelled = w.keys.cancelled(w.d.reply_stream)
    for wave in range(8):
        rids = [f"{wave}-{i}" for i in range(25)]
        for rid in rids:
            w.submit(rid, "m")
        await w.until(lambda: w.d.waiting == 25)
        for rid in rids:
            w.d.cancel(rid)
        for _ in range(500):  # the cancellations' write on its way
            if await w.redis.sismember(cancelled, rids[-1]):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.4)
    # the last wave went 2.8 s after the first: the waves named 1.5 s before it or earlier are out
    assert await w.redis.scard(cancelled) <= 125
    assert not await w.redis.sismember(cancelled, "0-0") and await w.redis.sismember(cancelled, "7-24")
