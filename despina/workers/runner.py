"""One model version on one worker: read its stream, batch, execute, reply, then acknowledge.

The runner is one object in three modules: this one holds its state, its life (load, start, stop), its
read loop and the execution of a batch; intake.py takes requests in (from the stream, or made in this
process) and outbox.py sends the replies and acknowledgements.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import clock
from ..contract.errors import Code
from ..contract.keys import Keys
from ..contract.modelspec import ModelSpec
from ..counters import Deferred
from ..logs import Throttled
from ..resp import Batch, ReadAlong
from ..response_cache import LOADS, ResponseCache
from ..summaries import LatencyWindow
from . import answers
from .batcher import DynamicBatcher, Item
from .execution import Execution, durations
from .inflight import Gateways
from .intake import TIMED_OUT, Answer, Intake, Pending, Settled
from .ordering import ReplyOrder, Turn
from .rate_limiter import RateLimiter
from .redelivery import DeliveryPolicy
from .replies import ReplyWriter
from .sequences import SequenceBatcher
from .streams import Entry, ModelStreams

if TYPE_CHECKING:
    from collections import deque

    from .bls import ModelCaller
    from .outbox import Held
    from .sweep import PendingSweep

__all__ = ["READ_WAITS_S", "TIMED_OUT", "ModelRunner", "Pending", "Settled"]

log = logging.getLogger("despina.worker")

# The longest a read waits to go out with replies (_read_with_replies of ModelRunner and EnsembleHost):
# a safety net, every batch that does not reply to Redis lets it go at once.
READ_WAITS_S = 0.01
# The longest the start of a batch waits to leave its levels' queued counters (queued.py) with the replies of
# a batch before it, or its own: a batch that took longer has its own write.
MOVES_WAIT_S = 0.001
STREAMS_END_S = 10.0  # how long an unload waits for a decoupled model's open requests to end (then they fail)


class ModelRunner(Intake):
    def __init__(self, redis: aioredis.Redis, keys: Keys, spec: ModelSpec, version: int, path: Path,
                 consumer: str, threads: int = 1, read_ahead: int | None = None,
                 delivery: DeliveryPolicy | None = None, deferred: Deferred | None = None,
                 full_queue_delay: bool = False, caller: ModelCaller | None = None,
                 response_cache: ResponseCache | None = None, sweep: PendingSweep | None = None,
                 summaries: bool = False, rate_limiter: RateLimiter | None = None) -> None:
        self.redis, self.keys, self.spec, self.version = redis, keys, spec, version
        self.sweep = sweep  # the worker's, which redelivers its streams' abandoned entries (sweep.py)
        # the worker's response cache, for requests made in this process (response_cache.py)
        use_cache = response_cache is not None and spec.response_cache and spec.sequence is None
        self.response_cache = response_cache if use_cache else None
        self._load_id = f"load-{next(LOADS)}"  # its answers are its files': another load keys its own
        self.deferred = deferred  # the worker's: counters that need no round trip of their own
        self.delivery = delivery or DeliveryPolicy()
        self.path = path
        self.streams = ModelStreams(redis, keys, spec.name, version, spec.policy.priority_levels, consumer)
        self.stats_key = keys.stats(spec.name, version)
        self.consumer = consumer
        self._read_along = ReadAlong()  # the read loop's next read, waiting for a batch's replies
        # replies, statistics and acknowledgements go out here (outbox.py)
        self.writer = ReplyWriter("model", redis, keys, spec, version, self.streams,
                                  self.delivery.reply_ttl_ms, deferred, self._read_along)
        # its instances, and how a batch runs on them
        self.execution = Execution(spec, path, version, threads, caller,
                                   lambda s, r, p: self._spawn(self._send_response(s, r, p)),
                                   lambda s, r, p: self._spawn(self._finish_response(s, r, p)),
                                   self._read_along.release, rate_limiter, lambda: self.batcher.pending > 0)
        batch_io = self.execution.batch_io
        self._ragged = batch_io.ragged if batch_io is not None else frozenset()
        # requests in batches being executed: Triton's pending count leaves them out (metrics.py),
        # and only this worker knows of them (its heartbeat tells)
        self.executing = 0
        # its requests' recent latencies, for Triton's latency summaries (summaries.py); None: not asked for
        self.summary = LatencyWindow() if summaries else None
        self._text: frozenset[str] = frozenset()  # BYTES inputs checked per request (_accept), from load()
        count = self.execution.count
        # with full_queue_delay a batch waits out its delay even when no other request can join it
        self._coming = None if full_queue_delay else self._nothing_coming
        self.batcher = self._batcher(count)
        limit = max(spec.max_batch_size, 1) * count * 4
        self._asked_read_ahead = read_ahead
        self._read_ahead = read_ahead or max(limit, 64)
        self._entries: dict[tuple[str, bytes], int] = {}  # stream entry -> requests not yet answered
        # id() of a submitted request -> where its reply goes, and who says whether more may come
        self._local: dict[int, tuple[Answer, Settled | None]] = {}
        self._gateways = Gateways()  # what each gateway has in flight: is anything still coming?
        self._in_flight = 0
        self._room = asyncio.Event()
        self._room.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._held: dict[int, deque[Held]] = {}  # a decoupled model's responses Redis refused (outbox)
        self._stopping = False
        self._moves_due = False  # a write of the queued counters' moves is due (_write_moves)
        self._moves_write: asyncio.Task[None] | None = None  # the latest such write
        self._order = ReplyOrder() if spec.policy.preserve_ordering else None
        self.state = "LOADING"

    # -- lifecycle -------------------------------------------------------------------------------

    async def load(self) -> None:
        """Load every instance of the instance groups, then run the warmup samples on each."""
        count = self.execution.count
        await self.execution.load()
        self._text = self.execution.text
        if self.execution.count != count:  # e.g. KIND_GPU without `gpus`: count on every GPU
            self.batcher = self._batcher(self.execution.count)

    @property
    def resizable(self) -> bool:
        """Whether its instances can be added or removed in place (resize): a stateful model's sequences
        keep to their instance, and it loads anew instead."""
        return self.state == "READY" and isinstance(self.batcher, DynamicBatcher)

    async def resize(self, spec: ModelSpec) -> None:
        """Triton's in-place instance update to `spec`'s instance groups (Execution.resize)."""
        await self.execution.resize(spec, self._resized)
        self.spec = spec

    def _resized(self, count: int) -> None:
        cast(DynamicBatcher, self.batcher).resize(count)
        self._read_ahead = self._asked_read_ahead or max(max(self.spec.max_batch_size, 1) * count * 4, 64)

    async def start(self) -> None:
        await self.streams.ensure_groups()
        await self.writer.start()
        self.state = "READY"
        self._tasks = [asyncio.create_task(self.batcher.run()), asyncio.create_task(self._read_loop())]
        if self.sweep is not None:
            self.sweep.add(self.streams, self.delivery, f"model {self.spec.name}")

    async def stop(self) -> None:
        """Stop reading, finish what was read (reply and acknowledge it), then unload."""
        self._stopping = True
        self.state = "UNLOADING"
        if self.sweep is not None:
            self.sweep.discard(self.streams)
        reader = self._tasks[1] if self._tasks else None
        if reader:
            # The read in flight is ended (or ends within its block), and what it brings is this
            # runner's to answer: Redis has delivered it to this consumer. Cancelled, the read would
            # leave such requests pending until the visibility timeout (a reload's first request
            # waited a minute). A reader waiting for room is cancelled: it has nothing in flight.
            self._room.set()
            await self.streams.end_read(reader)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self.batcher.close()
        if self._tasks:
            await asyncio.gather(self._tasks[0], return_exceptions=True)
        for _ in range(int(STREAMS_END_S / 0.05)):  # a decoupled model's requests still streaming
            if not self.execution.streams:
                break
            await asyncio.sleep(0.05)
        while self._background:  # replies still being written
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.execution.unload()
        self.streams.close()
        await self.streams.leave()
        self.writer.close()
        self.state = "UNAVAILABLE"

    def in_hand(self) -> Iterator[tuple[str, str]]:
        """(reply stream, request id) of each gateway's request read here and not yet run to its end:
        queued, or in a batch executing. (Those whose replies are being written are not: the write
        either reached Redis before it lost its data, and went with it, or reaches it after.)"""
        for item in self.batcher.in_hand():
            p: Pending = item.payload
            if p.entry is not None:
                yield p.request.reply_to, p.request.id

    def custom_metrics(self) -> list[dict[str, Any]]:
        """The metric families its model made itself, from every instance (custom_metrics.py)."""
        return [family for backend in self.execution.backends for family in backend.custom_metrics()]

    # -- reading ---------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        failed = Throttled(log)
        while not self._stopping:
            await self._room.wait()
            if self._stopping:
                break
            try:
                entries = await self._read()
            except (RedisError, OSError) as exc:
                failed.log("model %s: reading its stream failed (%s); retrying", self.spec.name, exc)
                await asyncio.sleep(0.5)
                continue
            if entries:
                await self._accept(entries)
            del entries  # not held while the next read waits (which may be long): large requests

    async def _read(self) -> list[Entry]:
        sent = await self._read_with_replies()
        if sent is None:
            return await self.streams.read(self._room_entries(self._in_flight), self.streams.block_ms)
        return await self.streams.sent_read(sent)

    async def _read_with_replies(self) -> asyncio.Future[Any] | None:
        """When all that was read is in the batch now running on the event loop, nothing read now could
        join a batch before that one is done: the next read then goes out with its replies (_send), in
        one write, instead of a round trip to Redis of its own (on a shared core, each wakes Redis and
        hands it the core). The read as sent, or None: read now."""
        if not self.streams.can_send_with or self.execution.count != 1 or self.spec.decoupled:
            return None  # (a decoupled model's replies go out in the order it sent them: one connection)
        await asyncio.sleep(0)  # the batcher's turn: it takes what was just accepted
        if self.batcher.pending or not self.batcher.executing:
            return None
        return await self._read_along.wait(READ_WAITS_S)

    # -- executing -------------------------------------------------------------------------------

    def _batcher(self, instances: int) -> DynamicBatcher | SequenceBatcher:
        if self.spec.sequence is not None:  # a stateful model: Triton's sequence batcher
            return SequenceBatcher(self.spec, self._execute, instances, self._on_timeout, self.path)
        return DynamicBatcher(self.spec.policy, self._execute, instances, self._on_queue_timeout,
                              self._coming)

    async def _execute(self, batch: list[Item], instance: int | None = None) -> None:
        turn = self._order.take() if self._order is not None else None  # before any await (ordering.py)
        taken = sum(item.payload.members for item in batch)
        self.executing += taken
        if self.writer.moves is not None:  # out of the queue: Triton's max_queue_size leaves them out
            self.writer.moves.start(item.payload for item in batch)
            if not self._moves_due:
                self._moves_due = True
                asyncio.get_running_loop().call_later(MOVES_WAIT_S, self._write_moves)
        try:
            await self._run_and_reply(batch, instance, turn)
        except BaseException:  # its replies will not go out: the batches after it must not wait for them
            if turn is not None:
                turn.end()
            raise
        finally:
            self.executing -= taken

    def _write_moves(self) -> None:
        """The queued counters' moves that no pipeline took within MOVES_WAIT_S, in a write of their own."""
        self._moves_due = False
        moves = self.writer.moves
        if moves:
            assert moves is not None
            pipe = Batch()
            moves.into(pipe, self.writer.moves_script)
            # the replies of a batch whose start this took go after it (Outbox._reply): on uvloop this
            # timer runs before the replies' task that a batch run inline made ready, and their SREM ran
            # before this SADD, leaving the entries in the executing set for good
            self._moves_write = self._task(self._send_moves(pipe))

    async def _send_moves(self, pipe: Batch) -> None:
        try:
            await self.writer.resp().execute(pipe.commands)
        except Exception as exc:  # its requests stay counted (and unmarked: a redelivery leaves them so)
            log.error("model %s: counting a batch out of the queue failed: %s", self.spec.name, exc)

    async def _run_and_reply(self, batch: list[Item], instance: int | None, turn: Turn | None) -> None:
        pendings: list[Pending] = [item.payload for item in batch]
        started = clock.now()
        live_items = [item for item in batch if item.payload.request.deadline >= started]
        live: list[Pending] = [item.payload for item in live_items]
        expired = [p for p in pendings if p.request.deadline < started] if len(live) < len(batch) else []
        replies = [answers.error(p.request, Code.DEADLINE_EXCEEDED, TIMED_OUT) for p in expired]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("batch formed", extra={"fields": {
                "model": self.spec.name, "version": self.version, "requests": len(pendings),
                "rows": sum(item.rows for item in batch),
                "queue_us": [int((started - p.request.enqueued) * 1e6) for p in pendings],
                # of which in transit: from the gateway's enqueue until this worker read it
                "transit_us": [int((p.received - p.request.enqueued) * 1e6) for p in pendings],
                "request_ids": [p.request.trace or p.request.id for p in pendings]}})
        marks: dict[str, int] = {"start": time.perf_counter_ns()}
        if any(p.alone for p in live):
            if self.writer.moves:  # counted out (and marked) before it runs: a death finds both or neither
                moves = Batch()
                self.writer.moves.into(moves, self.writer.moves_script)
                await self._send_moves(moves)
            await self.streams.mark_executing([p.entry for p in live if p.entry is not None])
        sizes = [item.rows for item in live_items]  # rows per request
        if self.spec.decoupled and live:
            if expired:
                self._spawn(self._reply(replies, [p.request for p in expired], expired))
            failed = await self.execution.run_streams(live, started, marks)
            inferred = sum(sizes) - sum(sizes[i] for i in failed)  # a request execute failed infers nothing
            self._spawn(self._reply([], [], [], rows=sum(sizes), started=started,  # the execution's counters
                                    timings=durations(marks, time.perf_counter_ns()),
                                    later=len(live) - len(failed), inferred=inferred))
            return
        if live:
            keep, nulls = None, None
            if self.spec.sequence is not None:
                sequences = cast(SequenceBatcher, self.batcher)
                keep = sequences.keep if self.execution.state_outputs else None
                nulls = sequences.nulls(live_items)
            replies.extend(await self.execution.run_batch(live, sizes, started, marks, instance, keep,
                                                          nulls or ()))
        rows = sum(sizes)
        # the instance is free as soon as the model ran: replies go out in the background
        reply = self._reply(replies, [p.request for p in expired + live], pendings, rows=rows if live else 0,
                            started=started, timings=durations(marks, time.perf_counter_ns()))
        self._spawn(reply if turn is None else turn.send(reply))
