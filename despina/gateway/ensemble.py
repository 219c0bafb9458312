"""Ensembles, run by the gateway that took the request: each step is an ordinary request to the model
it calls, queued on that model's stream and batched there with everyone else's requests.

A step starts as soon as the tensors it reads exist, so independent steps run at once; a step's
outputs become ensemble tensors for the steps after it. The request keeps one deadline across all its
steps. The first step that fails ends the run with that step's error, named by step and model; a step
whose model is scaled to zero wakes it, as a direct request would. The ensemble's own statistics
(requests, failures, latency) are counted here; each step's count in its model's statistics.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..contract.ensemble import Ensemble, Step
from ..contract.errors import Code, DeadlineExceeded, DespinaError, Unavailable
from ..contract.modelconfig import ModelSpec
from ..contract.records import InferReply, Tensor
from ..workers.stats import tally
from .models import NotLoaded
from .v2 import check_inputs, check_shape

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("despina.gateway")

Done = Callable[[InferReply | DespinaError], None]
Submit = Callable[..., None]  # infer.submit: queue one request on a model's stream


def run(submit: Submit, gw: Gateway, spec: ModelSpec, ensemble: Ensemble, version: int,
        inputs: list[Tensor], outputs: tuple[str, ...], trace: bytes | None, done: Done, priority: int,
        timeout_us: int, timeout: float) -> None:
    """Start the ensemble on `inputs`, queueing each step with `submit` (infer.submit); `done` gets a
    reply with the requested outputs (all when none are named), or the error of the step that failed.
    Like a plain request, a run is callbacks on the dispatcher's replies: no task of its own, unless a
    step has to wake its model."""
    _Run(submit, gw, spec, ensemble, version, trace, done, priority, timeout_us, timeout).start(
        {t.name: t for t in inputs}, outputs)


class _Run:
    def __init__(self, submit: Submit, gw: Gateway, spec: ModelSpec, ensemble: Ensemble, version: int,
                 trace: bytes | None, done: Done, priority: int, timeout_us: int, timeout: float) -> None:
        self.submit = submit
        self.gw, self.spec, self.ensemble, self.version = gw, spec, ensemble, version
        self.trace, self.done = trace, done
        self.priority, self.timeout_us = priority, timeout_us
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.pending = list(ensemble.steps)
        self.running = 0
        self.over = False

    def start(self, tensors: dict[str, Tensor], outputs: tuple[str, ...]) -> None:
        self.tensors = tensors
        self.wanted = outputs or tuple(t.name for t in self.spec.outputs)
        # what will exist: the inputs given and every step's outputs (an optional input that was not
        # given is not waited for)
        self.coming = set(tensors) | {t for s in self.ensemble.steps for _, t in s.outputs}
        self._next()

    def _next(self) -> None:
        try:
            self._advance()
        except Exception as exc:  # a fault here must still answer the caller, never leave it waiting
            log.exception("ensemble %s failed", self.spec.name)
            self._fail(DespinaError(f"ensemble '{self.spec.name}' failed: {exc}", Code.INTERNAL))

    def _advance(self) -> None:
        """Start every step whose tensors exist; answer once nothing runs and nothing is left."""
        tensors, coming = self.tensors, self.coming
        ready = [s for s in self.pending if all(t in tensors or t not in coming for _, t in s.inputs)]
        for step in ready:
            self.pending.remove(step)
            self.running += 1
            self._call(step)
            if self.over:
                return
        if self.running:
            return
        if self.pending:
            missing = sorted({t for s in self.pending for _, t in s.inputs if t not in tensors})
            self._fail(DespinaError(f"ensemble '{self.spec.name}': {self.pending[0]} waits for tensor(s) "
                                    f"{', '.join(missing)} that no step returned", Code.INTERNAL))
            return
        reply = InferReply("", tuple(_renamed(tensors[name], name) for name in self.wanted))
        self.over = True
        self._count(None, rows=self._rows())
        self.done(reply)

    def _call(self, step: Step) -> None:
        version = None if step.version is None else str(step.version)
        try:
            try:
                model, v = self.gw.view.resolve(step.model, version)
            except NotLoaded:  # the slow path: a task waits for the model, then queues the step
                task = asyncio.ensure_future(self._after_wake(step, version))
                self.gw.ensembles.add(task)
                task.add_done_callback(self.gw.ensembles.discard)
                return
            self._queue(step, model.spec, v)
        except DespinaError as exc:
            self._fail(self._named(step, exc))

    async def _after_wake(self, step: Step, version: str | None) -> None:
        try:
            model, v = await self.gw.view.serving(step.model, version, self._left())
            if not self.over:
                self._queue(step, model.spec, v)
        except DespinaError as exc:
            self._fail(self._named(step, exc))
        except asyncio.CancelledError:
            self._fail(Unavailable("the gateway is shutting down"))
            raise

    def _queue(self, step: Step, spec: ModelSpec, v: int) -> None:
        """Queue the step on its model's stream, its inputs renamed to the model's."""
        inputs = []
        for model_input, name in step.inputs:
            t = self.tensors.get(name)
            if t is None:
                continue  # an optional ensemble input the caller left out
            expected = spec.input(model_input)
            if expected is not None:
                check_shape(spec, expected, list(t.shape))
            inputs.append(Tensor(model_input, t.datatype, t.shape, t.data))
        check_inputs(spec, inputs)
        self.submit(self.gw, spec, v, inputs, tuple(o for o, _ in step.outputs), self.trace,
               lambda result: self._settled(step, result), self.priority, self.timeout_us, self._left())

    def _settled(self, step: Step, result: InferReply | DespinaError) -> None:
        if self.over:
            return  # another step failed first: its error was the answer
        self.running -= 1
        if isinstance(result, DespinaError):
            self._fail(self._named(step, result))
            return
        names = dict(step.outputs)
        for t in result.outputs:
            if t.name in names:
                self.tensors[names[t.name]] = t
        self._next()  # the reply reader called us: the next steps go out in this tick's pipeline

    def _fail(self, error: DespinaError) -> None:
        if self.over:
            return
        self.over = True
        self._count(error)
        self.done(error)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"ensemble '{self.spec.name}' ran out of time")
        return left

    def _named(self, step: Step, exc: DespinaError) -> DespinaError:
        code = exc.code
        if code == Code.INVALID_ARGUMENT and any(t not in self.ensemble.inputs for _, t in step.inputs):
            code = Code.INTERNAL  # a tensor another step made does not fit: the ensemble's fault
        elif code == Code.NOT_FOUND:
            code = Code.UNAVAILABLE  # the ensemble exists; a model it calls went away
        return DespinaError(f"ensemble '{self.spec.name}' {step}: {exc.message}", code)

    def _rows(self) -> int:
        if not self.spec.batched:
            return 1
        first = next((self.tensors[n] for n in self.ensemble.inputs if n in self.tensors), None)
        return first.shape[0] if first is not None and first.shape else 1

    def _count(self, error: DespinaError | None, rows: int = 0) -> None:
        """Triton's statistics for the ensemble itself, counted as a worker counts a request: queued
        for no time of its own (its steps queue, and count it, at their models), one execution per
        request. Clients such as perf_analyzer find the version that served by its queue count."""
        us = int((time.monotonic() - self.started) * 1e6)
        reply = InferReply("", (), None if error is None else (error.code, error.message), 0, us)
        counts = tally([reply], 0, 0.0)
        if error is None:
            counts.update(inference_count=rows, execution_count=1)
        self.gw.dispatcher.count(self.gw.keys.stats(self.spec.name, self.version), counts,
                                 int(time.time() * 1000) if error is None else 0)


def _renamed(t: Tensor, name: str) -> Tensor:
    return t if t.name == name else Tensor(name, t.datatype, t.shape, t.data)
