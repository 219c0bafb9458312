"""HTTP helpers for the hot path, and the one place where error codes become HTTP statuses."""
from __future__ import annotations

import json
import math
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

import orjson

from ..contract.errors import Code, DespinaError, InvalidArgument

# Scope and Receive as Starlette types them (MutableMapping): a Request's scope and receive pass as they are
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.FAILED_PRECONDITION: 400,
    Code.NOT_FOUND: 404,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.PAYLOAD_TOO_LARGE: 413,
    Code.UNAVAILABLE: 503,
    Code.RESOURCE_EXHAUSTED: 503,
    Code.DEADLINE_EXCEEDED: 504,
    Code.BACKEND: 500,
    Code.INTERNAL: 500,
    Code.CANCELLED: 499,  # nobody reads it: the client is gone
    Code.ALREADY_EXISTS: 400,  # as Triton's HTTP frontend answers ALREADY_EXISTS
    Code.UNSUPPORTED_ENCODING: 415,  # HTTP's status for it (RFC 7694); Triton 2.51 answers 501
    Code.UNIMPLEMENTED: 501,
}
EXTRA_HEADERS = {
    Code.UNAVAILABLE: [(b"retry-after", b"1")],
    Code.RESOURCE_EXHAUSTED: [(b"retry-after", b"1")],
    Code.UNAUTHENTICATED: [(b"www-authenticate", b'Bearer realm="despina"')],
    Code.UNSUPPORTED_ENCODING: [(b"accept-encoding", b"gzip, deflate")],  # what RFC 7694 asks of a 415
}
JSON = b"application/json"


class BodyTooLarge(DespinaError):
    code = Code.PAYLOAD_TOO_LARGE


class ClientGone(ConnectionResetError):
    """The client went away, or its connection was ended (a read timeout), before its body was read:
    nobody reads an answer."""


STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}


def header(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def check_body(headers: Headers, limit: int) -> bytes | None:
    """Before any of the body is read: BodyTooLarge when the declared Content-Length is over the limit,
    UnsupportedEncoding when the Content-Encoding is not one the gateway reads. Returns that encoding
    (gzip or deflate; None: the body is as sent)."""
    length = coding = None
    for key, value in headers:
        if key == b"content-length":
            length = value
        elif key == b"content-encoding":
            coding = value if coding is None else coding + b"," + value
    if length is not None and length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise BodyTooLarge(f"request body of {length.decode()[:20]} bytes is over the limit of {limit}")
    return None if coding is None else _coding(coding)


def declared_over(headers: Headers, limit: int) -> bool:
    """The request's Content-Length is over `limit` (as check_body has it)."""
    length = header(headers, b"content-length")
    return length is not None and length.isdigit() and (len(length) > 18 or int(length) > limit)


def too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body is over the limit of {limit} bytes")


class UnsupportedEncoding(DespinaError):
    code = Code.UNSUPPORTED_ENCODING


# Content-Encoding -> zlib's window bits for it. deflate is zlib-wrapped (RFC 9110, tritonclient, Triton);
# decoded() also reads a raw deflate stream under that name, as some clients send it.
WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}


def _coding(value: bytes) -> bytes | None:
    name = value.strip().lower()
    if name in WBITS:
        return name
    if name in (b"identity", b""):
        return None
    raise UnsupportedEncoding(f"Content-Encoding '{value.decode('latin-1')[:40]}' is not supported: send "
                              "the body as it is, or in one of gzip, deflate")


def decoded(body: bytes, coding: bytes, limit: int) -> bytes:
    """A body with its Content-Encoding (check_body's) undone: BodyTooLarge when it inflates past `limit`
    bytes (no more than that is ever inflated), InvalidArgument when it is not what its encoding says.
    gzip data may be several members one after another (RFC 1952; what `cat a.gz b.gz` makes)."""
    if not body:  # no data to undo (json_body reads an empty body as {}, whatever its label)
        return body
    out, body = _inflated(body, coding, limit, limit)
    if not body:
        return out
    parts, size = [out], len(out)
    while body:
        if coding == b"deflate" or body[:2] != b"\x1f\x8b":
            raise InvalidArgument(f"the request body has {len(body)} bytes after the end of its "
                                  f"{coding.decode()} data")
        out, body = _inflated(body, coding, limit - size, limit)
        parts.append(out)
        size += len(out)
    return b"".join(parts)


def _inflated(body: bytes, coding: bytes, room: int, limit: int) -> tuple[bytes, bytes]:
    """One gzip member's (or the deflate stream's) data, at most `room` bytes of it, and what follows."""
    try:
        inflater = zlib.decompressobj(WBITS[coding])
        try:
            out = inflater.decompress(body, room + 1)
        except zlib.error:
            if coding != b"deflate":
                raise
            inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            out = inflater.decompress(body, room + 1)
    except zlib.error as exc:
        raise InvalidArgument(f"the request body is not valid {coding.decode()} data ({exc})") from None
    if len(out) > room:
        raise BodyTooLarge(f"request body is over the limit of {limit} bytes once its "
                           f"{coding.decode()} encoding is undone")
    if not inflater.eof:
        raise InvalidArgument(f"the request body's {coding.decode()} data is cut short (truncated)")
    return out, inflater.unused_data


HEADS_MAX = 1024
_heads: dict[tuple[Any, ...], bytes] = {}


def response_head(status: int, length: int, content_type: bytes, extra: Headers, close: bool) -> bytes:
    """Status line and headers of a response, ready for the wire (the names and values are ours).
    Those without extra headers, or with only a binary answer's header length, are remembered."""
    if extra and (len(extra) > 1 or extra[0][0] != b"inference-header-content-length"):
        return _head(status, length, content_type, extra, close)
    key = (status, length, content_type, close, *extra)
    head = _heads.get(key)
    if head is None:
        head = _head(status, length, content_type, extra, close)
        if len(_heads) >= HEADS_MAX:
            _heads.clear()
        _heads[key] = head
    return head


def _head(status: int, length: int, content_type: bytes, extra: Headers, close: bool) -> bytes:
    parts = [STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status,
             b"content-type: ", content_type, b"\r\ncontent-length: %d\r\n" % length]
    for name, value in extra:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"connection: close\r\n\r\n" if close else _kept)
    return b"".join(parts)


# The end of the head of an answer that keeps its connection (advertise_keep_alive).
_kept = b"\r\n"


def keep_alive_headers(seconds: float) -> list[tuple[str, str]]:
    """`Keep-Alive: timeout=N`, N the seconds an idle connection stays open, for the answers that keep their
    connection: the pools of some clients (Node's fetch, Java's, Apache HttpClient, Firefox) then retire a
    connection before the gateway closes it, instead of sending a request as it does. (uvicorn and nginx say
    nothing by default; Node says it.) None under a second (timeout=0 would read as no keep-alive)."""
    return [("keep-alive", f"timeout={int(seconds)}")] if seconds >= 1 else []


def advertise_keep_alive(seconds: float) -> None:
    """The hot routes' answers that keep their connection say keep_alive_headers' header (set at start)."""
    global _kept
    _kept = b"".join(f"{name}: {value}\r\n".encode() for name, value in keep_alive_headers(seconds)) + b"\r\n"
    _heads.clear()


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, its Content-Encoding undone (check_body, decoded); at most `limit` bytes both as sent
    and as decoded."""
    coding = check_body(scope["headers"], limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            return body if coding is None else decoded(body, coding, limit)


async def send(send_: Send, status: int, body: bytes, content_type: bytes = JSON,
               extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send_({"type": "http.response.start", "status": status, "headers": headers})
    await send_({"type": "http.response.body", "body": body})


BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark


def loads(raw: bytes | memoryview) -> Any:
    """A request body's JSON; InvalidArgument when it is not JSON.

    NaN, Infinity and -Infinity are taken as numbers, as Triton takes them (rapidjson's NaN and Inf
    flag) and as tritonclient and Python's json write a non-finite float. orjson refuses them, so a
    document it refuses that holds one is read again by the standard library: the cost falls on those
    documents alone. So is one after a UTF-8 byte order mark, which Triton skips (as RFC 8259 allows)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        error = exc
    data = raw if isinstance(raw, bytes) else bytes(raw)
    if data[:3] == BOM:
        return loads(data[3:])
    if b"NaN" in data or b"Infinity" in data:
        try:
            doc = json.loads(data.decode("utf-8"))
            orjson.dumps(doc)  # what orjson would have refused for another reason (a lone surrogate)
            return doc
        except (ValueError, RecursionError, orjson.JSONEncodeError):
            pass  # orjson's message says where the document is wrong
    raise InvalidArgument(f"malformed JSON in request body: {error}")


def json_object(raw: bytes | memoryview) -> dict[str, Any]:
    """A request body that must be one JSON object; InvalidArgument otherwise."""
    doc = loads(raw)
    if not isinstance(doc, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return doc


def error_parts(exc: DespinaError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    status = STATUS.get(exc.code, 500)
    extra = list(EXTRA_HEADERS.get(exc.code, ()))
    if exc.retry_after > 0:  # the error knows when a retry may succeed: that, not the code's guess
        seconds = b"%d" % max(1, math.ceil(exc.retry_after))
        extra = [h for h in extra if h[0] != b"retry-after"] + [(b"retry-after", seconds)]
    return status, orjson.dumps({"error": exc.message}), extra


async def send_error(send_: Send, exc: DespinaError) -> None:
    status, body, extra = error_parts(exc)
    await send(send_, status, body, JSON, extra)
