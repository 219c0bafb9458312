"""Triton's sequence batcher on a worker (contract/sequence.py says what the config and requests mean).

Each sequence (correlation ID) is bound to one model instance when its first request comes, the
instance with the fewest sequences, and stays there: a model that keeps a sequence's state keeps it
where the next request runs. An instance runs as many sequences at once as it has slots (one per row
of a batch; Oldest's max_candidate_sequences when set); a sequence that finds none free waits, its
requests queued, until one ends, as in Triton's backlog; and, as there, a waiting sequence is refused,
every request it has queued, once one of them waited past its own `timeout`.

A sequence has at most one request in its instance's batcher at a time, so its requests run in the
order they came and no batch holds two of them; the instance's batcher (Triton's dynamic batching
rules, max_queue_delay from the strategy, with Oldest counted from when a request enters it, as
Triton's) puts requests of several sequences together. With Direct a
sequence keeps one row of its instance's batches (its slot): a batch runs in its sequences' rows, the
rows below its highest that no request fills holding a request that is not READY, as in Triton (nulls).
Each request carries the control inputs the config names (START, END, READY, true but in those null
rows, and CORRID) and each implicit state's input: the state output the model gave with the sequence's
request before (`keep`), or the initial state with a START. A batch mixes sequences whose states have
the same shape only.

A sequence ends after its END request, or once it has had nothing queued or running for
max_sequence_idle_microseconds; a request for a sequence that is not running, or whose END has come
(though not yet run), and does not START one is refused, as Triton refuses it.
"""
from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..contract.datatypes import V2_TO_NUMPY, element_count
from ..contract.errors import ConfigError, InvalidArgument
from ..contract.modelspec import ModelSpec
from ..contract.policy import BatchPolicy
from ..contract.sequence import END, START, Control, Correlation, SequencePolicy, State, check_correlation
from .batcher import DynamicBatcher, Item

ExecuteOn = Callable[[list[Item], int], Awaitable[None]]  # a batch, and the instance to run it on
Refuse = Callable[[Item, str], None]  # a request dropped before it ran, and why
SLOT_TIMED_OUT = ("timeout of the corresponding sequence has been expired (it waited for a free "
                  "sequence slot past the request's timeout)")  # Triton's message, and why
NUMPY = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64, "INT64": np.int64,
         "UINT32": np.uint32}


@dataclass
class _Sequence:
    instance: int               # -1: waiting for a free slot
    slot: int = -1              # Direct: its row in its instance's batches
    queued: deque[Item] = field(default_factory=deque)
    running: bool = False       # one of its requests is in its instance's batcher, or executing
    ended: bool = False         # its END request came: only a START may follow (a new sequence)
    last: float = 0.0           # when it last had a request queued or running (monotonic)
    expires: float | None = None  # while waiting for a slot: when its requests' first timeout runs out
    state: dict[str, np.ndarray] = field(default_factory=dict)  # state input -> its next value


class SequenceBatcher:
    """The runner's batcher for a model with sequence_batching: put(), run(), close(), pending and
    executing as DynamicBatcher's; `execute` is told which instance runs each batch."""

    def __init__(self, spec: ModelSpec, execute: ExecuteOn, instances: int, refuse: Refuse,
                 model_dir: Path | None = None) -> None:
        assert spec.sequence is not None
        self.spec, self.sequence = spec, spec.sequence
        self._initial = {st.input: initial_state(spec.name, st, model_dir) for st in self.sequence.states}
        # the state outputs a client does not see (the config's outputs do not list them)
        self.hidden = tuple(st.output for st in self.sequence.states if spec.output(st.output) is None)
        self.policy = BatchPolicy(max_batch_size=spec.max_batch_size,
                                  preferred=self.sequence.preferred if spec.max_batch_size else (),
                                  max_queue_delay_us=self.sequence.max_queue_delay_us, dynamic=True)
        self._execute = execute
        self._refuse = refuse  # answers a request dropped before it ran
        # their policy has no queue timeout: a request that reached one is never dropped there
        self._batchers = [DynamicBatcher(self.policy, partial(self._run, i), 1) for i in range(instances)]
        self._bound = [0] * instances  # sequences on each instance
        # Direct (batched): a sequence keeps one row of its instance's batches, as in Triton; the free ones
        self._direct = not self.sequence.oldest and spec.batched
        self._free = [list(range(self.sequence.slots)) for _ in range(instances)]
        self._sequences: dict[Correlation, _Sequence] = {}
        self._waiting: deque[Correlation] = deque()  # sequences waiting for a slot, oldest first
        self._closed = False

    @property
    def pending(self) -> int:
        return sum(b.pending for b in self._batchers) + sum(len(s.queued) for s in self._sequences.values())

    @property
    def executing(self) -> int:
        return sum(b.executing for b in self._batchers)

    def in_hand(self) -> Iterator[Item]:
        """As DynamicBatcher.in_hand: every request queued here, in an instance's batcher or executing."""
        for b in self._batchers:
            yield from b.in_hand()
        for seq in list(self._sequences.values()):
            yield from seq.queued

    def put(self, item: Item) -> None:
        if self._closed:
            raise RuntimeError("batcher is closed")
        request = item.payload.request
        if request.sequence is None:  # an ensemble's step or a model's call that names none (the gateway
            # refuses a direct request without one)
            raise InvalidArgument(f"inference request to model '{self.spec.name}' must specify a non-zero "
                                  "or non-empty correlation ID (an ensemble that calls it takes one from "
                                  "its request's parameter 'sequence_id', a model's call from "
                                  "InferenceRequest's correlation_id)")
        if item.rows > 1:  # as Triton's: a row of a batch is one sequence's request
            raise InvalidArgument(f"inference request to model '{self.spec.name}' must specify batch-size 1 "
                                  "due to requirements of sequence batcher")
        correlation, flags = request.sequence
        check_correlation(self.sequence, self.spec.name, correlation)
        controls = control_tensors(self.sequence, self.spec.batched, item.rows, correlation, flags)
        seq = self._sequences.get(correlation)
        now = time.monotonic()
        if seq is not None and self._idle(seq, now):  # idled out, though the reaper has not come by yet
            self._release(correlation)
            seq = None
        # as Triton's, a sequence ends when its END comes, not once it has run: what follows must START
        if (seq is None or seq.ended) and not flags & START:
            raise InvalidArgument(f"inference request for sequence {correlation} to model "
                                  f"'{self.spec.name}' must specify the START flag on the first "
                                  "request of the sequence")
        if seq is None:
            seq = self._sequences[correlation] = _Sequence(-1)
            instance = self._free_instance()
            if instance < 0:
                self._waiting.append(correlation)
            else:
                self._bind(seq, instance)
        item.payload.inputs.update(controls)
        seq.ended = bool(flags & END)  # a START after an END runs after it, where the state is
        seq.queued.append(item)
        seq.last = now
        if seq.instance < 0 and item.timeout_us:
            self._expires(correlation, seq, item)
        self._feed(seq)

    def _expires(self, correlation: Correlation, seq: _Sequence, item: Item) -> None:
        """A waiting sequence's request has a timeout: the sequence is refused when it runs out, unless
        it gets a slot first (Triton's backlog takes the earliest of its requests' timeouts)."""
        expires = (item.arrived if item.since is None else item.since) + item.timeout_us / 1e6
        if seq.expires is None or expires < seq.expires:
            seq.expires = expires
            asyncio.get_running_loop().call_later(max(0.0, expires - time.monotonic()), self._expire_waiting,
                                                  correlation, expires)

    def _expire_waiting(self, correlation: Correlation, expires: float) -> None:
        """The timer the waiting sequence's earliest timeout set fired: it is refused. The timer is
        trusted, not the clock: uvloop's count whole milliseconds and fire up to one early, and a
        sequence that looked not yet due was left waiting for a slot (until another sequence idled
        out a second later)."""
        seq = self._sequences.get(correlation)
        if seq is None or seq.instance >= 0 or seq.expires != expires:
            return  # got a slot, ended, or a later request's earlier timeout set another timer
        del self._sequences[correlation]
        self._waiting.remove(correlation)
        for item in seq.queued:
            self._refuse(item, SLOT_TIMED_OUT)
        self._close_when_done()

    def _free_instance(self) -> int:
        """The instance with the fewest sequences, or -1 when every instance's slots are taken."""
        instance = min(range(len(self._bound)), key=self._bound.__getitem__)
        return -1 if self._bound[instance] >= self.sequence.slots else instance

    def _bind(self, seq: _Sequence, instance: int) -> None:
        seq.instance, seq.expires = instance, None  # bound: no more waiting for a slot
        self._bound[instance] += 1
        if self._direct:
            seq.slot = heapq.heappop(self._free[instance])

    def _feed(self, seq: _Sequence) -> None:
        if not seq.running and seq.queued and seq.instance >= 0:
            seq.running = True
            item = seq.queued.popleft()
            if self.sequence.oldest:  # as Triton's Oldest, whose dynamic batcher starts the queue delay
                # anew: the delay counts from when the request may run (the queue timeout, from arrival)
                item.since = item.arrived if item.since is None else item.since
                item.arrived = time.monotonic()
            if self._initial:
                self._with_state(item, seq)
            self._batchers[seq.instance].put(item)

    def _with_state(self, item: Item, seq: _Sequence) -> None:
        """The request's state inputs: what the sequence's last request left, or the initial state."""
        starts = item.payload.request.sequence[1] & START
        inputs = item.payload.inputs
        shapes = []
        for name, initial in self._initial.items():
            value = None if starts else seq.state.get(name)
            if value is None:
                value = initial
                if self.spec.batched:  # one row of it for each row of the request
                    value = np.broadcast_to(initial, (item.rows, *initial.shape))
            inputs[name] = value
            shapes.append((name, value.shape[1:] if self.spec.batched else value.shape))
        item.shape_key = (item.shape_key, tuple(shapes))

    def keep(self, live: list[Any], sizes: list[int], results: list[dict[str, np.ndarray]]
             ) -> list[dict[str, np.ndarray]]:
        """After a batch ran: each sequence's state outputs become its next state inputs; `results` are
        the batch's outputs (one dict), or each request's. The results come back without the state
        outputs that clients do not see."""
        if not self._initial:
            return results
        each = results if len(results) == len(live) else None
        offset = 0
        for i, (pending, rows) in enumerate(zip(live, sizes)):
            seq = self._sequences.get(pending.request.sequence[0])
            out = each[i] if each is not None else results[0]
            if seq is not None and isinstance(out, dict):
                for st in self.sequence.states:
                    value = out.get(st.output)
                    if value is None:
                        continue
                    if each is None and self.spec.batched:
                        value = value[offset:offset + rows]
                    seq.state[st.input] = np.array(value)  # a copy: not a view that keeps the batch
            offset += rows
        for out in results:
            if isinstance(out, dict):
                for name in self.hidden:
                    out.pop(name, None)
        return results

    async def _run(self, instance: int, batch: list[Item]) -> None:
        if self._direct and len(batch) > 1:  # in its sequences' rows (nulls() fills those between)
            batch = sorted(batch, key=self._slot)
        try:
            await self._execute(batch, instance)
        finally:
            now = time.monotonic()
            for item in batch:
                correlation, flags = item.payload.request.sequence
                seq = self._sequences.get(correlation)
                if seq is None:
                    continue
                seq.running, seq.last = False, now
                if flags & END and not seq.queued:
                    self._release(correlation)
                else:
                    self._feed(seq)
            self._close_when_done()

    def _slot(self, item: Item) -> int:
        seq = self._sequences.get(item.payload.request.sequence[0])
        return -1 if seq is None else seq.slot

    def nulls(self, live: list[Item]) -> list[tuple[int, dict[str, np.ndarray]]]:
        """Direct's rows of a batch (in its sequences' rows, `live`) that no request fills, below the
        highest one that is filled: (row, its inputs), as Triton fills them: not READY, START and END
        false, CORRID 0, the other inputs zeros in the first request's shapes, states included (Triton's
        hold whatever its buffers held). None for Oldest, or when the batch fills its rows from 0 up."""
        if not self._direct:
            return []
        slots = [self._slot(item) for item in live]
        if slots == list(range(len(slots))) or -1 in slots:
            return []
        first = live[0].payload.inputs
        null = {name: np.full(value.shape, b"", dtype=np.object_) if value.dtype == np.object_
                else np.zeros_like(value) for name, value in first.items()}
        null.update(control_tensors(self.sequence, True, 1, 0, 0, ready=False))
        return [(row, null) for row in range(slots[-1]) if row not in slots]

    def _release(self, correlation: Correlation) -> None:
        """The sequence ends: its slot goes to the sequence that has waited longest, if any."""
        seq = self._sequences.pop(correlation)
        if seq.instance < 0:
            return
        self._bound[seq.instance] -= 1
        if self._direct:
            heapq.heappush(self._free[seq.instance], seq.slot)
        while self._waiting:
            instance = self._free_instance()
            if instance < 0:
                break
            waiting = self._sequences.get(self._waiting.popleft())
            if waiting is None:
                continue
            self._bind(waiting, instance)
            self._feed(waiting)

    def close(self) -> None:
        """Stop taking requests; run() returns once every sequence's queued requests have run."""
        self._closed = True
        self._close_when_done()

    def _close_when_done(self) -> None:
        if self._closed and not any(s.queued or s.running for s in self._sequences.values()):
            for b in self._batchers:
                b.close()

    async def run(self) -> None:
        idle = asyncio.create_task(self._release_idle())
        try:
            await asyncio.gather(*(b.run() for b in self._batchers))
        finally:
            idle.cancel()
            await asyncio.gather(idle, return_exceptions=True)

    async def _release_idle(self) -> None:
        """Sequences with nothing queued or running for max_sequence_idle_microseconds end, each when it
        is due, as Triton's reaper wakes for the earliest (a request that comes first finds it idle
        itself: put()). A sequence that goes idle after a look is due a whole limit later: the next
        look, at most a quarter of the limit on, sees it."""
        limit = self.sequence.idle_us / 1e6
        look = min(max(limit / 4, 0.01), 1.0)
        wait = look
        while True:
            await asyncio.sleep(wait)
            now = time.monotonic()
            due = now + look
            for correlation, seq in list(self._sequences.items()):
                if seq.running or seq.queued:
                    continue
                if now - seq.last >= limit:
                    self._release(correlation)
                else:
                    due = min(due, seq.last + limit)
            wait = max(due - time.monotonic(), 0.001)  # (a timer may fire a little early: look again)

    def _idle(self, seq: _Sequence, now: float) -> bool:
        """Whether the sequence has had nothing queued or running for max_sequence_idle_microseconds."""
        return not seq.running and not seq.queued and now - seq.last >= self.sequence.idle_us / 1e6


def initial_state(model: str, state: State, model_dir: Path | None) -> np.ndarray:
    """A state's initial value (without the batch dimension): its initial_state's file, or zeros (in the
    initial_state's dims, else the state's, an open size taken as 1)."""
    dims = state.initial_dims or tuple(1 if d == -1 else d for d in state.dims)
    dtype = V2_TO_NUMPY[state.datatype]
    if not state.initial_file:
        return np.zeros(dims, dtype=dtype)
    path = (model_dir or Path(".")) / "initial_state" / state.initial_file
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"model '{model}': the initial state of '{state.input}': {exc}") from None
    need = element_count(dims) * np.dtype(dtype).itemsize
    if len(raw) < need:  # a longer file is read as far as the state goes, as Triton reads it
        raise ConfigError(f"model '{model}': the initial state of '{state.input}': {path.name} holds "
                          f"{len(raw)} bytes; {list(dims)} of {state.datatype} is {need}")
    return np.frombuffer(raw, dtype=dtype, count=element_count(dims)).reshape(dims)


def control_tensors(policy: SequencePolicy, batched: bool, rows: int, correlation: Correlation, flags: int,
                    ready: bool = True) -> dict[str, np.ndarray]:
    """The control inputs of one request: each row gets its value (shape [rows, 1], or [1] unbatched)."""
    shape = (rows, 1) if batched else (1,)
    out = {}
    for control in policy.controls:
        out[control.name] = _control(control, shape, correlation, flags, ready)
    return out


def _control(control: Control, shape: tuple[int, ...], correlation: Correlation, flags: int,
             ready: bool) -> np.ndarray:
    if control.kind == "CORRID":
        if control.datatype == "BYTES":  # (check_correlation has refused an ID of the other type)
            return np.full(shape, str(correlation).encode() if correlation else b"", dtype=np.object_)
        # the ID's low bytes where the datatype is narrower, as Triton copies them
        return np.full(shape, correlation, dtype=np.uint64).astype(NUMPY[control.datatype])
    on = {"START": bool(flags & START), "END": bool(flags & END), "READY": ready}[control.kind]
    value = control.false_true[1] if on else control.false_true[0]
    return np.full(shape, value, dtype=NUMPY[control.datatype])
