"""A model runner's way out (part of ModelRunner, runner.py): a batch's replies, one entry per gateway,
its statistics and queue counters, and the acknowledgement of the stream entries they answer, in one
round trip (the next read riding along where it may); a decoupled model's responses before its last, and
those Redis refused written again in order, the request's later responses held behind them."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import hiredis
from redis.exceptions import RedisError

from .. import clock, summaries
from ..contract.keys import ENTRY_REQUESTS, GROUP, Keys
from ..contract.modelspec import ModelSpec
from ..contract.records import InferReply, InferRequest, requests_in
from ..counters import Deferred
from ..resp import Batch, Command, ReadAlong
from . import stats
from .batcher import DynamicBatcher
from .execution import Execution
from .inflight import Gateways
from .replies import RESEND_S, ReplyWriter
from .sequences import SequenceBatcher
from .streams import ModelStreams

if TYPE_CHECKING:
    from .intake import Answer, Pending, Settled

log = logging.getLogger("despina.worker")

# What waits its turn behind a decoupled model's response that Redis refused: a response's commands, how
# many reply entries (XADD, PEXPIRE) begin them and its stream id (their last but one answer says whether
# it was cancelled), or None for a final reply's entries refused; or the final reply's whole round trip.
Held = tuple[list[Command], int, int | None] | Coroutine[Any, Any, None]


class Outbox:
    """ModelRunner's reply path. The state it uses is ModelRunner's (set in its __init__)."""

    keys: Keys
    spec: ModelSpec
    consumer: str
    deferred: Deferred | None
    stats_key: str
    summary: summaries.LatencyWindow | None
    streams: ModelStreams
    execution: Execution
    batcher: DynamicBatcher | SequenceBatcher
    writer: ReplyWriter
    _read_along: ReadAlong
    _read_ahead: int
    _entries: dict[tuple[str, bytes], int]
    _local: dict[int, tuple[Answer, Settled | None]]
    _gateways: Gateways
    _in_flight: int
    _room: asyncio.Event
    _background: set[asyncio.Task[None]]
    _moves_write: asyncio.Task[None] | None  # ModelRunner._write_moves's latest write of queued counters
    _held: dict[int, deque[Held]]  # id() of a request -> its responses written again, those behind them

    def _spawn(self, coroutine: Any) -> None:
        self._task(coroutine)

    def _task(self, coroutine: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _room_entries(self, in_flight: int) -> int:
        # an entry holds up to ENTRY_REQUESTS requests: read no further past the read-ahead
        return max(1, (self._read_ahead - in_flight) // ENTRY_REQUESTS)

    async def _send_response(self, stream: int, reply: InferReply, p: Pending) -> None:
        """A decoupled model's response before its last one, alone to its gateway. The same round trip
        asks whether the request's client went away (then the model is told), and keeps its stream entry
        from looking abandoned (its idle time starts again): a long stream is not redelivered. A request
        made in this process (a model's exec(decoupled=True), workers/bls.py) gets it on the loop.
        One Redis refuses (at its maxmemory) is written again (_hold), the request's later ones after it."""
        if p.entry is None:
            local = self._local.get(id(p.request))
            if local is not None and local[0](reply):
                self.execution.streams.cancel(stream)
            return
        pipe, entries = self.writer.begin({p.request.reply_to: [reply]})
        pipe.commands.append(["SISMEMBER", self.keys.cancelled(p.request.reply_to), p.request.id])
        pipe.commands.append(["XCLAIM", p.entry[0], GROUP, self.consumer, 0, p.entry[1], "JUSTID"])
        held = self._held.get(id(p.request)) if self._held else None
        if held is not None:  # one before it is being written again: it goes after that one
            held.append((pipe.commands, entries, stream))
            return
        try:
            results = await self.writer.resp().execute(pipe.commands, errors=False)
        except Exception as exc:  # the final reply's pipeline tells of it again, or the entry is reclaimed
            log.error("model %s: writing a response failed: %s", self.spec.name, exc)
            return
        if results[-2] == 1:
            self.execution.streams.cancel(stream)
        if self.writer.refused(pipe, results, entries, 1):
            self._hold(p.request, (pipe.commands, entries, stream))

    async def _finish_response(self, stream: int, reply: InferReply, p: Pending) -> None:
        """A decoupled model's last response: replied at once, or after the request's responses still being
        written again (a gateway drops a response that comes after a later one). A task as each response
        before it is, so that it looks for those in the order they came."""
        held = self._held.get(id(p.request)) if self._held else None
        if held is None:
            await self._reply([reply], [p.request], [p])
        else:
            held.append(self._reply([reply], [p.request], [p]))

    def _hold(self, request: InferRequest, refused_one: Held) -> None:
        """A response of `request` that Redis refused: written again, and the request's later ones held
        behind it, until Redis takes them or the request's deadline passes (_write_held)."""
        held = self._held.get(id(request))
        if held is not None:  # one before it, its pipeline sent before that one was answered, was refused too
            held.append(refused_one)
            return
        self._held[id(request)] = deque([refused_one])
        self._spawn(self._write_held(id(request), request.deadline))

    async def _write_held(self, key: int, until: float) -> None:
        """Write a request's held responses in order, every RESEND_S until Redis takes each, or until the
        request's deadline (`until`: its gateway has answered 504 by then, the rest are dropped); then its
        final reply's round trip, if it came meanwhile, which also acknowledges and counts the request."""
        held = self._held[key]
        try:
            while held and isinstance(held[0], tuple):
                await asyncio.sleep(RESEND_S)
                while held and isinstance(held[0], tuple) and await self._written(*held[0]):
                    held.popleft()
                if held and isinstance(held[0], tuple) and clock.now() >= until:
                    log.error("model %s: %d responses Redis refused were not written by their request's "
                              "deadline", self.spec.name, sum(isinstance(h, tuple) for h in held))
                    break
        finally:
            del self._held[key]
        for item in held:  # the final reply (the responses left were dropped at the deadline)
            if not isinstance(item, tuple):
                await item

    async def _written(self, commands: list[Command], entries: int, stream: int | None) -> bool:
        """Whether Redis took the reply entries of a held response (told, meanwhile, if it was cancelled)."""
        try:
            results = await self.writer.resp().execute(commands, errors=False)
        except (RedisError, OSError):
            return False
        if any(isinstance(results[i], hiredis.ReplyError) for i in range(0, 2 * entries, 2)):
            return False
        if stream is not None and results[-2] == 1:
            self.execution.streams.cancel(stream)
        return True

    async def _reply(self, replies: list[InferReply], requests: list[InferRequest],
                     pendings: list[Pending], rows: int = 0, started: float = 0.0,
                     timings: tuple[int, int, int] = (0, 0, 0), later: int = 0, ran: bool = True,
                     counted: bool = True, inferred: int | None = None) -> None:
        """One round trip: a reply entry per gateway, statistics, queue counters, and the
        acknowledgement of every stream entry now fully answered (after its replies, in order).
        replies[i] answers requests[i]: ids are unique per gateway only, so a batch may hold two alike.
        `ran` False: the requests never were in a batch (answered from the queue), so still counted queued.
        `counted` False: refusals of requests never queued, which the statistics do not count (the
        gateway's `enqueued` count is taken back instead, so that they were never pending). `inferred`: as
        stats.tally's."""
        by_gateway: dict[str, list[InferReply]] = {}
        split = timings if rows else None  # the batch's compute input, infer and output, when it ran
        for r, req in zip(replies, requests, strict=True):
            if req.reply_to:
                if req.timed:  # (all that another request pays for it: this test)
                    r.split = split
                by_gateway.setdefault(req.reply_to, []).append(r)
                continue
            r.split = split  # an ensemble's step: its compute is its ensemble's too
            answer = self._local.pop(id(req))[0]
            try:
                answer(r)
            except Exception:
                log.exception("model %s: answering a request made in this worker failed", self.spec.name)
        # Nothing else to run, and every gateway's requests here: the client of these replies may look
        # at the statistics next, so they go now. Otherwise more batches follow, and their counters
        # go together (counters.Deferred), one statistics update for several batches.
        quiet = not self.batcher.pending and not self.batcher.executing and self._gateways.all_here()
        done = []
        answered = 0  # requests: a grouped one counts as all it holds
        closed: dict[str, int] = {}  # gateway -> its requests answered here, told to _gateways once
        unanswered = self._entries
        for p in pendings:
            answered += p.members
            entry = p.entry
            if entry is None:
                continue
            gateway = p.request.reply_to
            closed[gateway] = closed.get(gateway, 0) + p.members
            if left := unanswered[entry] - 1:
                unanswered[entry] = left
            else:
                del unanswered[entry]
                done.append(entry)
        for gateway, n in closed.items():
            self._gateways.closed(gateway, n)
        # Triton's Python backend counts an execution whose every request failed; its other backends do not
        if not counted:
            counts = {"enqueued": -sum(requests_in(r.id) for r in replies)}
        else:
            counts = stats.tally(replies, rows, started, timings, later, self.spec.backend == "python",
                                 inferred)
        if self.summary is not None and counted:
            summaries.observe(self.summary, replies, rows, timings, later)
        if self.deferred is not None and not by_gateway and not done:
            # only requests made in this process (an ensemble's steps): nothing to send but counters,
            # which wait for the next pipeline
            self.deferred.add(self.stats_key, counts)
            self._read_along.release()  # nothing goes to Redis for it to ride with
        else:
            if self._moves_write is not None and not self._moves_write.done():
                await asyncio.shield(self._moves_write)  # the starts it took go first (runner._write_moves)
            pipe = Batch()
            if self.writer.moves is not None:
                self.writer.moves.answered(requests, pendings, ran)
            entries = self.writer.build(pipe, by_gateway, counts, done, quiet=quiet)
            if any(p.alone for p in pendings):
                self.streams.unmark_into(pipe, [p.entry for p in pendings if p.alone and p.entry is not None])
            room = self._room_entries(self._in_flight - answered)
            if again := await self.writer.send(pipe, entries, len(replies), room):
                self._write_again(again, requests)
        self._in_flight -= answered
        if self._in_flight < self._read_ahead:
            self._room.set()

    def _write_again(self, again: list[Command], requests: list[InferRequest]) -> None:
        """Reply entries of _reply's pipeline that Redis refused: written again until their deadline."""
        held = self._held.get(id(requests[0])) if self._held and len(requests) == 1 else None
        if held is not None:  # a decoupled model's final reply, sent as a response before it was refused
            held.append((again, len(again) // 2, None))
        else:
            self._spawn(self.writer.write_again(again, max(r.deadline for r in requests)))

    async def _ack(self, entries: list[tuple[str, bytes]]) -> None:
        try:
            await self.streams.ack(entries)
        except (RedisError, OSError) as exc:
            log.error("model %s: acknowledging failed: %s; the entries will be reclaimed",
                      self.spec.name, exc)
