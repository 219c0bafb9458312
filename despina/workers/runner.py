"""One model version on one worker: read its stream, batch, execute, reply, then acknowledge."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..contract import records
from ..contract.errors import Code, DespinaError, Unavailable
from ..contract.keys import ATTEMPTS, ENTRY_REQUESTS, FIELD, GROUP, Keys
from ..contract.modelconfig import ModelSpec
from ..contract.records import NO_PARAMETERS, InferReply, InferRequest, Parameters, Tensor
from ..counters import Deferred, record_counts
from ..logs import Throttled
from ..redis_client import BULK_DEFAULT, allow_oom, bulk_limit
from ..resp import Batch, ReadAlong, Resp
from ..response_cache import LOADS, ResponseCache, cache_key, through
from . import answers, stats
from .backends.base import check_text, request_inputs
from .batcher import DynamicBatcher, Item, QueueFull
from .execution import Execution, durations
from .inflight import Gateways
from .ordering import ReplyOrder, Turn
from .redelivery import DeliveryPolicy
from .replies import DEQUEUED, bounded_levels, count_dequeued, refused, replies_into, write_again
from .sequences import SequenceBatcher
from .streams import Entry, ModelStreams

if TYPE_CHECKING:
    from .bls import ModelCaller
    from .sweep import PendingSweep

log = logging.getLogger("despina.worker")

# The longest a read waits to go out with replies (_read_with_replies of ModelRunner and EnsembleHost):
# a safety net, every batch that does not reply to Redis lets it go at once.
READ_WAITS_S = 0.01
TIMED_OUT = "request timed out in the queue before it could run"
STREAMS_END_S = 10.0  # how long an unload waits for a decoupled model's open requests to end (then they fail)
ENQUEUED_ONE = {"enqueued": 1}  # a request made in this process, queued (Deferred.add never changes it)
# gets a request's reply; a decoupled model's response before its last may answer True: the submitter
# gave the request up (a model's call it cancelled, workers/bls.py), and the model is told
Answer = Callable[[InferReply], "bool | None"]
Settled = Callable[[], bool]  # whether no other request of the submitter's can join a batch now


@dataclass(slots=True)
class Pending:
    """A request inside the batcher, and the stream entry it came in."""

    request: InferRequest
    entry: tuple[str, bytes] | None  # (stream, entry id); None: a step of an ensemble run here (submit)
    inputs: dict[str, np.ndarray]
    alone: bool = False          # redelivered after a worker died with it: runs as a batch of one
    received: float = 0.0        # wall-clock seconds when this worker read it
    members: int = 1             # the requests it answers for (a gateway's grouped ones: records.GROUPED)


class ModelRunner:
    def __init__(self, redis: aioredis.Redis, keys: Keys, spec: ModelSpec, version: int, path: Path,
                 consumer: str, threads: int = 1, read_ahead: int | None = None,
                 delivery: DeliveryPolicy | None = None, deferred: Deferred | None = None,
                 full_queue_delay: bool = False, caller: ModelCaller | None = None,
                 response_cache: ResponseCache | None = None, sweep: PendingSweep | None = None) -> None:
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
        self._bounded = bounded_levels(spec)
        self._dequeued = DEQUEUED  # as allow_oom makes it for this Redis, at start
        self._bulk = BULK_DEFAULT  # the most bytes of one reply entry: this Redis's, at start (bulk_limit)
        self.stats_key = keys.stats(spec.name, version)
        self.consumer = consumer
        self._read_along = ReadAlong()  # the read loop's next read, waiting for a batch's replies
        # its instances, and how a batch runs on them
        self.execution = Execution(spec, path, version, threads, caller,
                                   lambda s, r, p: self._spawn(self._send_response(s, r, p)),
                                   lambda s, r, p: self._spawn(self._reply([r], [p.request], [p])),
                                   self._read_along.release)
        batch_io = self.execution.batch_io
        self._ragged = batch_io.ragged if batch_io is not None else frozenset()
        self._text: frozenset[str] = frozenset()  # BYTES inputs checked per request (_accept), from load()
        count = self.execution.count
        # with full_queue_delay a batch waits out its delay even when no other request can join it
        self._coming = None if full_queue_delay else self._nothing_coming
        self.batcher = self._batcher(count)
        limit = max(spec.max_batch_size, 1) * count * 4
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
        self._stopping = False
        self._order = ReplyOrder() if spec.policy.preserve_ordering else None
        self._out: Resp | None = None        # replies, statistics and acknowledgements go out here
        self.state = "LOADING"

    # -- lifecycle -------------------------------------------------------------------------------

    async def load(self) -> None:
        """Load every instance of the instance groups, then run the warmup samples on each."""
        count = self.execution.count
        await self.execution.load()
        self._text = self.execution.text
        if self.execution.count != count:  # e.g. KIND_GPU without `gpus`: count on every GPU
            self.batcher = self._batcher(self.execution.count)

    async def start(self) -> None:
        await self.streams.ensure_groups()
        if self._bounded:
            self._dequeued = await allow_oom(self.redis, DEQUEUED)
        self._bulk = await bulk_limit(self.redis)
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
        if self._out is not None:
            self._out.close()
        self.state = "UNAVAILABLE"

    def custom_metrics(self) -> list[dict[str, Any]]:
        """The metric families its model made itself, from every instance (custom_metrics.py)."""
        return [family for backend in self.execution.backends for family in backend.custom_metrics()]

    def _cached(self, inputs: list[Tensor], outputs: tuple[str, ...], parameters: Parameters, answer: Answer
                ) -> Answer | None:
        """submit()'s answer from the response cache (then None), or the answer that keeps the reply as
        well (response_cache.py), keyed by this runner's load of the files."""
        assert self.response_cache is not None
        deferred = self.deferred
        key = cache_key(self.spec.name, self.version, self._load_id, inputs, outputs, parameters)
        return through(self.response_cache, key, answer,
                       lambda counts: deferred.add(self.stats_key, counts) if deferred is not None else None,
                       lambda reply: reply.error is None)

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

    def _room_entries(self, in_flight: int) -> int:
        # an entry holds up to ENTRY_REQUESTS requests: read no further past the read-ahead
        return max(1, (self._read_ahead - in_flight) // ENTRY_REQUESTS)

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

    async def _accept(self, entries: list[Entry]) -> None:
        now = time.time()
        failures: list[InferReply] = []
        failed: list[InferRequest] = []  # failures[i] answers failed[i]

        def fail(req: InferRequest, entry: tuple[str, bytes], code: Code, message: str) -> None:
            failures.append(answers.error(req, code, message))
            failed.append(req)
            self._entries[entry] -= 1

        for stream, entry_id, fields in entries:
            entry = (stream, entry_id)
            try:
                reqs = records.decode_requests(fields[FIELD])
                alone = ATTEMPTS in fields  # a suspect of a worker's death: alone, it takes nobody along
            except (KeyError, DespinaError) as exc:
                log.error("model %s: dropping undecodable entry %s: %s", self.spec.name, entry_id, exc)
                await self._ack([entry])
                continue
            self._entries[entry] = len(reqs)
            if reqs:
                self._gateways.announce(reqs[0].reply_to, fields)
            for req in reqs:
                if req.deadline < now:
                    fail(req, entry, Code.DEADLINE_EXCEEDED, TIMED_OUT)
                    continue
                members = records.requests_in(req.id)
                try:
                    inputs = request_inputs(req)
                    if self._text:
                        check_text(inputs, self._text)
                    pending = Pending(req, entry, inputs, alone, now, members)
                    # the queue delay counts from here, as Triton's from its scheduler's queue (time
                    # in the stream is the gateway's and Valkey's work, not a wait for batch-mates);
                    # a queue timeout counts from the gateway's enqueue, the client's clock
                    arrived = time.monotonic()
                    shape = entry if alone else self._shape_key(req)
                    self.batcher.put(Item(self._rows(inputs), shape, pending, arrived,
                                          priority=req.priority, timeout_us=req.timeout_us,
                                          since=arrived - max(0.0, now - req.enqueued)))
                except QueueFull as exc:
                    fail(req, entry, Code.RESOURCE_EXHAUSTED, f"model '{self.spec.name}': {exc}")
                    continue
                except DespinaError as exc:  # its inputs, or the sequence batcher's refusal
                    fail(req, entry, exc.code, exc.message)
                    continue
                except Exception as exc:  # a bug: it fails this request, and the model reads on
                    log.exception("model %s: taking request %s failed", self.spec.name, req.id)
                    fail(req, entry, Code.INTERNAL, f"model '{self.spec.name}': {type(exc).__name__}: {exc}")
                    continue
                self._gateways.opened(req.reply_to, members)
                self._in_flight += members
        if len(self._entries) and self._in_flight >= self._read_ahead:
            self._room.clear()
        if failures:
            await self._reply(failures, failed, [])
        done = [e for e, n in self._entries.items() if n == 0]
        if done:  # entries none of whose requests reached the batcher
            for e in done:
                del self._entries[e]
            await self._ack(done)

    def _nothing_coming(self) -> bool:
        """Whether no request that could join the queued ones is on its way (workers/inflight.py): every
        gateway with a request open here has no more in flight, and whoever submitted the requests made
        in this process vouches for them. A gateway that said nothing (an older one, a redelivered
        entry), a submitter that cannot vouch, or requests other workers hold all mean: wait, as Triton
        does."""
        if not self._gateways and not self._local:
            return False
        for settled in {s for _, s in self._local.values()}:  # one per submitter and model, mostly
            if settled is None or not settled():
                return False
        return self._gateways.all_here()

    def _on_timeout(self, item: Item, why: str = "request timed out in the queue (queue policy timeout)"
                    ) -> None:
        """The batcher dropped a request whose queue timeout passed (REJECT policy), or the sequence
        batcher one whose sequence waited too long for a slot: answer it."""
        p: Pending = item.payload
        reply = answers.error(p.request, Code.DEADLINE_EXCEEDED, f"model '{self.spec.name}': {why}")
        self._spawn(self._reply([reply], [p.request], [p]))

    def _rows(self, inputs: dict[str, np.ndarray]) -> int:
        if not self.spec.batched or not inputs:
            return 1
        return int(next(iter(inputs.values())).shape[0])

    def _shape_key(self, req: InferRequest) -> tuple[Any, ...]:
        if self._ragged:  # a ragged input's shape does not keep a request out of a batch
            return tuple(sorted((t.name, t.datatype, None if t.name in self._ragged else t.shape[1:])
                                for t in req.inputs))
        if len(req.inputs) == 1:
            t = req.inputs[0]
            return ((t.name, t.datatype, t.shape[1:]),)
        return tuple(sorted((t.name, t.datatype, t.shape[1:]) for t in req.inputs))

    def submit(self, inputs: list[Tensor], outputs: tuple[str, ...], deadline: float, answer: Answer,
               priority: int = 0, timeout_us: int = 0, trace: str = "", settled: Settled | None = None,
               parameters: Parameters = NO_PARAMETERS, sequence: tuple[int | str, int] | None = None,
               request_id: str = "") -> None:
        """Queue a request made in this process (an ensemble's step, workers/ensembles.py): batched with
        the stream's requests and counted in the statistics like them; `answer` gets its reply (an error
        reply included), on the event loop, before the batch's replies go out to Redis. `deadline` is
        wall-clock seconds; `settled()` True says the submitter has nothing else on its way here (None:
        unknown, so a batch holding it waits out its delay). `parameters` are for the model (a model
        calling another one passes them, workers/bls.py), as are its `request_id` and, for a stateful one,
        `sequence`."""
        if self.response_cache is not None and sequence is None:
            keeping = self._cached(inputs, outputs, parameters, answer)
            if keeping is None:  # answered from the cache
                return
            answer = keeping
        now = time.time()
        request = InferRequest("", "", deadline, tuple(inputs), outputs, priority, timeout_us, now, trace,
                               parameters, request_id, sequence)
        try:
            if self._stopping:
                raise Unavailable(f"model '{self.spec.name}' version {self.version} is unloading")
            arrays = request_inputs(request)
            pending = Pending(request, None, arrays, received=now)
            self.batcher.put(Item(self._rows(arrays), self._shape_key(request), pending, time.monotonic(),
                                  priority=priority, timeout_us=timeout_us))
        except DespinaError as exc:
            answer(answers.error(request, exc.code, exc.message))
            return
        except QueueFull as exc:
            answer(answers.error(request, Code.RESOURCE_EXHAUSTED, f"model '{self.spec.name}': {exc}"))
            return
        self._local[id(request)] = (answer, settled)
        self._in_flight += 1
        if self.deferred is not None:  # as a gateway counts what it queues (pending: enqueued - answered)
            self.deferred.add(self.stats_key, ENQUEUED_ONE)

    # -- executing -------------------------------------------------------------------------------

    def _batcher(self, instances: int) -> DynamicBatcher | SequenceBatcher:
        if self.spec.sequence is not None:  # a stateful model: Triton's sequence batcher
            return SequenceBatcher(self.spec, self._execute, instances, self._on_timeout, self.path)
        return DynamicBatcher(self.spec.policy, self._execute, instances, self._on_timeout, self._coming)

    async def _execute(self, batch: list[Item], instance: int | None = None) -> None:
        turn = self._order.take() if self._order is not None else None  # before any await (ordering.py)
        try:
            await self._run_and_reply(batch, instance, turn)
        except BaseException:  # its replies will not go out: the batches after it must not wait for them
            if turn is not None:
                turn.end()
            raise

    async def _run_and_reply(self, batch: list[Item], instance: int | None, turn: Turn | None) -> None:
        pendings: list[Pending] = [item.payload for item in batch]
        started = time.time()
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
            await self.streams.mark_executing([p.entry for p in live if p.entry is not None])
        sizes = [item.rows for item in live_items]  # rows per request
        if self.spec.decoupled and live:
            if expired:
                self._spawn(self._reply(replies, [p.request for p in expired], expired))
            await self.execution.run_streams(live, started)
            self._spawn(self._reply([], [], [], rows=sum(sizes), started=started,  # the execution's counters
                                    timings=durations(marks, time.perf_counter_ns())))
            return
        if live:
            keep = cast(SequenceBatcher, self.batcher).keep if self.execution.state_outputs else None
            replies.extend(await self.execution.run_batch(live, sizes, started, marks, instance, keep))
        rows = sum(sizes)
        # the instance is free as soon as the model ran: replies go out in the background
        reply = self._reply(replies, [p.request for p in expired + live], pendings, rows=rows if live else 0,
                            started=started, timings=durations(marks, time.perf_counter_ns()))
        self._spawn(reply if turn is None else turn.send(reply))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_response(self, stream: int, reply: InferReply, p: Pending) -> None:
        """A decoupled model's response before its last one, alone to its gateway. The same round trip
        asks whether the request's client went away (then the model is told), and keeps its stream entry
        from looking abandoned (its idle time starts again): a long stream is not redelivered. A request
        made in this process (a model's exec(decoupled=True), workers/bls.py) gets it on the loop."""
        if p.entry is None:
            local = self._local.get(id(p.request))
            if local is not None and local[0](reply):
                self.execution.streams.cancel(stream)
            return
        if self._out is None:
            self._out = Resp.like(self.redis)
        pipe = Batch()
        replies_into(pipe, {p.request.reply_to: [reply]}, self.delivery.reply_ttl_ms, self.spec.name,
                     self._bulk)
        asked = len(pipe.commands)  # the answer that says whether it was cancelled
        pipe.commands.append(["SISMEMBER", self.keys.cancelled(p.request.reply_to), p.request.id])
        if p.entry is not None:
            pipe.commands.append(["XCLAIM", p.entry[0], GROUP, self.consumer, 0, p.entry[1], "JUSTID"])
        try:
            results = await self._out.execute(pipe.commands)
        except Exception as exc:  # the final reply's pipeline tells of it again, or the entry is reclaimed
            log.error("model %s: writing a response failed: %s", self.spec.name, exc)
            return
        if results[asked]:
            self.execution.streams.cancel(stream)

    # -- replying --------------------------------------------------------------------------------

    async def _reply(self, replies: list[InferReply], requests: list[InferRequest],
                     pendings: list[Pending], rows: int = 0, started: float = 0.0,
                     timings: tuple[int, int, int] = (0, 0, 0)) -> None:
        """One round trip: a reply entry per gateway, statistics, queue counters, and the
        acknowledgement of every stream entry now fully answered (after its replies, in order).
        replies[i] answers requests[i]: ids are unique per gateway only, so a batch may hold two alike."""
        by_gateway: dict[str, list[InferReply]] = {}
        for r, req in zip(replies, requests, strict=True):
            if req.reply_to:
                by_gateway.setdefault(req.reply_to, []).append(r)
                continue
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
        for p in pendings:
            answered += p.members
            if p.entry is None:
                continue
            self._gateways.closed(p.request.reply_to, p.members)
            self._entries[p.entry] -= 1
            if self._entries[p.entry] == 0:
                del self._entries[p.entry]
                done.append(p.entry)
        if self.deferred is not None and not by_gateway and not done:
            # only requests made in this process (an ensemble's steps): nothing to send but counters,
            # which wait for the next pipeline
            self.deferred.add(self.stats_key, stats.tally(replies, rows, started, timings))
            self._read_along.release()  # nothing goes to Redis for it to ride with
        else:
            await self._send(replies, requests, pendings, by_gateway, done, rows, started, timings, quiet,
                             answered)
        self._in_flight -= answered
        if self._in_flight < self._read_ahead:
            self._room.set()

    async def _send(self, replies: list[InferReply], requests: list[InferRequest], pendings: list[Pending],
                    by_gateway: dict[str, list[InferReply]], done: list[tuple[str, bytes]], rows: int,
                    started: float, timings: tuple[int, int, int], quiet: bool, answered: int) -> None:
        if self._out is None:
            self._out = Resp.like(self.redis)
        pipe = Batch()
        entries = replies_into(pipe, by_gateway, self.delivery.reply_ttl_ms, self.spec.name, self._bulk)
        if self._bounded:
            count_dequeued(pipe, self.keys, self.spec, self.version, self._bounded, requests,
                           self._dequeued)
        counts = stats.tally(replies, rows, started, timings)
        if self.deferred is None:
            record_counts(pipe, self.stats_key, counts)
        else:
            self.deferred.add(self.stats_key, counts)
            if quiet:  # everything counted so far goes with these replies
                self.deferred.into(pipe)
        if done:
            self.streams.ack_into(pipe, done)
        if any(p.alone for p in pendings):
            self.streams.unmark_into(pipe, [p.entry for p in pendings if p.alone and p.entry is not None])
        room = self._room_entries(self._in_flight - answered)
        sent = self._read_along.send(pipe.commands, lambda c: self.streams.send_with(c, room))
        try:
            if sent is None:
                results = await self._out.execute(pipe.commands, errors=False)
            else:
                results = await self.streams.replies(sent, errors=False)
        except Exception as exc:  # nothing acknowledged: the entries stay pending and are reclaimed
            log.error("model %s: writing %d replies failed: %s; their entries stay pending for reclaim",
                      self.spec.name, len(replies), exc)
            return
        if again := refused("model", self.spec.name, pipe, results, entries, len(replies)):
            self._spawn(write_again(self._out, again, max(r.deadline for r in requests)))

    async def _ack(self, entries: list[tuple[str, bytes]]) -> None:
        try:
            await self.streams.ack(entries)
        except (RedisError, OSError) as exc:
            log.error("model %s: acknowledging failed: %s; the entries will be reclaimed",
                      self.spec.name, exc)


