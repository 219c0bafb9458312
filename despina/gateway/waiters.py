"""The requests a gateway waits on (Dispatcher's part): their deadlines, their answers, and their
cancellation.

Each waits, by id, for its callback to be called once. Deadlines are swept by one timer, not one per
request; a request cancelled, or past its deadline, while a decoupled model streams its answers is named
to the model's worker, which stops sending them.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable

import redis.asyncio as aioredis

from ..contract.errors import Cancelled, Unavailable
from ..contract.keys import Keys
from ..contract.records import InferReply
from ..redis_client import allow_oom
from ..resp import Resp

log = logging.getLogger("despina.gateway")

Result = InferReply | BaseException
# called once with the reply, TimeoutError, or the error that stopped it; before that, a decoupled
# model's responses to it that are not its last (InferReply.final False), in order, each once
Callback = Callable[[Result], None]
SWEEP_S = 0.05  # how often deadlines are looked at: a late answer is late by at most this much
# Name cancelled requests to the workers that run them (they ask with each response a decoupled model
# sends), also while Redis is full (allow_oom: a few bytes that end work). KEYS: the set; ARGV: TTL ms, n,
# the n ids to name, then the ids named a TTL ago or more, to take out: the set's TTL, renewed by every
# cancellation, never ran out while clients kept going away, and the set kept every id named in it.
TELL_CANCELLED = """
local n = tonumber(ARGV[2])
for i = 3, 2 + n do redis.call('SADD', KEYS[1], ARGV[i]) end
for i = 3 + n, #ARGV do redis.call('SREM', KEYS[1], ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


class Waiters:
    """The Dispatcher's requests waiting for an answer. Its attributes are the Dispatcher's, set in
    Dispatcher.__init__."""

    id: str
    keys: Keys
    reply_stream: str
    reply_ttl_ms: int
    dropped: int
    _redis: aioredis.Redis
    _out: Resp
    _waiting: dict[str, tuple[Callback, float, str]]
    _early: list[tuple[float, str]]
    _in_flight: dict[str, int]
    _next: dict[str, int]
    _sweeper: asyncio.TimerHandle | None
    _writes: set[asyncio.Task[None]]
    _telling: list[str]
    _told: deque[tuple[float, str]]

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _sweep(self) -> None:
        self._sweeper = None
        now = time.monotonic()
        expired = []
        for request_id, (_, deadline, _) in self._waiting.items():
            if deadline > now:
                break
            expired.append(request_id)
        early = self._early
        if early and early[0][0] <= now:
            swept = set(expired)
            while early and early[0][0] <= now:
                request_id = heapq.heappop(early)[1]
                if request_id in self._waiting and request_id not in swept:
                    expired.append(request_id)
        streaming = [r for r in expired if r in self._next]  # a decoupled model's: its worker hears of it
        for request_id in expired:
            self._finish(request_id, TimeoutError())
        if streaming:
            self._tell_cancelled(streaming)
        if self._waiting:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)
        else:
            early.clear()  # answered before their deadlines

    def _finish(self, request_id: str, result: Result) -> str | None:
        """Hand the request its result; its model version's statistics hash, or None when nobody waits
        for it any more."""
        waiter = self._waiting.pop(request_id, None)
        if waiter is None:
            return None
        if self._next:
            self._next.pop(request_id, None)
        left = self._in_flight[waiter[2]] - 1
        if left:
            self._in_flight[waiter[2]] = left
        else:
            del self._in_flight[waiter[2]]
        try:
            waiter[0](result)
        except Exception:  # a callback's fault must not stop the reply reader
            log.exception("gateway %s: answering request %s failed", self.id, request_id)
        return waiter[2]

    def give_up(self) -> None:
        """The drain's time is nearly spent: every request still waiting is answered 503 (with Retry-After:
        another gateway may answer it) rather than left to a connection cut at the end."""
        if self._waiting:
            log.warning("gateway %s: %d request(s) still without an answer as the drain ends: answered 503",
                        self.id, len(self._waiting))
            self._fail_waiting(Unavailable("the server is stopping, and no answer came within its drain time "
                                           "(DESPINA_DRAIN_TIMEOUT_S)"))

    def _fail_waiting(self, error: Exception) -> None:
        for request_id in list(self._waiting):
            self._finish(request_id, error)

    def cancel(self, request_id: str, reason: str = "the client went away") -> None:
        """The request's client went away (or, `reason`, gave it up): stop waiting for it, and tell a
        decoupled model that runs it (its worker asks with each response it sends, and the model sees
        request.is_cancelled())."""
        if self._finish(request_id, Cancelled(reason)) is not None:
            self._tell_cancelled([request_id])

    def _tell_cancelled(self, request_ids: list[str]) -> None:
        if not self._telling:  # else the write on its way takes these too
            task = asyncio.create_task(self._write_cancelled())
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
        self._telling.extend(request_ids)

    async def _write_cancelled(self) -> None:
        """Name the cancellations waiting in the set, in one write, and take out the ids named a reply TTL
        ago or more: as long as an id lived there before, when the set expired a TTL after its last
        cancellation. (A write each, a burst of them as the gateway started asked Redis for allow_oom once
        each, past the client's connection limit: "Too many connections", and the last went unnamed.)"""
        try:
            script: str | None = await allow_oom(self._redis, TELL_CANCELLED)
        except Exception as exc:  # best effort: the model finishes the request, its answer is dropped
            script = None
            log.debug("gateway %s: writing its cancellations failed: %s", self.id, exc)
        request_ids, self._telling = self._telling, []
        if script is None:
            return
        now, told, gone = time.monotonic(), self._told, []
        while told and told[0][0] <= now:
            gone.append(told.popleft()[1])
        told.extend((now + self.reply_ttl_ms / 1000, request_id) for request_id in request_ids)
        try:
            await self._out.execute([["EVAL", script, 1, self.keys.cancelled(self.reply_stream),
                                      self.reply_ttl_ms, len(request_ids), *request_ids, *gone]])
        except Exception as exc:
            log.debug("gateway %s: writing its cancellations failed: %s", self.id, exc)

    def _partial(self, reply: InferReply) -> None:
        """A decoupled model's response that is not its last: to the waiting request, unless it had it."""
        waiter = self._waiting.get(reply.id)
        if waiter is None or reply.index < self._next.get(reply.id, 0):
            self.dropped += 1
            return
        self._next[reply.id] = reply.index + 1
        try:
            waiter[0](reply)
        except Exception:
            log.exception("gateway %s: passing on a response of request %s failed", self.id, reply.id)
