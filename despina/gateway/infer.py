"""The infer hop: HTTP body -> request record on the model's stream -> reply -> HTTP body.

Raw ASGI endpoints: on this path Starlette's Request/Response objects cost a fifth of the time.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..contract.errors import Code, DeadlineExceeded, DespinaError, InvalidArgument
from ..contract.records import InferReply, InferRequest, Tensor
from . import http
from .fn import decode_fn, encode_fn
from .http import Receive, Scope, Send
from .v2 import decode_infer, encode_infer

if TYPE_CHECKING:
    from .app import Gateway

GRACE_S = 0.5  # a worker answering right at the deadline still gets its answer through


class InferEndpoint:
    """POST /v2/models/{model}[/versions/{version}]/infer"""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway
        params = scope["path_params"]
        try:
            model, version = gw.view.resolve(params["model"], params.get("version"))
            body = await http.read_body(scope, receive, gw.settings.max_body_bytes)
            raw_length = http.header(scope, b"inference-header-content-length")
            header_length = _int_header(raw_length) if raw_length is not None else None
            decoded = decode_infer(body, header_length, model.spec)
            reply = await gw.infer(model.spec.name, version, decoded.inputs, tuple(decoded.outputs),
                                   http.header(scope, b"x-request-id"))
            out, json_length = encode_infer(model.spec.name, version, decoded.id, reply.outputs,
                                            decoded.binary_outputs, decoded.binary_all)
        except DespinaError as exc:
            await http.send_error(send, exc)
            return
        except ConnectionResetError:
            return
        if json_length is None:
            await http.send(send, 200, out)
        else:
            await http.send(send, 200, out, b"application/octet-stream",
                            [(b"inference-header-content-length", str(json_length).encode())])


class FunctionEndpoint:
    """POST /fn/{model}: plain JSON in, plain JSON out."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway
        try:
            model, version = gw.view.resolve(scope["path_params"]["model"], None)
            body = await http.read_body(scope, receive, gw.settings.max_body_bytes)
            tensors, squeeze = decode_fn(body, model.spec)
            reply = await gw.infer(model.spec.name, version, tensors, (), http.header(scope, b"x-request-id"))
            out = encode_fn(reply.outputs, squeeze)
        except DespinaError as exc:
            await http.send_error(send, exc)
            return
        except ConnectionResetError:
            return
        await http.send(send, 200, out)


def _int_header(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument("Inference-Header-Content-Length must be an integer") from None


async def call_model(gw: Gateway, model: str, version: int, inputs: list[Tensor], outputs: tuple[str, ...],
                     trace: bytes | None) -> InferReply:
    """Queue one request on the model version's stream and wait for its reply (or the deadline)."""
    now = time.time()
    timeout = gw.settings.request_timeout_s
    request = InferRequest(gw.dispatcher.new_id(), gw.dispatcher.reply_stream, now + timeout,
                           tuple(inputs), outputs, 0, 0, now, trace.decode("latin-1") if trace else "")
    stream = gw.keys.request_stream(model, version)
    try:
        reply = await gw.dispatcher.call(stream, request, timeout + GRACE_S)
    except TimeoutError:
        raise DeadlineExceeded(f"no answer from model '{model}' within {timeout:g} s") from None
    if reply.error is not None:
        code, message = reply.error
        raise DespinaError(message, Code(code))
    return reply
