"""The infer hop: HTTP body -> request record on the model's stream -> reply -> HTTP body.

A route is called with an exchange whose body is complete and answers it through `respond`, at once
(an error) or when the worker's reply comes back: no task and no coroutine per request. The gateway's
HTTP protocol (protocol.py) calls the routes straight from its parser; `AsgiEndpoint` serves the same routes
under any ASGI server.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .. import clock
from ..contract.ensemble import PLATFORM
from ..contract.errors import Code, DeadlineExceeded, DespinaError, InvalidArgument, ReplyError, Unavailable
from ..contract.modelspec import ModelSpec
from ..contract.records import NO_PARAMETERS, InferReply, InferRequest, Parameters, Tensor
from ..response_cache import cache_key, through
from . import ensemble, http
from .classification import classify
from .compression import SMALLEST, respond_encoded, response_coding
from .fn import decode_fn, encode_fn, form_hint, refuse_stateful
from .grouping import group_rows
from .http import Headers
from .models import Model, NotLoaded
from .v2 import decode_infer
from .v2_fields import int_header, schedule_parameters, sequence_of
from .v2_reply import encode_infer
from .waiters import Result

if TYPE_CHECKING:
    from .app import Gateway
    from .trace import Trace

log = logging.getLogger("despina.gateway")

GRACE_S = 0.5  # a worker answering right at the deadline still gets its answer through
OCTETS = b"application/octet-stream"


class Exchange(Protocol):
    """One request with its whole body, and the way to answer it (once)."""

    method: str
    path: str
    headers: Headers
    params: dict[str, str]
    body: bytes

    def respond(self, status: int, body: bytes, content_type: bytes, extra: Headers) -> None: ...


class Route:
    """What the infer routes share: finding the model (waking it when it is scaled to zero), errors."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._wakes: set[asyncio.Task[None]] = set()

    def __call__(self, ex: Exchange) -> None:
        trace = http.header(ex.headers, b"x-request-id")
        try:
            model, version = self.gateway.view.resolve(ex.params["model"], ex.params.get("version"))
        except NotLoaded:  # the one path that waits before queueing: a task, like any slow path
            try:  # a request its model refuses wakes nobody: its caller hears why at once, not after a load
                if (asleep := self.gateway.view.get(ex.params["model"])).spec is not None:
                    self.refuse(asleep)
                    self.check(ex, asleep)
            except DespinaError as exc:
                fail(ex, exc, trace)
                return
            task = asyncio.ensure_future(self._after_wake(ex, trace))
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)
            return
        except DespinaError as exc:
            fail(ex, exc, trace)
            return
        self._queue(ex, model, version, trace)

    async def _after_wake(self, ex: Exchange, trace: bytes | None) -> None:
        gw = self.gateway
        timeout = gw.settings.request_timeout_s
        woken_by = time.monotonic() + timeout
        try:
            model, version = await gw.view.serving(ex.params["model"], ex.params.get("version"), timeout)
        except DespinaError as exc:
            fail(ex, exc, trace)
            return
        # the wait for the model counts: the request has what is left of its timeout, not a new one
        self._queue(ex, model, version, trace, max(woken_by - time.monotonic(), 0.001))

    def check(self, ex: Exchange, model: Model) -> None:
        """Refuse, before its model is woken, a request that the model's metadata refuses."""  # (none)

    decoupled = False  # whether it takes a decoupled model's several responses to a request
    streams_at = ".../generate_stream"  # where a decoupled model's several responses can be had

    def _queue(self, ex: Exchange, model: Model, version: int, trace: bytes | None,
               timeout: float | None = None) -> None:
        try:
            if model.spec.decoupled:  # (refuse's own test, without its call for the usual model)
                self.refuse(model)
            self.queue(ex, model, version, trace, timeout)
        except DespinaError as exc:
            fail(ex, exc, trace)

    def refuse(self, model: Model) -> None:
        """A decoupled model where this route takes one response: 501, as Triton's HTTP infer refuses one."""
        if model.spec.decoupled and not self.decoupled:
            raise DespinaError("HTTP end point doesn't support models with decoupled transaction policy: "
                               f"model '{model.spec.name}' is decoupled (several responses to a request):"
                               f" call it through {self.streams_at}", Code.UNIMPLEMENTED)

    def queue(self, ex: Exchange, model: Model, version: int, trace: bytes | None,
              timeout: float | None) -> None:
        """Decode the body and submit() it; `timeout` is what is left of the request's (None: all)."""
        raise NotImplementedError


class InferRoute(Route):
    """POST /v2/models/{model}[/versions/{version}]/infer"""

    def queue(self, ex: Exchange, model: Model, version: int, trace: bytes | None,
              timeout: float | None) -> None:
        gw = self.gateway
        arrived = time.time_ns() if gw.tracer.on else 0  # Triton's tracing: REQUEST_START
        decoded = decode_infer(ex.body, self.header_length(ex), model.spec, gw.settings.max_tensor_elements,
                               gw.shm)
        spec = model.spec
        if decoded.parameters or spec.sequence:
            priority, timeout_us = schedule_parameters(decoded.parameters)
            sequence = sequence_of(spec, decoded.parameters)
        else:  # what the two make of no parameters for a plain model, without their calls
            priority = timeout_us = 0
            sequence = None
        echo = [(b"x-request-id", trace)] if trace else []
        respond = self.respond
        name = self.answered_as(ex, spec)
        heads = decoded.heads if name == spec.name else None  # the headers remembered name the model

        # answering()'s callback with the answer written in it: a call less a request
        def answer(result: InferReply | DespinaError) -> None:
            if isinstance(result, DespinaError):
                fail(ex, result, trace)
                return
            try:
                outputs = result.outputs
                if decoded.classes:  # Triton's classification extension: their top classes instead
                    outputs = classify(spec, outputs, decoded.classes, model.entry.labels)
                out, json_length = encode_infer(name, version, decoded.id, outputs, decoded.binary_outputs,
                                                decoded.binary_all, heads, result.parameters,
                                                decoded.shm_outputs)
                respond(ex, out, json_length, echo)
            except Exception as exc:
                answer_failed(ex, exc, trace)

        done: Callable[[InferReply | DespinaError], None] = answer

        traced = gw.tracer.begin(spec.name, version, decoded.id or "", arrived) if arrived else None
        if traced is None:
            submit(gw, model.spec, version, decoded.inputs, tuple(decoded.outputs), trace, done, priority,
                   timeout_us, timeout, decoded.model_parameters, decoded.id or "", sequence)
        else:
            done = gw.tracer.ending(traced, done, computes=spec.platform != PLATFORM)
            traced.over_http(ex)
            traced.inputs(decoded.inputs)
            traced.queue()
            submit(gw, model.spec, version, decoded.inputs, tuple(decoded.outputs), trace, done, priority,
                   timeout_us, timeout, decoded.model_parameters, decoded.id or "", sequence, traced=traced)
        # the request holds its inputs until it is written, and its answer needs neither them nor the body:
        # a large request is not kept twice over while its answer is awaited
        ex.body, decoded.inputs = b"", []

    def check(self, ex: Exchange, model: Model) -> None:
        spec, gw = model.spec, self.gateway
        decoded = decode_infer(ex.body, self.header_length(ex), spec, gw.settings.max_tensor_elements, gw.shm)
        schedule_parameters(decoded.parameters)
        sequence_of(spec, decoded.parameters)

    def answered_as(self, ex: Exchange, spec: ModelSpec) -> str:
        """The model's name in the answer: its own."""
        return spec.name

    def header_length(self, ex: Exchange) -> int | None:
        """The JSON header's length in a body with binary tensors (None: the body is all JSON)."""
        raw = http.header(ex.headers, b"inference-header-content-length")
        return int_header(raw) if raw is not None else None

    @staticmethod
    def respond(ex: Exchange, out: bytes, json_length: int | None, echo: Headers) -> None:
        """The answer as encode_infer made it: all JSON, or a JSON header of json_length and tensors;
        compressed whole where the request's Accept-Encoding asks (compression.py)."""
        if json_length is None:
            content_type, extra = http.JSON, echo
        else:
            content_type, extra = OCTETS, [(b"inference-header-content-length", b"%d" % json_length), *echo]
        # (a small answer goes as it is: its headers are not even looked at)
        coding = response_coding(ex.headers) if len(out) >= SMALLEST else None
        if coding is None:
            ex.respond(200, out, content_type, extra)
        else:
            respond_encoded(ex.respond, out, content_type, extra, coding)


class FunctionRoute(Route):
    """POST /fn/{model}: plain JSON in, plain JSON out."""

    def check(self, ex: Exchange, model: Model) -> None:
        self.decode(ex, model)

    def decode(self, ex: Exchange, model: Model) -> tuple[list[Tensor], bool]:
        refuse_stateful(self.gateway.view.models, model)
        try:
            return decode_fn(ex.body, model.spec, self.gateway.settings.max_tensor_elements)
        except InvalidArgument as exc:
            raise form_hint(exc, http.header(ex.headers, b"content-type")) from None

    def queue(self, ex: Exchange, model: Model, version: int, trace: bytes | None,
              timeout: float | None) -> None:
        tensors, squeeze = self.decode(ex, model)
        echo = [(b"x-request-id", trace)] if trace else []

        def answer(reply: InferReply) -> None:
            ex.respond(200, encode_fn(reply.outputs, squeeze), http.JSON, echo)

        submit(self.gateway, model.spec, version, tensors, (), trace, answering(ex, trace, answer),
               timeout=timeout)
        ex.body = b""  # (as InferRoute's)


def answering(ex: Exchange, trace: bytes | None, answer: Callable[[InferReply], None]
              ) -> Callable[[InferReply | DespinaError], None]:
    """The callback a queued request ends in: its answer, or its error (an unexpected fault included)."""
    def done(result: InferReply | DespinaError) -> None:
        if isinstance(result, DespinaError):
            fail(ex, result, trace)
            return
        try:
            answer(result)
        except Exception as exc:
            answer_failed(ex, exc, trace)
    return done


def answer_failed(ex: Exchange, exc: Exception, trace: bytes | None) -> None:
    """Answering failed (called where the exception is handled): the error's answer, or, for an unexpected
    fault, an internal error's, logged with its traceback."""
    if isinstance(exc, DespinaError):
        fail(ex, exc, trace)
        return
    log.exception("encoding the answer of %s failed", ex.path)
    fail(ex, DespinaError("encoding the answer failed (the gateway's log has the details)", Code.INTERNAL),
         trace)


def fail(ex: Exchange, exc: DespinaError, trace: bytes | None, status: int | None = None,
         body: bytes | None = None, content_type: bytes = http.JSON) -> None:
    """Answer an error (`status` and `body` where not the code's and its JSON); log it with the request's
    id (model failures loudly, the rest at debug)."""
    own_status, own_body, extra = http.error_parts(exc)
    if status is None:
        status = own_status
    else:
        extra = []  # (a Retry-After, say, is the code's status's)
    body = own_body if body is None else body
    level = logging.WARNING if exc.code in (Code.BACKEND, Code.INTERNAL) else logging.DEBUG
    if log.isEnabledFor(level):
        log.log(level, "%s %s -> %d: %s", ex.method, ex.path, status, exc.message,
                extra={"fields": {"request_id": trace.decode("latin-1") if trace else None,
                                  "code": exc.code.value}})
    if trace:
        extra = [*extra, (b"x-request-id", trace)]
    ex.respond(status, body, content_type, extra)


def submit(gw: Gateway, spec: ModelSpec, version: int, inputs: list[Tensor], outputs: tuple[str, ...],
           trace: bytes | None, done: Callable[[InferReply | DespinaError], None], priority: int = 0,
           timeout_us: int = 0, timeout: float | None = None, parameters: Parameters = NO_PARAMETERS,
           request_id: str = "", sequence: tuple[int | str, int] | None = None,
           partial: Callable[[InferReply], None] | None = None, traced: Trace | None = None,
           timed: bool = False) -> str | None:
    """Queue one request on the model version's stream (its priority level's); `done` gets the reply,
    or the DespinaError that ended it (the model's own, a timeout, a full queue, Redis down), and
    `partial` a decoupled model's responses before its last one (an error among them included). The
    request's id with the dispatcher (for Dispatcher.cancel), or None for an ensemble run from here.
    `timeout` (default: request_timeout_s) is how long it may still take; `parameters` and `request_id`
    (the client's V2 "id") are for the model (an ensemble's steps get neither), as is `sequence` (its
    correlation ID and flags) for a model with sequence batching. `traced`: the request's trace, when it
    is traced (an ensemble run from here traces its steps as its children). Its reply splits its compute
    (InferReply.split) when it is traced or `timed` (an ensemble's step run from here)."""
    model = spec.name
    if gw.cache is not None and spec.response_cache and sequence is None and spec.sequence is None:
        keeping = cached(gw, spec, version, inputs, outputs, parameters, done)
        if keeping is None:  # answered from the cache
            return None
        done = keeping
    timeout = gw.settings.request_timeout_s if timeout is None else timeout
    if spec.platform == PLATFORM and version not in gw.view.ready.get(model, ()):
        # no worker runs the ensemble (its models are apart, or scaled to zero): its steps go from here
        graph = gw.view.get(model).ensemble
        if graph is None:
            raise Unavailable(f"ensemble '{model}' cannot be read by this gateway")
        ensemble.run(submit, gw, spec, graph, version, inputs, outputs, trace, done, priority, timeout_us,
                     timeout, sequence, traced, partial)
        return None
    now = clock.now()
    request = InferRequest(gw.dispatcher.new_id(), gw.dispatcher.reply_stream, now + timeout,
                           tuple(inputs), outputs, priority, timeout_us, now,
                           trace.decode("latin-1") if trace else "", parameters, request_id, sequence,
                           timed or traced is not None)
    stream, stats, bound, rows = lane(gw, spec, version, priority)
    if stream in gw.view.full:  # refused now rather than accepted and then trimmed away
        gw.dispatcher.refused(stats)
        raise DespinaError(f"model '{model}' has {gw.settings.max_stream_length} or more entries queued "
                           "(max_stream_length); retry later", Code.RESOURCE_EXHAUSTED)

    def settled(result: Result) -> None:
        if isinstance(result, InferReply):
            if not result.final:
                if partial is not None:
                    partial(result)
                return
            if result.error is None:
                done(result)
                return
            code, message = result.error
            done(ReplyError(message, Code(code)))
        elif isinstance(result, DespinaError):
            done(result)
        elif isinstance(result, TimeoutError):  # the time it had: less than the whole when woken, or a step
            done(DeadlineExceeded(f"no answer from model '{model}' within {round(timeout, 3):g} s"))
        else:
            done(DespinaError(f"queueing the request failed: {result}", Code.INTERNAL))

    gw.dispatcher.submit(stream, stats, request, timeout + GRACE_S, settled, bound, rows)
    return request.id


Lane = tuple[str, str, tuple[str, int] | None, int]  # lane(): stream, statistics hash, bound, group rows
LANES_MAX = 1024


def lane(gw: Gateway, spec: ModelSpec, version: int, priority: int) -> Lane:
    """Where a model version's requests of a priority go, worked out once (a model loaded again has a new
    spec): the request stream of its level, its statistics hash, its queue's bound (the counter and
    max_queue_size) or None, and the most rows its requests may be grouped into."""
    key = (spec.name, version, priority)
    known = gw.lanes.get(key)
    if known is not None and known[0] is spec:
        return known[1]
    level = spec.policy.level(priority)
    limit = spec.policy.queue_policy(level).max_queue_size
    found = (gw.keys.request_stream(spec.name, version, level), gw.keys.stats(spec.name, version),
             (gw.keys.queued(spec.name, version, level), limit) if limit else None, group_rows(spec))
    if len(gw.lanes) >= LANES_MAX:
        gw.lanes.clear()
    gw.lanes[key] = (spec, found)
    return found


def cached(gw: Gateway, spec: ModelSpec, version: int, inputs: list[Tensor], outputs: tuple[str, ...],
           parameters: Parameters, done: Callable[[InferReply | DespinaError], None]
           ) -> Callable[[InferReply | DespinaError], None] | None:
    """Answer from the response cache (then None), or the callback that keeps the answer as well as
    giving it (response_cache.py), keyed by the files' revision (ModelView.revision)."""
    cache = gw.cache
    assert cache is not None
    revision = gw.view.revision(spec.name, version)
    if revision is None:  # a rollout under way: the answer may come from either side
        return done
    stats = gw.keys.stats(spec.name, version)

    def keeps(result: InferReply | DespinaError) -> bool:  # and the files did not change meanwhile
        return isinstance(result, InferReply) and gw.view.revision(spec.name, version) == revision

    return through(cache, cache_key(spec.name, version, revision, inputs, outputs, parameters), done,
                   lambda counts: gw.dispatcher.count(stats, counts), keeps)

