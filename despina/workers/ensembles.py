"""Ensembles run by a worker that has every model they call: one round trip through Redis per request.

A worker that has a READY version of each model an ensemble's steps call (the pinned version where a
step pins one) runs the ensemble itself, as Triton does: it reads the ensemble's own stream through
the consumer group like a model's, runs each request's graph (contract.ensemble_run.Run) with every step
queued straight into its model's batcher in this process — batched there with that model's other
requests — and writes the final reply to the gateway, the ensemble's statistics, and the
acknowledgement in one pipeline. The step tensors never leave the process. Its heartbeat reports the
ensemble READY, and gateways then queue ensemble requests on its stream instead of running the steps
themselves (gateway/ensemble.py, which stays the way when the models are on different workers or
scaled to zero).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import clock, summaries
from ..contract import records
from ..contract.ensemble import Ensemble, Step
from ..contract.ensemble_run import Run
from ..contract.errors import Code, DeadlineExceeded, DespinaError, Unavailable
from ..contract.keys import FIELD, Keys
from ..contract.modelspec import ModelSpec
from ..contract.records import InferReply, InferRequest, Tensor
from ..counters import Deferred
from ..logs import Throttled
from ..resp import Batch, ReadAlong
from .inflight import Gateways
from .redelivery import DeliveryPolicy
from .replies import ReplyWriter
from .runner import READ_WAITS_S, TIMED_OUT, ModelRunner, Settled
from .stats import Success, ensemble_counts, ensemble_successes
from .streams import Entry, ModelStreams

if TYPE_CHECKING:
    from .sweep import PendingSweep

log = logging.getLogger("despina.worker")

READ_AHEAD = 256   # requests read and not yet answered, at most
CHECKED = 1024     # step input shapes whose check an ensemble keeps (_HostRun.check), at most; plans too
DRAIN_S = 0.5      # after saying it stops, it still reads this long: gateways that had not heard yet

StepRunner = Callable[[Step], ModelRunner | None]


class EnsembleHost:
    def __init__(self, redis: aioredis.Redis, keys: Keys, spec: ModelSpec, ensemble: Ensemble, version: int,
                 runner: StepRunner, consumer: str, delivery: DeliveryPolicy, config: bytes = b"",
                 deferred: Deferred | None = None, sweep: PendingSweep | None = None,
                 summary: bool = False) -> None:
        """`summary`: keep its requests' recent latencies, for Triton's latency summaries."""
        self.summary = summaries.LatencyWindow() if summary else None
        self.redis, self.keys, self.spec, self.ensemble, self.version = redis, keys, spec, ensemble, version
        self.sweep = sweep  # the worker's, which redelivers its streams' abandoned entries (sweep.py)
        self.runner = runner
        self.delivery = delivery
        self.config = config  # the catalog's config it was built from: a change restarts it
        self.deferred = deferred
        self.streams = ModelStreams(redis, keys, spec.name, version, spec.policy.priority_levels, consumer)
        self.stats_key = keys.stats(spec.name, version)
        self._entries: dict[tuple[str, bytes], int] = {}  # stream entry -> requests not yet answered
        self._in_flight = 0
        # what each gateway has in flight (workers/inflight.py), and per model the steps that calls it
        # the runs here have yet to start. With every request out running here and none of them still
        # to call a model, nothing of this ensemble can join that model's batch (vouch)
        self._gateways = Gateways()
        self._reach: dict[str, int] = {}
        self._vouchers: dict[str, Settled] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._done: list[tuple[InferRequest | None, InferReply | None, tuple[str, bytes]]] = []
        self._counts: dict[str, int] = {}
        self._successes: list[Success] = []  # this tick's, counted together as its replies go (_flush)
        # (step, its inputs' names and shapes) -> the spec of the step's model they passed the check of
        self._checked: dict[tuple[Any, ...], ModelSpec] = {}
        # the outputs a request asks for -> what it wants, the steps that make them and the tensors those make
        self._plans: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[Step, ...], frozenset[str]]] = {}
        self._flush_soon: asyncio.Handle | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._read_along = ReadAlong()  # the read loop's next read, waiting for the next replies
        self.writer = ReplyWriter("ensemble", redis, keys, spec, version, self.streams, delivery.reply_ttl_ms,
                                  deferred, self._read_along)
        self.state = "LOADING"

    async def start(self) -> None:
        await self.streams.ensure_groups()
        await self.writer.start()
        self.state = "READY"
        self._tasks = [asyncio.create_task(self._read_loop())]
        if self.sweep is not None:
            self.sweep.add(self.streams, self.delivery, f"ensemble {self.spec.name}")
        log.info("ensemble %s version %d: run in this worker", self.spec.name, self.version)

    async def stop(self, drain_s: float = DRAIN_S) -> None:
        """Stop reading (after `drain_s`, for gateways still routing here), finish every run, reply."""
        self.state = "UNLOADING"
        if drain_s:
            await asyncio.sleep(drain_s)
        if self._tasks:  # the read in flight brings what Redis delivered to it: ours to run (runner.py stop)
            self._stopping = True
            self._room.set()
            await self.streams.end_read(self._tasks[0])
        if self.sweep is not None:
            self.sweep.discard(self.streams)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # a read sent with replies may still block on the reading connection: once those replies are
        # in, a fresh connection, so that the read below does not queue behind it
        await asyncio.gather(*list(self._writes), return_exceptions=True)
        self.streams.close()
        try:  # what came in until now is run too (the models it calls stop after this)
            while entries := await self.streams.read(READ_AHEAD, None):
                self._accept(entries)
        except (RedisError, OSError) as exc:  # left in the stream for the next worker that runs it
            log.warning("ensemble %s: reading its stream before stopping failed (%s)", self.spec.name, exc)
        await self._idle.wait()  # each run ends by its deadline at the latest
        self._flush()
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        self.streams.close()
        await self.streams.leave()
        self.writer.close()
        self.state = "UNAVAILABLE"

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
                failed.log("ensemble %s: reading its stream failed (%s); retrying", self.spec.name, exc)
                await asyncio.sleep(0.5)
                continue
            if entries:
                self._accept(entries)
            del entries  # not held while the next read waits (which may be long): large requests

    async def _read(self) -> list[Entry]:
        sent = await self._read_with_replies()
        if sent is None:
            return await self.streams.read(max(1, READ_AHEAD - self._in_flight), self.streams.block_ms)
        return await self.streams.sent_read(sent)

    async def _read_with_replies(self) -> asyncio.Future[Any] | None:
        """While every request the gateways have out for this ensemble runs here, none can come before
        replies go: the next read then goes out with them (_write), in one write, not in a round trip to
        Redis of its own. The read as sent, or None: read now."""
        if not self._in_flight or not self.streams.can_send_with or not self._gateways.all_here():
            return None
        return await self._read_along.wait(READ_WAITS_S)

    def _accept(self, entries: list[Entry]) -> None:
        now = clock.now()
        for stream, entry_id, fields in entries:
            entry = (stream, entry_id)
            try:
                reqs = records.decode_requests(fields[FIELD])
            except (KeyError, DespinaError) as exc:
                log.error("ensemble %s: dropping undecodable entry %s: %s", self.spec.name, entry_id, exc)
                self._entries[entry] = 0
                self._finished(None, None, entry)
                continue
            self._entries[entry] = len(reqs)
            self._in_flight += len(reqs)
            if reqs:
                self._gateways.announce(reqs[0].reply_to, fields)
            for req in reqs:
                self._gateways.opened(req.reply_to)
                if req.deadline < now:
                    self._answer(req, entry, DeadlineExceeded(TIMED_OUT), 0)
                    continue
                _HostRun(self, req, entry, now).start(list(req.inputs), req.outputs)
        if self._in_flight >= READ_AHEAD:
            self._room.clear()
        if self._in_flight:
            self._idle.clear()

    def vouch(self, model: str) -> Settled:
        """For the batcher of a step's model: whether no other request of this ensemble can still join
        a batch of it (every request its gateways have out runs here, and none of those runs has a
        step left that calls the model)."""
        voucher = self._vouchers.get(model)
        if voucher is None:
            voucher = self._vouchers[model] = lambda: not self._reach.get(model) and self._gateways.all_here()
        return voucher

    def _reaching(self, steps: list[Step], n: int) -> None:
        reach = self._reach
        for step in steps:
            reach[step.model] = reach.get(step.model, 0) + n

    # -- answering -------------------------------------------------------------------------------

    def _answer(self, req: InferRequest, entry: tuple[str, bytes], result: InferReply | DespinaError,
                rows: int, compute_us: int = 0, queue_us: int = 0,
                compute_ns: tuple[int, int, int] | list[int] = (0, 0, 0),
                steps: tuple[records.StepTimes, ...] = ()) -> None:
        """`queue_us`: how long the request waited on the ensemble's stream before its run began (Triton's
        ensemble's own queue time: from its enqueue until the ensemble scheduler starts it). The reply
        carries it and `compute_us`, its steps' compute, not its whole latency: an ensemble that calls
        this one counts that compute as its own; `compute_ns` that compute's input, infer and output, and
        `steps` (a timed request's) each step's times."""
        us = max(0, int((clock.now() - req.enqueued) * 1e6))
        error = result if isinstance(result, DespinaError) else None
        if error is not None:
            ensemble_counts(error, us, rows, self._counts, compute_ns, queue_us)
        elif self.summary is not None:
            summaries.observe_ensemble(self.summary, us, queue_us, compute_ns)
        if error is None:
            self._successes.append((us, queue_us, rows, compute_ns[0], compute_ns[1], compute_ns[2]))
            reply = InferReply(req.id, result.outputs, None, queue_us, compute_us)  # type: ignore[union-attr]
            if req.timed:  # (traced, or a step of an ensemble that a gateway runs: its compute is that one's)
                reply.split, reply.steps = (compute_ns[0], compute_ns[1], compute_ns[2]), steps
        else:
            reply = InferReply(req.id, (), (error.code, error.message))
        self._finished(req, reply, entry)
        self._gateways.closed(req.reply_to)
        self._in_flight -= 1
        if self._in_flight < READ_AHEAD:
            self._room.set()
        if not self._in_flight:
            self._idle.set()

    def _finished(self, req: InferRequest | None, reply: InferReply | None, entry: tuple[str, bytes]) -> None:
        """Queue a reply (None: an entry to acknowledge only) for this tick's pipeline."""
        self._done.append((req, reply, entry))
        if self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Every reply that came in this tick, the statistics and the acknowledgements: one round trip."""
        self._flush_soon = None
        if not self._done:
            return
        done, self._done = self._done, []
        counts, self._counts = self._counts, {}
        if self._successes:  # (per request, these were most of its counting: here, one pass for the tick)
            ensemble_successes(self._successes, counts)
            self._successes = []
            counts["last_inference"] = int(clock.now() * 1000)
        by_gateway: dict[str, list[InferReply]] = {}
        answered: list[InferRequest] = []
        acks = []
        for req, reply, entry in done:
            if req is not None and reply is not None:
                by_gateway.setdefault(req.reply_to, []).append(reply)
                answered.append(req)
                self._entries[entry] -= 1
            if self._entries.get(entry) == 0:
                del self._entries[entry]
                acks.append(entry)
        # the counters waiting (the steps') go too
        pipe = Batch()
        entries = self.writer.build(pipe, by_gateway, counts, acks, quiet=True)
        task = asyncio.get_running_loop().create_task(self._write(pipe, answered, entries))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, pipe: Batch, answered: list[InferRequest], entries: int) -> None:
        room = max(1, READ_AHEAD - self._in_flight)
        if again := await self.writer.send(pipe, entries, len(answered), room):
            await self.writer.write_again(again, max(r.deadline for r in answered))


class _HostRun(Run):
    """One request's graph, its steps queued into this worker's runners."""

    def __init__(self, host: EnsembleHost, request: InferRequest, entry: tuple[str, bytes], now: float
                 ) -> None:
        super().__init__(host.spec, host.ensemble, request.deadline - now)
        self.host, self.request, self.entry = host, request, entry
        self.queue_us = max(0, int((now - request.enqueued) * 1e6))  # on the stream, until it was read
        self.steps: list[records.StepTimes] = []  # a timed request's (_timing)

    def start(self, inputs: list[Tensor], outputs: tuple[str, ...]) -> None:
        self._plan(inputs, outputs)
        self.host._reaching(self.pending, 1)  # each step leaves `pending` to _call, or at the finish
        self._next()

    def _plan(self, inputs: list[Tensor], outputs: tuple[str, ...]) -> None:
        """Run._plan, with the steps that `outputs` need and the tensors they make found once per host:
        they depend on those outputs alone, and an ensemble's requests mostly ask for the same ones."""
        plans = self.host._plans
        plan = plans.get(outputs)
        if plan is None:
            super()._plan(inputs, outputs)
            if len(plans) >= CHECKED:
                plans.clear()
            plans[outputs] = (self.wanted, tuple(self.pending),
                              frozenset(t for s in self.pending for _, t in s.outputs))
            return
        self.tensors = tensors = {t.name: t for t in inputs}
        self.wanted, steps, made = plan
        self.pending = list(steps)
        self.coming = set(tensors) | made

    def _call(self, step: Step) -> None:
        host = self.host
        reach = host._reach
        reach[step.model] = reach.get(step.model, 0) - 1  # (counted in start)
        runner = host.runner(step)
        if runner is None:  # unloaded since the host started: the host is stopping too
            raise Unavailable(f"model '{step.model}' is not loaded on this worker")
        self.left()
        req = self.request
        answered: Callable[[InferReply], None] = partial(self._answered, step)
        if req.timed:  # (a traced request's: its steps' times go back with its reply, its child traces)
            answered = self._timing(runner, step, answered)
        runner.submit(self.step_inputs(step, runner.spec), step.asked, req.deadline, answered, req.priority,
                      req.timeout_us, req.trace, host.vouch(step.model), sequence=req.sequence)

    def check(self, step: Step, spec: ModelSpec, inputs: list[Tensor]) -> None:
        """Run.check, once per step, model spec and shapes of its inputs: it depends on those alone, and
        an ensemble's requests mostly come in few shapes."""
        if len(inputs) == 1:
            t = inputs[0]
            key: tuple[Any, ...] = (step.index, t.name, t.shape)
        else:
            key = (step.index, *[(t.name, t.shape) for t in inputs])
        checked = self.host._checked
        if checked.get(key) is spec:
            return
        super().check(step, spec, inputs)
        if len(checked) >= CHECKED:
            checked.clear()
        checked[key] = spec

    def _timing(self, runner: ModelRunner, step: Step, answered: Callable[[InferReply], None]
                ) -> Callable[[InferReply], None]:
        """`answered`, that first keeps the step's times (records.StepTimes)."""
        enqueued = self.request.enqueued
        queued = int((clock.now() - enqueued) * 1e9)

        def timed(reply: InferReply) -> None:
            split = reply.split or (0, 0, 0)
            self.steps.append((runner.spec.name, runner.version, queued, int((clock.now() - enqueued) * 1e9),
                               reply.queue_us, reply.compute_us, *split))
            answered(reply)
        return timed

    def _answered(self, step: Step, reply: InferReply) -> None:
        if reply.error is None:
            self.settled(step, reply)
        else:
            code, message = reply.error
            self.settled(step, DespinaError(message, Code(code)))

    def _finish(self, result: InferReply | DespinaError, rows: int) -> None:
        self.host._reaching(self.pending, -1)  # steps it never called
        self.host._answer(self.request, self.entry, result, rows, self.compute_us, self.queue_us,
                          self.compute_ns, tuple(self.steps))
