"""Models calling models: Triton's business logic scripting, a Python model's `InferenceRequest.exec()`.

A call goes to a READY runner on this worker when it has the version asked for (the latest serving one
when none is), queued into that runner's batcher as an ensemble's step is (workers/ensembles.py);
otherwise onto the model's request stream, as a gateway queues it, with a Dispatcher of this worker's
own and a view of which versions serve. Either way it is batched and counted in the called model's
statistics like any request, and its answer, or its error, comes by its deadline. A decoupled model is
called with exec(decoupled=True): `partial` gets each of its responses but the last, in order, and the
call returns the last (no outputs when the model ended with the final flag alone).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from .. import clock
from ..contract.datatypes import numpy_to_v2, to_bytes
from ..contract.ensemble import Ensemble
from ..contract.errors import Code, DeadlineExceeded, DespinaError, InvalidArgument, Unavailable
from ..contract.modelspec import (
    ModelSpec,
    check_datatype,
    check_inputs,
    check_shape,
    known_input,
    known_output,
)
from ..contract.records import NO_PARAMETERS, InferReply, InferRequest, Parameters, Tensor
from ..gateway.dispatch import Dispatcher
from ..gateway.models import ModelView, NotLoaded
from ..gateway.waiters import Result
from .backends.base import Outputs as ModelOutputs

if TYPE_CHECKING:
    from .runner import ModelRunner
    from .worker import Worker

log = logging.getLogger("despina.worker")

Sequence = tuple[int | str, int]  # (correlation ID, START|END flags): contract/sequence.py
GRACE_S = 0.5  # past the deadline, the call's own wait still leaves the runner or the worker time to answer
Outputs = dict[str, np.ndarray]
Partial = Callable[[Outputs | DespinaError], None]  # a decoupled model's response before its last
CANCELLED = "the calling model cancelled the call"
RUNS_POLL_S = 0.05  # how often a call of an ensemble whose models were woken looks for a worker that runs it


class Cancel:
    """How the model that made a call of a decoupled model cancels it (exec(decoupled=True)'s
    ResponseIterator.cancel()): `ask()`, on the loop it was made on. The call ends at once with a
    CANCELLED error; the called model hears of it with its next response (request.is_cancelled()), as
    of a client gone."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.asked = False
        self._then: Callable[[], object] | None = None

    def ask(self) -> None:
        if not self.asked:
            self.asked = True
            if self._then is not None:
                self._then()

    def then(self, action: Callable[[], object]) -> None:
        """What a cancellation does, now if one was asked already."""
        self._then = action
        if self.asked:
            action()


class ModelCaller:
    """One per worker, made on its event loop: `infer` runs there (`loop` is for callers on threads)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self._remote: tuple[Dispatcher, ModelView] | None = None  # made by the first call that needs them
        self._opening = asyncio.Lock()

    async def infer(self, model: str, version: int | None, inputs: dict[str, np.ndarray], outputs: list[str],
                    timeout_s: float = 0.0, parameters: Parameters = NO_PARAMETERS,
                    sequence: Sequence | None = None, partial: Partial | None = None, request_id: str = "",
                    cancel: Cancel | None = None) -> Outputs | DespinaError:
        """Run `model` (`version`, None: the latest) on `inputs`; the asked `outputs` (none: all), or the
        error that ended the call. `timeout_s` (0: the server's request_timeout_s) bounds the whole call,
        and when set is the called request's timeout, as Triton sets a BLS request's (its queue policy's
        override, what the called model's request.timeout() says);
        `sequence` (correlation ID, flags) places it in a sequence of a stateful model; `request_id` is
        what the called model's request.request_id() says. With `partial` (exec(decoupled=True)) a
        decoupled model may be called: its responses before the last go there, and `cancel` may end the
        call early. Outputs carry the called model's response parameters (backends.base.Outputs) when it
        set some."""
        timeout = timeout_s if timeout_s > 0 else self.worker.settings.request_timeout_s
        timeout_us = round(timeout_s * 1e6) if timeout_s > 0 else 0
        try:
            tensors = [_tensor(name, array) for name, array in inputs.items()]
            runner = self._local(model, version)
            if runner is not None:
                call = self._here(runner, tensors, tuple(outputs), (timeout, timeout_us), parameters,
                                  sequence, partial, request_id, cancel)
            else:
                call = self._through_redis(model, version, tensors, tuple(outputs), (timeout, timeout_us),
                                           parameters, sequence, partial, request_id, cancel)
            reply = await asyncio.wait_for(call, timeout + GRACE_S)
        except DespinaError as exc:
            return exc
        except TimeoutError:
            return DeadlineExceeded(f"no answer from model '{model}' within {timeout:g} s")
        except Exception as exc:  # a fault here must reach the calling model as an error, never hang it
            log.exception("worker %s: calling model %s failed", self.worker.id, model)
            return DespinaError(f"calling model '{model}' failed: {exc}", Code.INTERNAL)
        return _result(reply)

    def _local(self, model: str, version: int | None) -> ModelRunner | None:
        """The READY runner here for the version a gateway would pick, if this worker has it."""
        entry = self.worker.catalog.get(model)
        if entry is None or not entry.versions:
            return None
        if version is None:
            current = [v for v in entry.versions if v not in entry.retiring]
            version = max(current or entry.versions)
        runner = self.worker.runners.get((model, version))
        return runner if runner is not None and runner.state == "READY" else None

    async def _here(self, runner: ModelRunner, tensors: list[Tensor], outputs: tuple[str, ...],
                    timeouts: tuple[float, int], parameters: Parameters, sequence: Sequence | None,
                    partial: Partial | None, request_id: str, cancel: Cancel | None) -> InferReply:
        """`timeouts`: the call's in seconds, and the request's in µs (0: none asked), as in infer()."""
        timeout, timeout_us = timeouts
        _check(runner.spec, tensors, outputs, partial is not None)
        answered: asyncio.Future[InferReply] = self.loop.create_future()

        def answer(reply: InferReply) -> bool:
            """(True: the call was cancelled, and the runner tells the called model)"""
            if not answered.done():
                if not reply.final:  # a decoupled model's response before its last
                    _pass_on(partial, reply)
                else:
                    answered.set_result(reply)
            return cancel is not None and cancel.asked

        def cancelled() -> None:
            if not answered.done():
                reason = f"calling model '{runner.spec.name}': {CANCELLED}"
                answered.set_result(InferReply("", error=(Code.CANCELLED, reason)))

        if cancel is not None:
            cancel.then(cancelled)

        runner.submit(tensors, outputs, clock.now() + timeout, answer, timeout_us=timeout_us,
                      parameters=parameters, sequence=sequence, request_id=request_id)
        return await answered

    async def _through_redis(self, model: str, version: int | None, tensors: list[Tensor],
                             outputs: tuple[str, ...], timeouts: tuple[float, int], parameters: Parameters,
                             sequence: Sequence | None, partial: Partial | None, request_id: str,
                             cancel: Cancel | None) -> InferReply:
        timeout, timeout_us = timeouts
        dispatcher, view = await self._open()
        keys = self.worker.keys
        deadline = time.monotonic() + timeout
        found, v = await view.serving(model, None if version is None else str(version), timeout)
        if found.ensemble is not None and v not in view.ready.get(model, ()):
            await _ensemble_run(view, model, found.ensemble, v, deadline)
        spec = found.spec
        _check(spec, tensors, outputs, partial is not None)
        level = spec.policy.level(0)
        stream = keys.request_stream(model, v, level)
        stats = keys.stats(model, v)
        if stream in view.full:
            dispatcher.refused(stats)
            raise DespinaError(f"model '{model}' has too many requests queued (max_stream_length); retry "
                               "later", Code.RESOURCE_EXHAUSTED)
        limit = spec.policy.queue_policy(level).max_queue_size
        bound = (keys.queued(model, v, level), limit) if limit else None
        now = clock.now()
        request = InferRequest(dispatcher.new_id(), dispatcher.reply_stream, now + timeout, tuple(tensors),
                               outputs, timeout_us=timeout_us, enqueued=now, parameters=parameters,
                               request_id=request_id, sequence=sequence)
        answered: asyncio.Future[Result] = self.loop.create_future()

        def settle(result: Result) -> None:
            if answered.done():
                return
            if isinstance(result, InferReply) and not result.final:  # the Dispatcher keeps their order
                _pass_on(partial, result)
                return
            answered.set_result(result)

        dispatcher.submit(stream, stats, request, timeout + GRACE_S, settle, bound)
        if cancel is not None:  # (its worker tells the called model with its next response)
            cancel.then(lambda: dispatcher.cancel(request.id, f"calling model '{model}': {CANCELLED}"))
        result = await answered
        if isinstance(result, InferReply):
            return result
        if isinstance(result, DespinaError):
            raise result
        if isinstance(result, TimeoutError):
            raise DeadlineExceeded(f"no answer from model '{model}' within {timeout:g} s")
        raise DespinaError(f"queueing the request failed: {result}", Code.INTERNAL)

    async def _open(self) -> tuple[Dispatcher, ModelView]:
        async with self._opening:
            if self._remote is None:
                worker = self.worker
                dispatcher = Dispatcher(worker.redis, worker.keys, f"{worker.id}.calls",
                                        worker.delivery.reply_ttl_ms, hold_us=0)
                view = ModelView(worker.redis, worker.keys, worker.settings.max_stream_length)
                await dispatcher.start()
                await view.start()
                self._remote = (dispatcher, view)
            return self._remote

    async def close(self) -> None:
        """After the runners stopped: calls still waiting on Redis are answered UNAVAILABLE."""
        if self._remote is not None:
            dispatcher, view = self._remote
            self._remote = None
            await view.close()
            await dispatcher.close()


async def _ensemble_run(view: ModelView, model: str, graph: Ensemble, v: int, deadline: float) -> None:
    """Wait, by `deadline` (monotonic), for a worker to run an ensemble that none runs: one does once the
    models it calls serve together. Those scaled to zero are woken, as a client's request for the ensemble
    wakes them; where none was, they serve apart, and no worker will run it."""
    if not await _wake_steps(view, graph, deadline):
        raise Unavailable(f"ensemble '{model}' runs on no worker (its models are apart): a model may call "
                          "it only where one runs it")
    while v not in view.ready.get(model, ()):
        if time.monotonic() >= deadline:
            raise Unavailable(f"ensemble '{model}' runs on no worker (its models are apart, or still "
                              "loading): a model may call it only where one runs it")
        await asyncio.sleep(RUNS_POLL_S)


async def _wake_steps(view: ModelView, graph: Ensemble, deadline: float) -> bool:
    """Wake the models an ensemble calls (those of the ensembles it calls too) that no worker has READY;
    whether there was one."""
    waking: list[Awaitable[object]] = []  # the models woken, each until it serves
    inner: list[Awaitable[bool]] = []  # the ensembles called that no worker runs
    for step in graph.steps:
        version = None if step.version is None else str(step.version)
        try:
            found, v = view.resolve(step.model, version)
        except NotLoaded:
            waking.append(view.serving(step.model, version, max(deadline - time.monotonic(), 0.001)))
            continue
        if found.ensemble is not None and v not in view.ready.get(step.model, ()):
            inner.append(_wake_steps(view, found.ensemble, deadline))
    _, woke_inside = await asyncio.gather(asyncio.gather(*waking), asyncio.gather(*inner))
    return bool(waking) or any(woke_inside)


def _tensor(name: str, array: np.ndarray) -> Tensor:
    datatype = numpy_to_v2(array.dtype)
    return Tensor(name, datatype, tuple(array.shape), to_bytes(array, datatype))


def _pass_on(partial: Partial | None, reply: InferReply) -> None:
    """A response before the last to the caller that takes them (a decoupled call always has one)."""
    if partial is None:
        return
    try:
        partial(_result(reply))
    except Exception:  # the caller's fault must not stop the call's other responses
        log.exception("passing on a response of a model call failed")


def _result(reply: InferReply) -> Outputs | DespinaError:
    """A reply as the caller takes it: its error, or its outputs with the response parameters the called
    model set (Triton's BLS response.parameters())."""
    if reply.error is not None:
        return DespinaError(reply.error[1], reply.error[0])
    outputs = {t.name: t.numpy() for t in reply.outputs}
    return ModelOutputs(outputs, reply.parameters) if reply.parameters else outputs


def _check(spec: ModelSpec, tensors: list[Tensor], outputs: tuple[str, ...], decoupled: bool = False) -> None:
    """The call's inputs and asked outputs against the called model's config, as a gateway checks them."""
    if spec.decoupled and not decoupled:  # its several responses need exec(decoupled=True)
        raise InvalidArgument(f"calling model '{spec.name}': it is decoupled (several responses to a "
                              "request): call it with exec(decoupled=True)")
    try:
        for t in tensors:
            expected = known_input(spec, t.name)
            check_datatype(expected, t.datatype)
            check_shape(spec, expected, list(t.shape))
        check_inputs(spec, tensors)
        for name in outputs:
            known_output(spec, name)
    except InvalidArgument as exc:
        raise InvalidArgument(f"calling model '{spec.name}': {exc.message}") from None
