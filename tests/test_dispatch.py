"""The gateway's dispatcher on its own, against a real Redis: deadlines by one sweep, replies matched
by id, the requests in flight told to the workers, and failure logs that do not flood while Redis is
down."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.keys import FIELD, IN_FLIGHT, Keys
from despina.contract.records import InferReply, InferRequest
from despina.gateway import dispatch
from despina.gateway.dispatch import Dispatcher
from despina.logs import LOG_EVERY_S, Throttled

Started = tuple[Dispatcher, aioredis.Redis, Keys]


@pytest.fixture
async def started(redis_url: str, key_prefix: str) -> AsyncIterator[Started]:
    """A started dispatcher under the test's key prefix, its Redis client and its keys."""
    redis = aioredis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    d = Dispatcher(redis, keys)
    await d.start()
    try:
        yield d, redis, keys
    finally:
        await d.close()
        await redis.aclose()


async def test_deadlines_are_swept_and_replies_matched(started: Started) -> None:
    d, redis, keys = started
    results: dict[str, object] = {}
    stream, stats = keys.request_stream("m", 1, 1), keys.stats("m", 1)
    t0 = time.monotonic()
    for rid, timeout in (("a", 0.2), ("b", 5.0)):
        d.submit(stream, stats, InferRequest(rid, d.reply_stream, time.time() + timeout, ()), timeout,
                 lambda r, rid=rid: results.__setitem__(rid, (r, time.monotonic() - t0)))

    async def entries(n: int) -> bool:
        return bool(await redis.xlen(stream) >= n)

    await _until(lambda: entries(1))
    assert await redis.xlen(stream) == 1  # both in one entry, which says two are out
    assert (await redis.xrange(stream))[0][1][IN_FLIGHT] == b"2"
    # a worker's answer to b, and one to a request nobody waits for
    await redis.xadd(d.reply_stream, {FIELD: records.encode([InferReply("b"), InferReply("zz")])})
    await _until(lambda: _true(len(results) == 2))
    (a, a_at), (b, _) = results["a"], results["b"]
    assert isinstance(a, TimeoutError) and 0.2 <= a_at < 5.0  # at its own deadline, long before b's
    assert isinstance(b, InferReply) and b.id == "b"
    assert d.waiting == 0 and d.dropped == 1
    # neither is out any more, the timed-out one included: the next entry says one
    d.submit(stream, stats, InferRequest("c", d.reply_stream, time.time() + 5, ()), 5.0, lambda r: None)
    await _until(lambda: entries(2))
    assert (await redis.xrange(stream))[-1][1][IN_FLIGHT] == b"1"


async def test_a_request_with_less_time_left_than_one_before_it_times_out_on_time(started: Started) -> None:
    # a request woken from scale-to-zero, or an ensemble's later step, is submitted with what is left of
    # its time, behind requests with the whole timeout: the sweep used to stop at the first of those
    d, redis, keys = started
    results: dict[str, float] = {}
    stream, stats = keys.request_stream("m", 1, 1), keys.stats("m", 1)
    t0 = time.monotonic()
    for rid, timeout in (("long", 5.0), ("short", 0.2), ("shorter", 0.1)):
        d.submit(stream, stats, InferRequest(rid, d.reply_stream, time.time() + timeout, ()), timeout,
                 lambda r, rid=rid: results.__setitem__(rid, time.monotonic() - t0))
    await _until(lambda: _true({"short", "shorter"} <= set(results)))
    assert set(results) == {"short", "shorter"}, results  # while the long one still waits
    assert 0.1 <= results["shorter"] and 0.2 <= results["short"] < 5.0  # each at its own deadline
    assert d.waiting == 1


async def test_a_decoupled_models_responses_reach_the_request_in_order_once(started: Started) -> None:
    """Responses before the last go to the request as they come; a worker that runs the request again
    (another died with it) sends the first ones again, and those are dropped; the final one ends it."""
    d, redis, keys = started
    got: list[object] = []
    d.submit(keys.request_stream("m", 1, 1), keys.stats("m", 1),
             InferRequest("s", d.reply_stream, time.time() + 5, ()), 5.0, got.append)
    first_run = [InferReply("s", index=0, final=False), InferReply("s", index=1, final=False)]
    await redis.xadd(d.reply_stream, {FIELD: records.encode(first_run)})
    # the worker died; another runs the request from the start, and finishes it
    rerun = [InferReply("s", index=i, final=False) for i in range(3)] + [InferReply("s", index=3)]
    await redis.xadd(d.reply_stream, {FIELD: records.encode(rerun[:2])})
    await redis.xadd(d.reply_stream, {FIELD: records.encode(rerun[2:])})
    await _until(lambda: _true(len(got) == 4))
    assert [(r.index, r.final) for r in got] == [(0, False), (1, False), (2, False), (3, True)]
    assert d.waiting == 0 and d.dropped == 2 and not d._next


async def _true(value: bool) -> bool:
    return value


def test_a_recurring_failure_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    throttled = Throttled(logging.getLogger("despina.gateway"), logging.ERROR)
    with caplog.at_level(logging.ERROR, logger="despina.gateway"):
        for i in range(10):
            throttled.log("queueing failed: %d", i)
        assert [r.getMessage() for r in caplog.records] == ["queueing failed: 0"]
        throttled.last -= LOG_EVERY_S  # as if the interval had passed
        throttled.log("queueing failed: %d", 10)
    assert caplog.records[-1].getMessage() == "queueing failed: 10 (9 more like it since the last report)"



async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> float:
    """Poll `check` until it holds; the seconds that took."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


class Client:
    """A dispatcher for model m (and o) and what its callers got, with a test's steps as methods."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, hold_us: int) -> None:
        self.redis, self.keys = redis, keys
        self.d = Dispatcher(redis, keys, hold_us=hold_us)
        self.results: dict[str, object] = {}

    def submit(self, rid: str, model: str = "m") -> None:
        self.d.submit(self.keys.request_stream(model, 1, 1), self.keys.stats(model, 1),
                      InferRequest(rid, self.d.reply_stream, time.time() + 60, ()), 60.0,
                      lambda r: self.results.__setitem__(rid, r))

    async def answer(self, *rids: str) -> None:
        """A worker's answers to `rids`, once their callers have them."""
        await self.redis.xadd(self.d.reply_stream, {FIELD: records.encode([InferReply(r) for r in rids])})

        async def answered() -> bool:
            return all(r in self.results for r in rids)
        await _until(answered)

    async def entries(self, model: str = "m") -> list[list[str]]:
        """The request ids of each entry of the model's stream."""
        raw = await self.redis.xrange(self.keys.request_stream(model, 1, 1))
        return [[r.id for r in records.decode_requests(f[FIELD])] for _, f in raw]

    async def convoy_answered(self) -> None:
        """Three requests out (nothing held: nothing was answered yet), then their answers back."""
        for rid in "abc":
            self.submit(rid)
        await self.until_entries(1)
        await self.answer("a", "b", "c")

    async def held(self, for_s: float = 0.2) -> bool:
        """Whether the hold is still on after `for_s` (a window to end in wrongly: the tests' holds last
        tens of seconds, so a loop stalled meanwhile only lengthens it); a write it released meanwhile
        is awaited here, so that the test's next look at the stream sees it however slow Redis is."""
        await asyncio.sleep(for_s)
        await asyncio.sleep(0)  # a hold that ended has called for _flush, which starts the write: one turn
        await asyncio.gather(*self.d._writes)
        return self.d._holding

    async def until_entries(self, n: int, model: str = "m") -> float:
        async def there() -> bool:
            return len(await self.entries(model)) >= n
        return await _until(there)


@pytest.fixture
async def client_factory(redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
                         ) -> AsyncIterator[Callable[[int], Awaitable[Client]]]:
    monkeypatch.setattr(dispatch, "OWED_S", 60.0)  # a test's steps take longer than a closed loop's
    monkeypatch.setattr(dispatch, "HOLD_GAP_S", 60.0)
    redis = aioredis.Redis.from_url(redis_url)
    made: list[Client] = []

    async def make(hold_us: int) -> Client:
        client = Client(redis, Keys(f"{key_prefix}:c{len(made)}"), hold_us)  # under key_prefix: cleaned up
        await client.d.start()
        made.append(client)
        return client

    yield make
    for client in made:
        await client.d.close()
    await redis.aclose()


async def test_the_next_requests_of_answered_clients_go_out_together(client_factory: Callable[[int], Awaitable[Client]]) -> None:
    c = await client_factory(30_000_000)  # a hold ends when the requests come (or after 30 s)
    await c.convoy_answered()
    c.submit("d")
    c.submit("e")
    assert await c.held()
    assert await c.entries() == [["a", "b", "c"]]  # held: a third client is still to come
    c.submit("f")  # the third: the three go, in one entry
    await c.until_entries(2)
    assert (await c.entries())[1] == ["d", "e", "f"]

    await c.answer("d", "e")
    c.submit("g")  # held, one more expected ...
    assert await c.held()
    assert len(await c.entries()) == 2
    c.submit("h", "o")  # ... but a model with no answers just out is not held, and g goes with it
    await c.until_entries(1, "o")
    await c.until_entries(3)

    await c.answer("f", "g", "h")
    c.submit("i")  # f's and g's clients are expected; the gateway stops meanwhile
    await c.d.close()
    assert (await c.entries())[-1] == ["i"]  # what was held went out before it stopped


async def test_a_lone_clients_next_request_is_not_held(client_factory: Callable[[int], Awaitable[Client]]) -> None:
    c = await client_factory(30_000_000)
    c.submit("a")
    await c.until_entries(1)
    await c.answer("a")
    c.submit("b")  # its own answer's successor: nobody else to wait for
    assert await c.until_entries(2) < 5.0  # a hold would be 30 s


async def test_a_hold_ends_after_hold_us(client_factory: Callable[[int], Awaitable[Client]]) -> None:
    c = await client_factory(1_000_000)
    await c.convoy_answered()
    t0 = time.monotonic()
    c.submit("d")
    ends = c.d._hold_until
    await asyncio.sleep(0.3)
    assert c.d._holding  # 0.7 s to spare: a stalled loop does not end the hold before e comes
    c.submit("e")  # a second client back, c's is not coming: held 1 s from the first, not from e
    assert c.d._hold_until == ends
    assert await c.until_entries(2) < 5.0  # the cap, not the (60 s) gap, ended it ...
    assert time.monotonic() - t0 >= 1.0 - 1e-3  # ... and not before (a lower bound: stalls only add)
    assert (await c.entries())[1] == ["d", "e"]


async def test_a_hold_ends_when_the_clients_stop_coming(client_factory: Callable[[int], Awaitable[Client]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "HOLD_GAP_S", 1.0)
    c = await client_factory(30_000_000)
    await c.convoy_answered()
    c.submit("d")
    await asyncio.sleep(0.3)
    assert c.d._holding  # 0.7 s to spare: a stalled loop does not end the hold before e comes
    t_e = time.monotonic()
    c.submit("e")  # within the gap: the hold goes on, 1 s from e
    assert await c.until_entries(2) < 5.0  # then nobody for 1 s: it ends (hold_us would be 30 s) ...
    assert time.monotonic() - t_e >= 1.0 - 1e-3  # ... a gap after e, not d (a lower bound: stalls only add)
    assert (await c.entries())[1] == ["d", "e"]


async def test_a_few_clients_slower_than_the_gap_teach_the_hold_their_pace(
        client_factory: Callable[[int], Awaitable[Client]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Three clients that come back further apart than the gap (a Python client sends its next requests
    100-300 µs apart where the gap is 200 µs; here the gap is 0.8 s). The first convoy splits; the request
    just after the hold gave up says the gap was too short, and later convoys as far apart go as one entry.
    Once they stop coming back, the gap shrinks again. Each step waits for what it follows (the hold's
    end seen) or at least as long as it must, with hundreds of ms to spare where it must not be late: a
    loaded machine's stalls do not change what the hold decides. A request of another model stays out
    at a worker all along, so that the holds sleep on the alarm instead of spinning for seconds."""
    gap = 0.8
    monkeypatch.setattr(dispatch, "HOLD_GAP_S", gap)
    monkeypatch.setattr(dispatch, "MAX_HOLD_GAP_S", 4 * gap)
    c = await client_factory(30_000_000)
    c.submit("z", "o")  # out, and never answered
    await c.until_entries(1, "o")
    await c.convoy_answered()
    c.submit("r0")
    await c.until_entries(2)  # nobody came for the gap: the hold gave up, r0 went alone
    c.submit("r1")  # at once, well within a gap of that: one of theirs, so the gap was too short
    c.submit("r2")
    await c.until_entries(3)
    assert (await c.entries())[1:] == [["r0"], ["r1", "r2"]]
    learned = c.d._gap_s
    assert learned > gap + 0.1, learned
    await c.answer("r0", "r1", "r2")
    c.submit("r3")
    await asyncio.sleep(gap + 0.1)  # longer than the first gap, 0.3 s within the gap learned
    c.submit("r4")
    c.submit("r5")
    await c.until_entries(4)
    assert (await c.entries())[3] == ["r3", "r4", "r5"]  # one entry: the hold waited for r4
    await c.answer("r3", "r4", "r5")
    c.submit("r6")  # one client back; the other two are not coming
    await c.until_entries(5)  # the hold gave up on the gap learned
    gave_up = c.d._gave_up
    await _until(lambda: _true(time.monotonic() - gave_up > learned))
    c.submit("r7")  # more than a gap after it gave up: the gap was long enough, or too long
    assert c.d._gap_s < learned


async def test_the_reply_read_goes_out_with_the_next_requests_while_none_waits(
        client_factory: Callable[[int], Awaitable[Client]]) -> None:
    """With no request waiting for an answer no reply can come, so the reader's next read waits for the
    next requests and goes out in their write (one wake-up of Redis, not two); while any request still
    waits, it reads at once, and the answers of the others are not held up."""
    client = await client_factory(0)
    d = client.d
    sent: list[list[list]] = []
    send = d._in.send

    def recording(*pipelines: list) -> object:
        sent.append([list(p) for p in pipelines])
        return send(*pipelines)
    d._in.send = recording  # type: ignore[method-assign]
    for i in range(5):  # one at a time, as a lone client
        rid = f"r{i}"
        client.submit(rid)
        await client.until_entries(i + 1)
        await client.answer(rid)
        assert isinstance(client.results[rid], InferReply)
    def name(command: object) -> object:  # a Batch's commands are packed already (resp.Prefix)
        return command.split(b"\r\n")[2].decode() if isinstance(command, bytes) else command[0]  # type: ignore[index]
    together = [p for p in sent if len(p) == 2 and name(p[1][0]) == "XREAD"]
    assert len(together) >= 4  # the first read went alone: nothing was out before
    assert all(name(p[0][0]) == "XADD" for p in together)
    # two out: answered one after the other, the reader reads at once after the first
    client.submit("x")
    client.submit("y")
    await client.until_entries(6)
    await client.answer("x")
    await asyncio.wait_for(client.answer("y"), 5)
    assert d.waiting == 0


async def test_a_hold_spins_only_while_nothing_else_is_out(client_factory: Callable[[int], Awaitable[Client]]
                                                           ) -> None:
    """Held while every request waiting is held here (the workers wait for them): the loop spins, no
    alarm; held while others are out at a worker: it sleeps on the alarm (a reply may come meanwhile)."""
    c = await client_factory(30_000_000)
    assert c.d._alarm is not None
    armed: list[float] = []
    arm = c.d._alarm.arm
    c.d._alarm.arm = lambda when: (armed.append(when), arm(when))[1]  # type: ignore[method-assign]
    await c.convoy_answered()
    c.submit("d")
    c.submit("e")
    assert await c.held()
    assert armed == [] and len(await c.entries()) == 1  # held, spinning
    c.submit("f")
    await c.until_entries(2)
    await c.answer("d", "e")  # f is still out
    c.submit("g")
    assert await c.held()
    assert len(armed) == 1 and len(await c.entries()) == 2  # held, asleep
    c.submit("h")
    await c.until_entries(3)
