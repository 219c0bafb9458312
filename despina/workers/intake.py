"""How a model runner takes requests in (part of ModelRunner, runner.py): a stream entry's requests decoded,
checked and queued in the batcher, or answered at once when they cannot run (past their deadline, inputs
it refuses, a full queue); and requests made in this process (submit: an ensemble's steps, a model's
calls), answered from the response cache where the model keeps one."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import clock
from ..contract import records
from ..contract.errors import Code, DespinaError, Unavailable
from ..contract.keys import ATTEMPTS, FIELD
from ..contract.records import NO_PARAMETERS, InferReply, InferRequest, Parameters, Tensor
from ..response_cache import ResponseCache, cache_key, through
from . import answers
from .backends.base import check_text, request_inputs
from .batcher import Item, QueueFull
from .outbox import Outbox
from .streams import Entry

log = logging.getLogger("despina.worker")

TIMED_OUT = "request timed out in the queue before it could run"
QUEUE_TIMED_OUT = "Request timeout expired (the queue policy's timeout passed before it could run)"
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


class Intake(Outbox):
    """ModelRunner's way in. The state it uses is ModelRunner's (set in its __init__)."""

    path: Path
    version: int
    response_cache: ResponseCache | None
    _load_id: str
    _text: frozenset[str]
    _ragged: frozenset[str]
    _stopping: bool

    async def _accept(self, entries: list[Entry]) -> None:
        now = clock.now()
        failures: list[InferReply] = []
        failed: list[InferRequest] = []  # failures[i] answers failed[i]
        refusals: list[InferReply] = []  # as failures, of requests refused before they were queued
        refused: list[InferRequest] = []

        def fail(req: InferRequest, entry: tuple[str, bytes], code: Code, message: str,
                 queued: bool = True) -> None:
            (failures if queued else refusals).append(answers.error(req, code, message))
            (failed if queued else refused).append(req)
            self._entries[entry] -= 1

        # looked up once: what follows runs for every request
        put, shape_key, rows_of, text, opened = \
            self.batcher.put, self._shape_key, self._rows, self._text, self._gateways.opened
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
                    if text:
                        check_text(inputs, text)
                    pending = Pending(req, entry, inputs, alone, now, members)
                    # the queue delay counts from here, as Triton's from its scheduler's queue (time
                    # in the stream is the gateway's and Valkey's work, not a wait for batch-mates);
                    # a queue timeout counts from the gateway's enqueue, the client's clock
                    arrived = time.monotonic()
                    waited = now - req.enqueued
                    put(Item(rows_of(inputs), entry if alone else shape_key(req), pending, arrived,
                             req.priority, req.timeout_us, arrived - waited if waited > 0.0 else arrived))
                except QueueFull as exc:
                    fail(req, entry, Code.RESOURCE_EXHAUSTED, f"model '{self.spec.name}': {exc}")
                    continue
                except DespinaError as exc:  # its inputs, or the sequence batcher's refusal: as Triton
                    # refuses these before its scheduler queues them, no failure in the statistics
                    fail(req, entry, exc.code, exc.message, exc.code != Code.INVALID_ARGUMENT)
                    continue
                except Exception as exc:  # a bug: it fails this request, and the model reads on
                    log.exception("model %s: taking request %s failed", self.spec.name, req.id)
                    fail(req, entry, Code.INTERNAL, f"model '{self.spec.name}': {type(exc).__name__}: {exc}")
                    continue
                opened(req.reply_to, members)
                self._in_flight += members
        if len(self._entries) and self._in_flight >= self._read_ahead:
            self._room.clear()
        if failures:
            await self._reply(failures, failed, [], ran=False)
        if refusals:
            await self._reply(refusals, refused, [], ran=False, counted=False)
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

    def _on_queue_timeout(self, item: Item) -> None:
        """The batcher dropped a request whose queue timeout passed (REJECT policy): answered as Triton
        answers it, UNAVAILABLE "Request timeout expired" (HTTP 503), a failure counted as REJECTED."""
        self._on_timeout(item, QUEUE_TIMED_OUT)

    def _on_timeout(self, item: Item, why: str) -> None:
        """A batcher dropped a request that waited past its timeout (the queue policy's, or, in the
        sequence batcher, the request's while its sequence waited for a slot): Triton answers both
        UNAVAILABLE (HTTP 503), each with its own message, `why`."""
        p: Pending = item.payload
        reply = answers.error(p.request, Code.RESOURCE_EXHAUSTED, f"model '{self.spec.name}': {why}")
        self._spawn(self._reply([reply], [p.request], [p], ran=False))

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
        now = clock.now()
        request = InferRequest("", "", deadline, tuple(inputs), outputs, priority, timeout_us, now, trace,
                               parameters, request_id, sequence)
        try:
            if self._stopping:
                raise Unavailable(f"model '{self.spec.name}' version {self.version} is unloading")
            arrays = request_inputs(request)
            pending = Pending(request, None, arrays, False, now)
            self.batcher.put(Item(self._rows(arrays), self._shape_key(request), pending, time.monotonic(),
                                  priority, timeout_us))
        except DespinaError as exc:
            answer(answers.error(request, exc.code, exc.message))
            return
        except QueueFull as exc:
            answer(answers.error(request, Code.RESOURCE_EXHAUSTED, f"model '{self.spec.name}': {exc}"))
            return
        self._local[id(request)] = (answer, settled)
        self._in_flight += 1
        if self.deferred is not None:  # as a gateway counts what it queues (pending: enqueued - answered)
            self.deferred.count(self.stats_key, "enqueued")

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
