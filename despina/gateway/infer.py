"""The infer hop: HTTP body -> request record on the model's stream -> reply -> HTTP body.

Raw ASGI endpoints: on this path Starlette's Request/Response objects cost a fifth of the time.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..contract.errors import Code, DeadlineExceeded, DespinaError, InvalidArgument
from ..contract.modelconfig import ModelSpec
from ..contract.records import InferReply, InferRequest, Tensor
from . import http
from .fn import decode_fn, encode_fn
from .http import Receive, Scope, Send
from .v2 import decode_infer, encode_infer

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("despina.gateway")

GRACE_S = 0.5  # a worker answering right at the deadline still gets its answer through


class InferEndpoint:
    """POST /v2/models/{model}[/versions/{version}]/infer"""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway
        params = scope["path_params"]
        trace = http.header(scope, b"x-request-id")
        try:
            model, version = await gw.view.serving(params["model"], params.get("version"),
                                                   gw.settings.request_timeout_s)
            body = await http.read_body(scope, receive, gw.settings.max_body_bytes)
            raw_length = http.header(scope, b"inference-header-content-length")
            header_length = _int_header(raw_length) if raw_length is not None else None
            decoded = decode_infer(body, header_length, model.spec, gw.settings.max_tensor_elements)
            priority, timeout_us = schedule_parameters(decoded.parameters)
            reply = await call_model(gw, model.spec, version, decoded.inputs, tuple(decoded.outputs),
                                     trace, priority, timeout_us)
            out, json_length = encode_infer(model.spec.name, version, decoded.id, reply.outputs,
                                            decoded.binary_outputs, decoded.binary_all)
        except DespinaError as exc:
            await _fail(send, exc, scope, trace)
            return
        except ConnectionResetError:
            return
        echo = [(b"x-request-id", trace)] if trace else []
        if json_length is None:
            await http.send(send, 200, out, http.JSON, echo)
        else:
            await http.send(send, 200, out, b"application/octet-stream",
                            [(b"inference-header-content-length", str(json_length).encode()), *echo])


class FunctionEndpoint:
    """POST /fn/{model}: plain JSON in, plain JSON out."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway
        trace = http.header(scope, b"x-request-id")
        try:
            model, version = await gw.view.serving(scope["path_params"]["model"], None,
                                                   gw.settings.request_timeout_s)
            body = await http.read_body(scope, receive, gw.settings.max_body_bytes)
            tensors, squeeze = decode_fn(body, model.spec, gw.settings.max_tensor_elements)
            reply = await call_model(gw, model.spec, version, tensors, (), trace)
            out = encode_fn(reply.outputs, squeeze)
        except DespinaError as exc:
            await _fail(send, exc, scope, trace)
            return
        except ConnectionResetError:
            return
        await http.send(send, 200, out, http.JSON, [(b"x-request-id", trace)] if trace else None)


async def _fail(send: Send, exc: DespinaError, scope: Scope, trace: bytes | None) -> None:
    """Answer an error; log it with the request's id (model failures loudly, the rest at debug)."""
    status, body, extra = http.error_parts(exc)
    level = logging.WARNING if exc.code in (Code.BACKEND, Code.INTERNAL) else logging.DEBUG
    if log.isEnabledFor(level):
        log.log(level, "%s %s -> %d: %s", scope.get("method"), scope.get("path"), status, exc.message,
                extra={"fields": {"request_id": trace.decode("latin-1") if trace else None,
                                  "code": exc.code.value}})
    if trace:
        extra = [*extra, (b"x-request-id", trace)]
    await http.send(send, status, body, http.JSON, extra)


def _int_header(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument("Inference-Header-Content-Length must be an integer") from None


def schedule_parameters(parameters: dict[str, object]) -> tuple[int, int]:
    """Triton's schedule-policy extension: `priority` (1 = highest, 0 = default) and `timeout` (µs)."""
    values = []
    for name in ("priority", "timeout"):
        value = parameters.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(f"parameter '{name}' must be a non-negative integer")
        values.append(value)
    return values[0], values[1]


async def call_model(gw: Gateway, spec: ModelSpec, version: int, inputs: list[Tensor],
                     outputs: tuple[str, ...], trace: bytes | None, priority: int = 0, timeout_us: int = 0
                     ) -> InferReply:
    """Queue one request on the model version's stream (its priority level's) and wait for its reply."""
    model = spec.name
    now = time.time()
    timeout = gw.settings.request_timeout_s
    request = InferRequest(gw.dispatcher.new_id(), gw.dispatcher.reply_stream, now + timeout,
                           tuple(inputs), outputs, priority, timeout_us, now,
                           trace.decode("latin-1") if trace else "")
    level = spec.policy.level(priority)
    stream = gw.keys.request_stream(model, version, level)
    if stream in gw.view.full:  # refused now rather than accepted and then trimmed away
        gw.dispatcher.refused(gw.keys.stats(model, version))
        raise DespinaError(f"model '{model}' has {gw.settings.max_stream_length} or more entries queued "
                           "(max_stream_length); retry later", Code.RESOURCE_EXHAUSTED)
    limit = spec.policy.queue_policy(level).max_queue_size
    bound = (gw.keys.queued(model, version, level), limit) if limit else None
    try:
        reply = await gw.dispatcher.call(stream, gw.keys.stats(model, version), request, timeout + GRACE_S,
                                         bound)
    except TimeoutError:
        raise DeadlineExceeded(f"no answer from model '{model}' within {timeout:g} s") from None
    if reply.error is not None:
        code, message = reply.error
        raise DespinaError(message, Code(code))
    return reply
