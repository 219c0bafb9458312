"""Ensembles run by the gateway that took the request: each step is an ordinary request to the model it
calls, queued on that model's stream and batched there with everyone else's requests.

The gateway runs an ensemble when no worker runs it itself (a worker does when it has every model the
ensemble calls, workers/ensembles.py): when its steps' models are on different workers, or scaled to
zero — a step whose model is scaled to zero wakes it, as a direct request would. The graph is
contract.ensemble_run.Run's; the ensemble's own statistics (requests, failures, latency) are counted here,
each step's in its model's statistics.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import clock, summaries
from ..contract.ensemble import PLATFORM, Ensemble, Step
from ..contract.ensemble_run import Run
from ..contract.errors import DespinaError, Unavailable
from ..contract.modelspec import ModelSpec
from ..contract.records import InferReply, Tensor
from ..workers.stats import ensemble_counts
from .models import NotLoaded

if TYPE_CHECKING:
    from .app import Gateway
    from .trace import Trace

Done = Callable[[InferReply | DespinaError], None]
Submit = Callable[..., str | None]  # infer.submit: queue one request on a model's stream


def run(submit: Submit, gw: Gateway, spec: ModelSpec, ensemble: Ensemble, version: int,
        inputs: list[Tensor], outputs: tuple[str, ...], trace: bytes | None, done: Done, priority: int,
        timeout_us: int, timeout: float, sequence: tuple[int | str, int] | None = None,
        traced: Trace | None = None, partial: Callable[[InferReply], None] | None = None) -> None:
    """Start the ensemble on `inputs`, queueing each step with `submit` (infer.submit); `done` gets a
    reply with the requested outputs (all when none are named), or the error of the step that failed.
    Like a plain request, a run is callbacks on the dispatcher's replies: no task of its own, unless a
    step has to wake its model. Every step carries the request's `sequence`, if any; a `traced` request's
    steps are traced as its children (Triton's child traces). An ensemble with a decoupled step gives
    `partial` each of its responses, and `done` then the final flag alone."""
    run = _GatewayRun(submit, gw, spec, ensemble, version, trace, done, priority, timeout_us, timeout,
                      sequence, traced)
    if partial is not None:
        run.partial = partial
    run.start(inputs, outputs)


class _GatewayRun(Run):
    def __init__(self, submit: Submit, gw: Gateway, spec: ModelSpec, ensemble: Ensemble, version: int,
                 trace: bytes | None, done: Done, priority: int, timeout_us: int, timeout: float,
                 sequence: tuple[int | str, int] | None = None, traced: Trace | None = None) -> None:
        super().__init__(spec, ensemble, timeout)
        self.submit, self.gw, self.version = submit, gw, version
        self.trace, self.done = trace, done
        self.priority, self.timeout_us = priority, timeout_us
        self.sequence = sequence
        self.traced = traced

    def _call_in(self, run: Run, step: Step) -> None:
        """Queue `run`'s step: this run's, or a branch's (a decoupled step's response going on)."""
        version = None if step.version is None else str(step.version)
        try:
            model, v = self.gw.view.resolve(step.model, version)
        except NotLoaded:  # the slow path: a task waits for the model, then queues the step
            task = asyncio.ensure_future(self._after_wake(run, step, version))
            self.gw.ensembles.add(task)
            task.add_done_callback(self.gw.ensembles.discard)
            return
        self._queue(run, step, model.spec, v)

    async def _after_wake(self, run: Run, step: Step, version: str | None) -> None:
        try:
            model, v = await self.gw.view.serving(step.model, version, run.left())
            if not run.over and not self.over:  # (a branch's run goes on after its request failed)
                self._queue(run, step, model.spec, v)
        except DespinaError as exc:
            run.fail(run.named(step, exc))
        except asyncio.CancelledError:
            run.fail(Unavailable("the gateway is shutting down"))
            raise

    def _queue(self, run: Run, step: Step, spec: ModelSpec, v: int) -> None:
        """Queue the step on its model's stream; the reply reader calls back (and the steps it
        completes go out in that tick's pipeline). A decoupled step's responses before its last each
        go on through the steps after it."""
        inputs = run.step_inputs(step, spec)  # (before a child trace opens: it may refuse them)
        done: Done = lambda result: run.settled(step, result)  # noqa: E731
        child = None
        if self.traced is not None:
            child = self.gw.tracer.child(self.traced, spec.name, v)
            done = self.gw.tracer.ending(child, done, computes=spec.platform != PLATFORM)
            child.queue()
            child.inputs(inputs)
        partial = None
        if spec.decoupled:
            run.stream_from(step)
            partial = lambda reply: run.streamed(step, reply)  # noqa: E731
        self.submit(self.gw, spec, v, inputs, tuple(o for o, _ in step.outputs),
                    self.trace, done, self.priority, self.timeout_us, run.left(), sequence=self.sequence,
                    traced=child, partial=partial, timed=True)

    def _finish(self, result: InferReply | DespinaError, rows: int) -> None:
        us = int((time.monotonic() - self.started) * 1e6)
        error = result if isinstance(result, DespinaError) else None
        counts = ensemble_counts(error, us, rows, compute_ns=self.compute_ns)
        if error is None and self.gw.latencies is not None:
            summaries.observe_ensemble(self.gw.latency_window(self.spec.name, self.version), us, 0,
                                       self.compute_ns)
        if rows:
            counts["last_inference"] = int(clock.now() * 1000)
        self.gw.dispatcher.count(self.gw.keys.stats(self.spec.name, self.version), counts)
        self.done(result)
