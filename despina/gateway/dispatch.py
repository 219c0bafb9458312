"""Requests out to the model streams, replies back from this gateway's own reply stream.

Every request that arrives in one event-loop tick goes out in one pipeline, as one stream entry per
model stream. One background task reads the reply stream and calls each waiting request's callback
by id; a reply whose request is no longer waited for (a duplicate, or one past its deadline) is
dropped. Deadlines are swept by one timer, not one per request. Should the connection to Redis break,
every waiting request is answered UNAVAILABLE at once.

The Dispatcher is here: its requests in (submit), held while their answered clients come back, and
their answers resolved. Its other parts are request_writer.RequestWriter (the pipelines out),
reply_reader.ReplyReader (the reply stream read) and waiters.Waiters (deadlines, answers, cancellation).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import time
import uuid
from collections import defaultdict, deque

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..alarm import Alarm
from ..contract import records
from ..contract.errors import Unavailable
from ..contract.keys import Keys
from ..contract.records import GROUPED, InferRequest
from ..counters import Deferred
from ..logs import Throttled
from ..redis_client import BULK_DEFAULT, bulk_limit
from ..resp import ReadAlong, Resp
from . import grouping
from .reply_reader import ReplyReader
from .request_writer import Bound, RequestWriter
from .waiters import SWEEP_S, Callback

log = logging.getLogger("despina.gateway")

OWED_S = 0.004  # answers delivered this recently are expected back as new requests (see Dispatcher.submit);
# a hold ends at the first request after it, whatever hold_us says
# a hold ends when no request came for the gap: the answered clients are not coming. HOLD_GAP_S; for
# the answered clients of at most FEW_CLIENTS answers, a gap that follows their pace (Dispatcher.
# _adapt_gap), up to MAX_HOLD_GAP_S. Many clients' requests come continuously: any request soon after a
# hold ended would read as one of theirs, and the gap would grow for nothing
HOLD_GAP_S = 0.0002
MAX_HOLD_GAP_S = 0.001
FEW_CLIENTS = 16


class Dispatcher(RequestWriter, ReplyReader):
    def __init__(self, redis: aioredis.Redis, keys: Keys, gateway_id: str | None = None,
                 reply_ttl_ms: int = 120_000, hold_us: int = 4000) -> None:
        # requests go out on one lean connection; the reply stream is read, blocking, on another
        self._out, self._in = Resp.like(redis), Resp.like(redis)
        self._redis = redis
        self.bulk_limit = BULK_DEFAULT  # the most bytes of one request entry (Redis's, once started)
        self.keys = keys
        self.reply_ttl_ms = reply_ttl_ms
        self.dropped = 0  # replies nobody waited for: duplicates, or past their deadline
        self._counts = Deferred(redis)  # what the gateway counts itself (count)
        self.id = gateway_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.reply_stream = keys.reply_stream(self.id)
        self._ids = itertools.count()
        # request id -> (its callback, its deadline on the monotonic clock, its model version's
        # statistics hash); in insertion order, which is deadline order for requests that wait the
        # gateway's whole timeout. One submitted with less time left (woken from scale-to-zero, an
        # ensemble's later step) goes on `_early` too, a heap by deadline, so that the sweep finds it
        self._waiting: dict[str, tuple[Callback, float, str]] = {}
        self._early: list[tuple[float, str]] = []
        self._latest = 0.0  # the latest deadline submitted
        # statistics hash (a model version) -> its requests waiting here: each entry tells the worker
        # how many, so that a batch need not wait for requests that are not on their way
        self._in_flight: dict[str, int] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._write_failed, self._read_failed = Throttled(log, logging.ERROR), Throttled(log)
        self._outbox: dict[str, list[InferRequest]] = defaultdict(list)
        self._bounded: list[tuple[str, Bound, InferRequest]] = []
        self._stats: dict[str, str] = {}  # request stream -> its model version's statistics hash
        # request stream -> the most rows its requests may be grouped into (records.GROUPED); 0: never
        self._group_rows: dict[str, int] = {}
        self._flush_scheduled = False
        self._writing = False
        self._reader: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None  # whether Redis kept the gateway's data (_watch)
        self._marked = False
        self._held: set[str] = set()  # requests a worker still holds after Redis lost its data (reply_reader)
        self._lost_at: float | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._telling: list[str] = []  # cancellations for the write on its way (Waiters._tell_cancelled)
        # (when to take it out of the cancelled set, request id), for the ids named there, oldest first
        self._told: deque[tuple[float, str]] = deque()
        self.hold_s = hold_us / 1e6
        # statistics hash -> (answers delivered lately and not yet followed by as many new requests,
        # when the latest went)
        self._owed: dict[str, tuple[int, float]] = {}
        self._holding = False
        self._hold_until = 0.0  # when the current hold ends at the latest
        self._gap_until = 0.0   # when it ends unless another request comes first
        self._gap_s = HOLD_GAP_S  # the gap for a few clients, as their pace taught it
        self._few = False       # whether the current hold waits for a few clients (its gap: _gap_s)
        self._gave_up = 0.0     # when a few clients' hold last ended on its gap, until the next request
        self._alarm: Alarm | None = None  # ends a hold; without one (not Linux) nothing is held
        self._read_along = ReadAlong()  # the reply reader's next read, waiting for the next requests
        self._last_reply = "0-0"  # the reply stream's last entry read
        # request id -> the index of the next response expected, for requests a decoupled model has
        # answered but not finished: a worker that runs the request again after another died sends
        # those before it again
        self._next: dict[str, int] = {}

    def new_id(self) -> str:
        return f"{next(self._ids):x}"

    async def start(self) -> None:
        self.bulk_limit = await bulk_limit(self._redis)
        self._reader = asyncio.create_task(self._read_replies())
        self._watching = asyncio.create_task(self._watch())
        if self.hold_s:
            self._alarm = Alarm.create(self._hold_over)

    async def close(self) -> None:
        if self._holding and not self._flush_scheduled and not self._writing:
            self._flush()  # what was held goes out before the gateway stops
        self._holding = False  # (a spinning hold stops turning)
        if self._alarm is not None:
            self._alarm.close()
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        for task in (self._reader, self._watching):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._fail_waiting(Unavailable("the gateway is shutting down"))
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self._counts.close()
        if self.dropped:
            log.info("gateway %s: dropped %d replies nobody waited for (duplicates, or past their deadline)",
                     self.id, self.dropped)
        try:
            await self._out.execute([["DEL", self.reply_stream], ["DEL", self.keys.gateway_mark(self.id)]])
        except (RedisError, OSError):
            pass
        self._out.close()
        self._in.close()

    def submit(self, stream: str, stats: str, request: InferRequest, timeout: float, done: Callback,
               bound: Bound | None = None, group_rows: int = 0) -> None:
        """Queue the request; `done` gets its reply, or TimeoutError after `timeout` seconds, or the
        error that kept it from being queued.

        `stats` is the model version's statistics hash: it counts what was enqueued (answered minus
        enqueued is what is pending). With a bound, the request is refused (RESOURCE_EXHAUSTED)
        when its queue is full. With `group_rows`, plain requests that go out together go as one request of
        at most that many rows (their model batches them anyway: records.GROUPED), answered as one.

        A request goes out at once, in the next pipeline, except right after answers went out: their
        clients, if they send their next request as soon as they have an answer (a closed loop, as
        perf_analyzer and most batch jobs are), are sending it now, and their requests reach the worker
        in one stream entry if they go together, one read and one batch there instead of one each. So
        while every model version with requests waiting here has had answers delivered within OWED_S
        and not yet as many new requests, they are held: until a request has not been followed by
        another for the gap (HOLD_GAP_S, longer for clients slower to come back), and for at most
        `hold_us`. While every request waiting is one of those held here, the event loop spins until the
        hold ends (_spin) instead of sleeping on the alarm."""
        now = time.monotonic()
        deadline = now + timeout
        self._waiting[request.id] = (done, deadline, stats)
        if deadline < self._latest:
            heapq.heappush(self._early, (deadline, request.id))
        else:
            self._latest = deadline
        self._in_flight[stats] = self._in_flight.get(stats, 0) + 1
        self._stats[stream] = stats
        self._group_rows[stream] = group_rows
        if bound is None:
            self._outbox[stream].append(request)
        else:
            self._bounded.append((stream, bound, request))
        owed = self._owed.get(stats)
        if self._gave_up:
            self._adapt_gap(now, owed is not None and now - owed[1] <= OWED_S)
        if owed is not None:  # one of the answers' clients, it seems, is back
            if owed[0] > 1 and now - owed[1] <= OWED_S:
                self._owed[stats] = (owed[0] - 1, owed[1])
            else:
                del self._owed[stats]
        if self._holding:
            if not self._expecting(now):
                self._release()
            else:  # still coming back: wait for the next one (the alarm looks again when it fires)
                self._gap_until = now + (self._gap_s if self._few else HOLD_GAP_S)
        elif not self._flush_scheduled and not self._writing:
            if self._alarm is not None and self._expecting(now):
                self._holding = True
                self._hold_until = now + self.hold_s
                self._few = owed is not None and owed[0] <= FEW_CLIENTS
                self._gap_until = now + (self._gap_s if self._few else HOLD_GAP_S)
                if len(self._waiting) == sum(map(len, self._outbox.values())) + len(self._bounded):
                    asyncio.get_running_loop().call_soon(self._spin)
                else:
                    self._alarm.arm(min(self._hold_until, self._gap_until))
            else:
                self._release()
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _expecting(self, now: float) -> bool:
        """Whether every model version with requests waiting to go out has answers out lately that no new
        request has followed yet."""
        if not self._owed:
            return False  # the usual case: no answers out lately that nobody has followed
        stats = self._stats
        waiting = {stats[s] for s in self._outbox}
        waiting.update(stats[s] for s, _, _ in self._bounded)
        for key in waiting:
            owed = self._owed.get(key)
            if owed is None or now - owed[1] > OWED_S:
                return False
        return True

    def _spin(self) -> None:
        """A hold while nothing else is out (no reply can come, the workers wait for these requests): the
        loop runs this again and again, polling its sockets each time, until the hold ends. On a core the
        gateway shares with the worker and Redis nothing else needs the core meanwhile, and each client's
        request is read as it comes without a wake-up of the gateway (on a virtual machine, each costs
        tens of microseconds: 3.1-3.3 wake-ups per batch at c=8 slept, 1.3-1.4 spun)."""
        if not self._holding:
            return
        now = time.monotonic()
        if now < min(self._hold_until, self._gap_until):
            asyncio.get_running_loop().call_soon(self._spin)
            return
        self._hold_ends(now)

    def _hold_over(self) -> None:
        """The alarm: a hold ends unless a request came less than the gap ago, and then it looks again
        when that gap would end. Arming a timer a fraction of a millisecond ahead costs ~8 µs on a
        virtual machine (the CPU's timer is reprogrammed through the hypervisor), so it is not moved
        for every request of a convoy."""
        if not self._holding:
            return
        end = min(self._hold_until, self._gap_until)
        now = time.monotonic()
        if now < end:
            self._alarm.arm(end)  # type: ignore[union-attr]  # the alarm is who calls this
            return
        self._hold_ends(now)

    def _hold_ends(self, now: float) -> None:
        if self._few and self._gap_until <= self._hold_until:
            self._gave_up = now  # on a few clients' gap: the next request tells whether too soon
        self._release()

    def _adapt_gap(self, now: float, returning: bool) -> None:
        """The first request after a few clients' hold ended on its gap: one of theirs, within another
        gap, says the gap was too short for these clients (a Python client sends its next requests
        100-300 µs apart, where perf_analyzer's come within tens); the gap grows by half, to at most
        MAX_HOLD_GAP_S. Any other says it was long enough: it shrinks by a tenth, to HOLD_GAP_S at the
        least, so that clients that do not come back are not waited for longer than that for long."""
        if returning and now - self._gave_up < self._gap_s:
            self._gap_s = min(max(MAX_HOLD_GAP_S, HOLD_GAP_S), self._gap_s * 1.5)
        else:
            self._gap_s = max(HOLD_GAP_S, self._gap_s * 0.9)
        self._gave_up = 0.0

    def _release(self) -> None:
        """End a hold (or there was none): what waits goes out in the next pipeline."""
        self._holding = False
        if not self._flush_scheduled and not self._writing and (self._outbox or self._bounded):
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def refused(self, stats: str) -> None:
        """Count a request refused before it was queued (Triton's REJECTED)."""
        self.count(stats, {"fail_count": 1, "fail:REJECTED": 1, "refused": 1})

    def count(self, stats: str, counts: dict[str, int]) -> None:
        """Add to a statistics hash's counters (last_inference, in ms, is set): what the gateway itself
        counts. The sums ride along with the next requests' pipeline, or go alone after DEFER_S: no
        round trip of their own while requests flow."""
        self._counts.add(stats, counts)

    def _resolve(self, payload: bytes) -> None:
        try:
            replies = records.decode_replies(payload)
        except Exception as exc:
            log.error("gateway %s: undecodable reply entry: %s", self.id, exc)
            return
        delivered: dict[str, int] = {}
        if any(r.id[:1] == GROUPED for r in replies):
            replies = [one for r in replies
                       for one in (grouping.ungrouped(r) if r.id[:1] == GROUPED else (r,))]
        for reply in replies:
            if not reply.final:
                self._partial(reply)
                continue
            stats = self._finish(reply.id, reply)
            if stats is None:
                self.dropped += 1
            else:
                delivered[stats] = delivered.get(stats, 0) + 1
        if self._alarm is not None and delivered:
            now = time.monotonic()
            for key, n in delivered.items():
                owed = self._owed.get(key)
                self._owed[key] = (n + (owed[0] if owed and now - owed[1] <= OWED_S else 0), now)
