"""Triton's generate extension: `POST /v2/models/{m}[/versions/{v}]/generate` and `.../generate_stream`.

A flat JSON object in, as Triton maps one ("exact mapping"): a key that names one of the model's inputs is
that input (a string, number or boolean is one element, a list its elements, in the model's shape with the
batch dimension as -1: each -1 but the last is 1, the last what the count leaves for it; nested lists,
which Triton refuses, their own shape), beside "parameters" or in it; every other key is a request
parameter that reaches the model as it came (an integer past int64 as a double, as Triton holds it;
priority, timeout, sequence_id and binary_data_output too: Triton's generate reads none of them), and a
string "id" the request's id too. A flat JSON object out:
model_name, model_version, the request's id, each response parameter and each output by name (one
element as a scalar, more as one flat list whatever the shape, as Triton writes them; BYTES as text), its
keys sorted as Triton 2.51 writes them.

/generate answers that object as application/json. /generate_stream answers it as a server-sent event
(`data: {...}`, text/event-stream) per response of the model: one, or, from a decoupled model, each as it
sends it until its last (the stream then ends; a bare final flag adds no event). A request refused before
it reaches the model gets a JSON error with its status from either route. A failure of inference itself
(the model's error response, whatever code it gave, or its execute raising) is a 400, as Triton 2.51
answers it: from /generate a JSON error, from /generate_stream an event `data: {"error": "..."}`, under
400 when it is the first response and 200 after a good one (Triton sets a stream's status from its
first response). /generate takes a decoupled model's answer when it is one response, and otherwise says
to use /generate_stream in Triton's words, under a 400 (Triton's is a 200 carrying the error).
"""
from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import orjson

from ..contract.errors import Code, DespinaError, InvalidArgument, ReplyError
from ..contract.modelspec import ModelSpec, check_inputs, check_shape, known_input
from ..contract.records import NO_PARAMETERS, InferReply, Parameters, Tensor
from . import http
from .asgi_endpoint import AsgiEndpoint, AsgiExchange
from .fn import plain, shape_of
from .http import Headers, Receive, Scope, Send, loads
from .infer import Exchange, Route, answering, fail, submit
from .jsondata import json_data_to_bytes, nonfinite_json
from .models import Model
from .v2 import MAX_ELEMENTS
from .v2_fields import check_count, sequence_of

if TYPE_CHECKING:
    from .app import Gateway

EVENT_STREAM = b"text/event-stream; charset=utf-8"
# Triton's status for a request whose inference failed, whatever the error's code (the model's choice):
# /generate's JSON error and the first event of /generate_stream's stream
FAILED = 400
_SCALARS = (str, int, float, bool)
INT64 = (-(1 << 63), (1 << 63) - 1)
# a decoupled model's 0 or 2+ responses to /generate, in Triton's words (under a 400, not Triton's 200)
NOT_ONE = ("generate expects model to produce exactly 1 response, use generate stream for model that "
           "generates various number of responses")
_KEY_END = re.compile(rb'"\s*:')  # the end of each key of a JSON object (and of some strings' text)


class GenerateRoute(Route):
    """POST /v2/models/{model}[/versions/{version}]/generate, or /generate_stream with `stream`."""

    decoupled = True
    several = NOT_ONE  # the error for a decoupled model's 0 or 2+ responses

    def __init__(self, gateway: Gateway, stream: bool) -> None:
        super().__init__(gateway)
        self.stream = stream

    def check(self, ex: Exchange, model: Model) -> None:
        spec = model.spec
        sequence_of(spec, decode_generate(ex.body, spec, self.gateway.settings.max_tensor_elements)[1])

    def queue(self, ex: Exchange, model: Model, version: int, trace: bytes | None,
              timeout: float | None) -> None:
        spec = model.spec
        inputs, parameters, client_id = decode_generate(ex.body, spec,
                                                        self.gateway.settings.max_tensor_elements)
        sequence = sequence_of(spec, parameters)
        echo = [(b"x-request-id", trace)] if trace else []
        stream = self.stream

        def document(reply: InferReply) -> dict[str, Any]:
            if reply.error is not None:
                return {"error": reply.error[1]}
            return encode_generate(spec.name, version, reply.outputs, reply.parameters, client_id)

        def answer(reply: InferReply) -> None:
            if stream:
                ex.respond(200, event(document(reply)), EVENT_STREAM, echo)
            else:
                ex.respond(200, orjson.dumps(document(reply), option=orjson.OPT_SORT_KEYS), http.JSON, echo)

        def failed(exc: DespinaError) -> None:
            if stream:
                fail(ex, exc, trace, FAILED, event({"error": exc.message}), EVENT_STREAM)
            else:
                fail(ex, exc, trace, FAILED)

        answered = answering(ex, trace, answer)
        partial: Partial | None = None
        if spec.decoupled and stream:
            if not isinstance(ex, EventExchange):
                raise DespinaError("streamed answers are not available on this route", Code.INTERNAL)
            done, partial = _streamed(ex, document, answered)
        elif spec.decoupled:
            done, partial = _collected(answered, failed, self.several)
        else:
            done = _once(answered, failed)

        request_id = submit(self.gateway, spec, version, inputs, (), trace, done, 0, 0, timeout,
                            parameters or NO_PARAMETERS, client_id or "", sequence, partial)
        ex.body = b""  # (as InferRoute's: not held while answered)
        if isinstance(ex, EventExchange):
            ex.request_id = request_id


Done = Callable[[InferReply | DespinaError], None]
Partial = Callable[[InferReply], None]


def ran_and_failed(exc: DespinaError) -> bool:
    """Whether an error came from inference itself (the model's own, whatever its code, or its worker's),
    not from what kept the request from it (a full queue) or cut it short (its deadline, a 504: Triton
    has no deadline for a request that runs, and a Python model has no such code to give)."""
    if exc.code == Code.DEADLINE_EXCEEDED:
        return False
    return isinstance(exc, ReplyError) or exc.code == Code.BACKEND


def _once(answered: Done, failed: Callable[[DespinaError], None]) -> Done:
    """A model that answers once: the answer, or the error (the model's own as `failed` answers it)."""
    def done(result: InferReply | DespinaError) -> None:
        if isinstance(result, DespinaError) and ran_and_failed(result):
            failed(result)
        else:
            answered(result)
    return done


def _streamed(ex: EventExchange, document: Callable[[InferReply], dict[str, Any]], answered: Done
              ) -> tuple[Done, Partial]:
    """A decoupled model's answers as events, each as it comes, under the status of the first (an error's
    when that is one, as Triton sets it); an error before any of them that did not come from the model
    (a full queue, a timeout) is a whole JSON answer with its status."""
    sent = [0]  # events so far

    def send(doc: dict[str, Any], last: bool, status: int) -> None:
        if not sent[0]:
            ex.status = status
        ex.event(event(doc), last)
        sent[0] += 1

    def partial(reply: InferReply) -> None:
        send(document(reply), False, 200 if reply.error is None else FAILED)

    def done(result: InferReply | DespinaError) -> None:
        if isinstance(result, DespinaError):
            if not sent[0] and not ran_and_failed(result):
                answered(result)
            else:  # (the status only counts for a first event: then the model's failure)
                send({"error": result.message}, True, FAILED)
        elif result.empty:
            ex.event(b"", True)
        else:
            send(document(result), True, 200)
    return done, partial


def _collected(answered: Done, failed: Callable[[DespinaError], None], several: str
               ) -> tuple[Done, Partial]:
    """A decoupled model's answers to /generate: one response is the answer (an error one, its error as
    `failed` answers it); none or several are a 400 that says where they can be had (`several`), and so is
    a failure of the model after a response, as Triton counts it (an error response after it)."""
    responses: list[InferReply] = []

    def done(result: InferReply | DespinaError) -> None:
        if isinstance(result, DespinaError):
            if not ran_and_failed(result):
                answered(result)
            elif responses:  # (Triton sends the failure as an error response: a second one)
                answered(InvalidArgument(several))
            else:
                failed(result)
            return
        if not result.empty:
            responses.append(result)
        if len(responses) == 1:
            error = responses[0].error
            if error is None:
                answered(responses[0])
            else:
                failed(ReplyError(error[1], Code(error[0])))
            return
        answered(InvalidArgument(several))
    return done, responses.append


class EventExchange(AsgiExchange):
    """An exchange whose answer may be server-sent events, as many as the model sends, instead of one
    whole response."""

    def __init__(self, scope: Scope, body: bytes, echo: Headers) -> None:
        super().__init__(scope, body)
        self.echo = echo
        self.events: asyncio.Queue[tuple[bytes, bool]] = asyncio.Queue()
        self.status = 200  # the stream's, set with its first event
        self.request_id: str | None = None  # with the dispatcher, once queued

    def event(self, data: bytes, last: bool) -> None:
        self.events.put_nowait((data, last))


class StreamEndpoint(AsgiEndpoint):
    """/generate_stream as an ASGI endpoint: a whole answer (an error before the model ran, a model that
    answers once), or a 200 whose body is each event as it comes, until the last."""

    def exchange(self, scope: Scope, body: bytes) -> AsgiExchange:
        trace = http.header(scope["headers"], b"x-request-id")
        return EventExchange(scope, body, [(b"x-request-id", trace)] if trace else [])

    async def answer(self, ex: AsgiExchange, receive: Receive, send: Send) -> None:
        assert isinstance(ex, EventExchange)
        whole = asyncio.ensure_future(ex.answer)
        first = asyncio.ensure_future(ex.events.get())
        await asyncio.wait((whole, first), return_when=asyncio.FIRST_COMPLETED)
        if whole.done():
            first.cancel()
            status, out, content_type, extra = whole.result()
            await http.send(send, status, out, content_type, extra)
            return
        whole.cancel()
        headers = [(b"content-type", EVENT_STREAM), (b"cache-control", b"no-cache"), *ex.echo]
        await send({"type": "http.response.start", "status": ex.status, "headers": headers})
        gone = asyncio.ensure_future(_disconnected(receive))
        data, last = first.result()
        try:
            while True:
                await send({"type": "http.response.body", "body": data, "more_body": not last})
                if last:
                    return
                following = asyncio.ensure_future(ex.events.get())
                await asyncio.wait((following, gone), return_when=asyncio.FIRST_COMPLETED)
                if not following.done():  # the client went away mid-stream: the model may stop
                    following.cancel()
                    if ex.request_id is not None:
                        self.route.gateway.dispatcher.cancel(ex.request_id)
                    return
                data, last = following.result()
        finally:
            gone.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def decode_generate(body: bytes, spec: ModelSpec, max_elements: int = MAX_ELEMENTS
                    ) -> tuple[list[Tensor], dict[str, Any], str | None]:
    """The body -> (input tensors, request parameters, its "id"); InvalidArgument, and nothing else, on
    any input. As Triton reads it: each key in order, those of "parameters" where that one stands, a key
    that names an input (in "parameters" too) is that input, any other a parameter (a later one of a
    name replaces the earlier); a string "id" is also the request's id, which each response carries. A
    key given twice in one object is read twice, each time as its first value (rapidjson's lookup): an
    input twice is refused, and only the first "parameters" is read."""
    doc = loads(body)
    if not isinstance(doc, dict):
        raise InvalidArgument("a generate request is a JSON object: {input_name: value, ..., "
                              "\"parameters\": {...}}")
    inner = doc.get("parameters")
    if len(_KEY_END.findall(body)) != len(doc) + (len(inner) if isinstance(inner, dict) else 0):
        doc = json.loads(body, object_pairs_hook=_Members.of)  # a key twice, or text that looks like one
    request_id = doc.get("id") if spec.input("id") is None else None
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument("field 'id' must be a string")
    tensors: dict[str, Tensor] = {}
    parameters: dict[str, Any] = {}
    for name in _names(doc):
        value = doc[name]
        if name != "parameters":
            _take(spec, name, value, tensors, parameters, max_elements, False)
        elif value is not None:
            if not isinstance(value, dict):
                raise InvalidArgument("field 'parameters' must be an object")
            for key in _names(value):
                _take(spec, key, value[key], tensors, parameters, max_elements, True)
    inputs = list(tensors.values())
    check_inputs(spec, inputs)
    return inputs, parameters, request_id


class _Members(dict[str, Any]):
    """A JSON object as rapidjson holds it: each key's first value, and every key in order (`names`)."""

    names: list[str]

    @classmethod
    def of(cls, pairs: list[tuple[str, Any]]) -> _Members:
        members = cls()
        for name, value in pairs:
            members.setdefault(name, value)
        members.names = [name for name, _ in pairs]
        return members


def _names(obj: dict[str, Any]) -> Iterable[str]:
    return obj.names if isinstance(obj, _Members) else obj


def _take(spec: ModelSpec, name: str, value: Any, tensors: dict[str, Tensor], parameters: dict[str, Any],
          max_elements: int, in_parameters: bool) -> None:
    """One key of the request (`in_parameters`: one of its "parameters"): an input, or else a parameter."""
    if spec.input(name) is None:
        if type(value) not in _SCALARS:
            if in_parameters:
                raise InvalidArgument(f"parameter '{name}' must be a string, a number or a boolean (model "
                                      f"'{spec.name}' has no input of that name)")
            raise InvalidArgument(f"field '{name}' is not an input of model '{spec.name}', and as a "
                                  "parameter it must be a string, a number or a boolean")
        if type(value) is int and not INT64[0] <= value <= INT64[1]:
            value = float(value)  # as Triton holds it: its parameters' integers are int64
        parameters[name] = value
    elif name in tensors:
        raise InvalidArgument(f"input '{name}' already exists in request (given twice)")
    else:
        tensors[name] = _tensor(spec, name, value, max_elements)


def _tensor(spec: ModelSpec, name: str, value: Any, max_elements: int) -> Tensor:
    expected = known_input(spec, name)
    dims = [-1, *expected.dims] if spec.batched else list(expected.dims)
    shape = shape_of(name, value, len(dims))
    if len(shape) < 2:  # a scalar or a flat list: its elements, as Triton shapes them
        shape = filled(name, dims, shape[0] if shape else 1)
    else:  # nested lists (which Triton refuses): their shape, a batch of one added where they leave it out
        shape = [1] * (len(dims) - len(shape)) + shape
    check_shape(spec, expected, shape)
    check_count(name, shape, max_elements)
    return Tensor(name, expected.datatype, tuple(shape), json_data_to_bytes(name, expected.datatype, shape,
                                                                           value))


def filled(name: str, dims: list[int], count: int) -> list[int]:
    """The shape Triton's generate gives `count` elements for an input of `dims` (batch dimension included,
    as -1): each -1 but the last is 1, the last is what the other sizes leave for it; InvalidArgument where
    they leave no whole number."""
    fixed = math.prod(size for size in dims if size != -1)
    shape = [1 if size == -1 else size for size in dims]
    if -1 in dims and fixed and count % fixed == 0:
        shape[len(dims) - 1 - dims[::-1].index(-1)] = count // fixed
    elif fixed != count:
        raise InvalidArgument(f"input '{name}': {count} element{'' if count == 1 else 's'} cannot fill the "
                              f"model's shape {dims}")
    return shape


def encode_generate(model: str, version: int, outputs: tuple[Tensor, ...], parameters: Parameters,
                    request_id: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if request_id is not None:
        doc["id"] = request_id
    for name, value in parameters.items():  # a key each, as Triton writes them; its first of a name stays
        doc.setdefault(name, value)
    for t in outputs:
        if t.name in doc:
            continue
        array = t.numpy()
        array = array.reshape(() if array.size == 1 else -1)  # Triton's flat list, or one element's scalar
        doc[t.name] = nonfinite_json(plain(array, t.datatype), array)
    return doc


def event(doc: dict[str, Any]) -> bytes:
    """One server-sent event carrying `doc` (JSON has no raw newlines, so one data line), its keys sorted
    as Triton writes them."""
    return b"data: " + orjson.dumps(doc, option=orjson.OPT_SORT_KEYS) + b"\n\n"
