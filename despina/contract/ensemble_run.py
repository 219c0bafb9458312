"""One request through an ensemble's graph (contract/ensemble.py): `Run`, and `Branch`, one response of a
decoupled step going on through the steps after it (contract/ensemble_stream.py)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .ensemble import Ensemble, Step
from .ensemble_stream import after
from .errors import Code, DeadlineExceeded, DespinaError, ReplyError
from .modelspec import ModelSpec, check_inputs, check_shape
from .records import InferReply, Tensor

log = logging.getLogger("despina.ensemble")


class Run:
    """One request through an ensemble's graph: a step starts as soon as the tensors it reads exist, so
    independent steps run at once, and a step's outputs become ensemble tensors for the steps after it.
    The request keeps one deadline across all its steps; the first step that fails ends the run with
    its error, named by step and model.

    Where steps go is the subclass's: `_call(step)` queues one (through `step_inputs` and, when its
    answer comes, `settled`); `_finish(result, rows)` gets the reply with the requested outputs, or the
    error. The gateway runs an ensemble this way over the models' streams (gateway/ensemble.py), a
    worker that has every model it calls over their batchers (workers/ensembles.py). Everything is
    callbacks: no task of its own.

    A decoupled step's responses each go on through the steps after it (contract/ensemble_stream.py):
    the subclass calls `stream_from(step)` as it queues one, gives each response but the last to
    `streamed`, and the last to `settled`; each response of the ensemble goes to `partial`, and the
    answer to `_finish` is then the final flag alone (an empty reply)."""

    # a decoupled step's: the steps after it, set aside to run on each of its responses (by step index)
    streaming: dict[int, list[Step]] | None = None
    branches = 0  # its responses going through the steps after it
    partial: Callable[[InferReply], None] | None = None  # each response of the ensemble

    def __init__(self, spec: ModelSpec, ensemble: Ensemble, timeout: float) -> None:
        self.spec, self.ensemble = spec, ensemble
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.pending: list[Step] = []
        self.running = 0
        self.over = False
        self.tensors: dict[str, Tensor] = {}
        self.compute_us = 0  # its steps' compute, its own in the statistics as in Triton
        self.compute_ns = [0, 0, 0]  # that compute's input, infer and output, as its steps' replies split it

    def _call(self, step: Step) -> None:
        self._call_in(self, step)

    def _call_in(self, run: Run, step: Step) -> None:
        """Queue `run`'s step (run: this one, or one of its responses' branches)."""
        raise NotImplementedError

    def _finish(self, result: InferReply | DespinaError, rows: int) -> None:
        raise NotImplementedError

    def start(self, inputs: list[Tensor], outputs: tuple[str, ...]) -> None:
        """Run on `inputs` (checked against the ensemble's own spec); answer `outputs` (all when none)."""
        self._plan(inputs, outputs)
        self._next()

    def _plan(self, inputs: list[Tensor], outputs: tuple[str, ...]) -> None:
        self.tensors = {t.name: t for t in inputs}
        self.wanted = outputs or tuple(t.name for t in self.spec.outputs)
        self.pending = self.ensemble.needed_for(self.wanted)
        # what will exist: the inputs given and the outputs of every step that runs (an optional input
        # that was not given is not waited for)
        self.coming = set(self.tensors) | {t for s in self.pending for _, t in s.outputs}

    def _next(self) -> None:
        try:
            self._advance()
        except Exception as exc:  # a fault here must still answer the caller, never leave it waiting
            log.exception("ensemble %s failed", self.spec.name)
            self.fail(DespinaError(f"ensemble '{self.spec.name}' failed: {exc}", Code.INTERNAL))

    def _advance(self) -> None:
        """Start every step whose tensors exist; answer once nothing runs and nothing is left."""
        if self.over:  # failed already (a branch that ends after its request's error calls here too)
            return
        tensors, coming = self.tensors, self.coming
        ready = []
        for s in self.pending:  # (loops, not all() over a generator per step: this runs at each step's end)
            for _, t in s.inputs:
                if t not in tensors and t in coming:
                    break
            else:
                ready.append(s)
        for step in ready:
            if step not in self.pending:
                continue  # a step answered at once (from a response cache) started it already
            self.pending.remove(step)
            self.running += 1
            try:
                self._call(step)
            except DespinaError as exc:
                self.fail(self.named(step, exc))
            if self.over:
                return
        if self.running or self.branches:
            return
        if self.pending:
            missing = sorted({t for s in self.pending for _, t in s.inputs if t not in tensors})
            self.fail(DespinaError(f"ensemble '{self.spec.name}': {self.pending[0]} waits for tensor(s) "
                                   f"{', '.join(missing)} that no step returned", Code.INTERNAL))
            return
        # an output no step returned is left out, as in Triton. The reply carries its steps' compute: an
        # ensemble that calls this one counts that as its own, as Triton's does (a step reports its
        # compute to its ensemble's statistics, an ensemble step the sums of its own steps)
        split = (self.compute_ns[0], self.compute_ns[1], self.compute_ns[2])
        if self.streaming is not None:  # each response went out: the last word is the final flag alone
            reply = InferReply("", (), compute_us=self.compute_us, empty=True, split=split)
        else:
            outputs = []
            for n in self.wanted:
                if (out := tensors.get(n)) is not None:
                    outputs.append(out if out.name == n else Tensor(n, out.datatype, out.shape, out.data))
            reply = InferReply("", tuple(outputs), compute_us=self.compute_us, split=split)
        self.over = True
        self._finish(reply, self._rows())

    def step_inputs(self, step: Step, spec: ModelSpec) -> list[Tensor]:
        """The step's inputs, renamed to its model's and checked against its spec."""
        tensors = self.tensors
        inputs = []
        for to, name in step.inputs:
            # (an optional input the caller left out, or an output a step did not return, is not there)
            if (t := tensors.get(name)) is not None:
                inputs.append(t if t.name == to else Tensor(to, t.datatype, t.shape, t.data))
        self.check(step, spec, inputs)
        return inputs

    def check(self, step: Step, spec: ModelSpec, inputs: list[Tensor]) -> None:
        """InvalidArgument where `step`'s `inputs` do not fit its model's `spec` (check_step)."""
        check_step(spec, inputs)

    def settled(self, step: Step, result: InferReply | DespinaError) -> None:
        """A step's answer: its outputs become ensemble tensors, and the steps they complete start."""
        if self.over:
            return  # another step failed first: its error was the answer
        self.running -= 1
        if isinstance(result, DespinaError):
            self.fail(self.named(step, result))
            return
        self.computed(result)
        if self.streaming is not None and step.index in self.streaming:  # a decoupled step's last word
            if not result.empty:
                self._branch(step, result)
            self._next()
            return
        names = dict(step.outputs)
        for t in result.outputs:
            if t.name in names:
                self.tensors[names.pop(t.name)] = t
        # what it did not return never comes: a step that reads it runs without it (Triton's placeholder)
        self.coming.difference_update(names.values())
        self._next()

    def stream_from(self, step: Step) -> None:
        """`step` is decoupled: the steps after it run on each of its responses, not here."""
        later = after(self.ensemble, step)
        if self.streaming is None:
            self.streaming = {}
        self.streaming[step.index] = [s for s in self.pending if s.index in later]
        self.pending = [s for s in self.pending if s.index not in later]

    def streamed(self, step: Step, reply: InferReply) -> None:
        """A decoupled step's response before its last: through the steps after it, or the error."""
        if self.over:
            return
        if reply.error is not None:
            code, message = reply.error
            self.fail(self.named(step, ReplyError(message, Code(code))))
            return
        self.computed(reply)
        self._branch(step, reply)

    def computed(self, reply: InferReply) -> None:
        """Count a step's compute as the ensemble's: its input, infer and output as its reply splits them (as
        Triton sums its steps'), all of it as infer where the reply does not (a decoupled step's)."""
        self.compute_us += reply.compute_us
        split, ns = reply.split, self.compute_ns
        if split is None:
            ns[1] += reply.compute_us * 1000
        else:
            ns[0] += split[0]
            ns[1] += split[1]
            ns[2] += split[2]

    def _branch(self, step: Step, reply: InferReply) -> None:
        self.branches += 1
        Branch(self, step, reply)._next()

    def fail(self, error: DespinaError) -> None:
        if self.over:
            return
        self.over = True
        self._finish(error, 0)

    def left(self) -> float:
        """Seconds left of the request's time; DeadlineExceeded when none is."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"ensemble '{self.spec.name}' ran out of time")
        return left

    def named(self, step: Step, exc: DespinaError) -> DespinaError:
        code = exc.code
        if code == Code.INVALID_ARGUMENT and any(t not in self.ensemble.inputs for _, t in step.inputs):
            code = Code.INTERNAL  # a tensor another step made does not fit: the ensemble's fault
        elif code == Code.NOT_FOUND:
            code = Code.UNAVAILABLE  # the ensemble exists; a model it calls went away
        made = ReplyError if isinstance(exc, ReplyError) else DespinaError  # (the model failed it)
        return made(f"ensemble '{self.spec.name}' {step}: {exc.message}", code, exc.retry_after)

    def _rows(self) -> int:
        if not self.spec.batched:
            return 1
        for n in self.ensemble.inputs:  # the first input given
            if (first := self.tensors.get(n)) is not None:
                return first.shape[0] if first.shape else 1
        return 1


class Branch(Run):
    """The steps after a decoupled step, on one of its responses: those its parent set aside when it
    called the step (Run.stream_from). Its steps go where its root's go; its answer is one response of
    the ensemble, its error the request's."""

    def __init__(self, parent: Run, step: Step, reply: InferReply) -> None:
        super().__init__(parent.spec, parent.ensemble, 0)
        self.parent = parent
        self.root: Run = parent.root if isinstance(parent, Branch) else parent
        self.deadline, self.started, self.wanted = parent.deadline, parent.started, parent.wanted
        self.tensors = dict(parent.tensors)
        names = dict(step.outputs)
        for t in reply.outputs:
            if t.name in names:
                self.tensors[names[t.name]] = t
        self.pending = list((parent.streaming or {}).get(step.index, ()))
        self.coming = set(self.tensors) | {t for s in self.pending for _, t in s.outputs}

    def _call(self, step: Step) -> None:
        if self.root.over:  # another response failed the request: nothing more of it runs
            self.over = True
            return
        self.root._call_in(self, step)

    def _finish(self, result: InferReply | DespinaError, rows: int) -> None:
        root = self.root
        if isinstance(result, DespinaError):
            root.fail(result)
            return
        root.compute_us += self.compute_us
        root.compute_ns = [a + b for a, b in zip(root.compute_ns, self.compute_ns)]
        if not root.over and root.partial is not None and not result.empty:
            root.partial(result)
        self.parent.branches -= 1
        self.parent._next()


def check_step(spec: ModelSpec, inputs: list[Tensor]) -> None:
    """A step's inputs (named as its model's) against its model's spec: each one's shape, then that every
    input it needs is there, with one batch size. It depends on their names and shapes alone."""
    for t in inputs:
        expected = spec.input(t.name)
        if expected is not None:
            check_shape(spec, expected, list(t.shape))
    check_inputs(spec, inputs)

