"""Raw ASGI helpers for the hot path, and the one place where error codes become HTTP statuses."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ..contract.errors import Code, DespinaError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

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
}
EXTRA_HEADERS = {
    Code.UNAVAILABLE: [(b"retry-after", b"1")],
    Code.RESOURCE_EXHAUSTED: [(b"retry-after", b"1")],
    Code.UNAUTHENTICATED: [(b"www-authenticate", b'Bearer realm="despina"')],
}
JSON = b"application/json"


class BodyTooLarge(DespinaError):
    code = Code.PAYLOAD_TOO_LARGE


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise BodyTooLarge(f"request body of {length.decode()[:20]} bytes is over the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send(send_: Send, status: int, body: bytes, content_type: bytes = JSON,
               extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send_({"type": "http.response.start", "status": status, "headers": headers})
    await send_({"type": "http.response.body", "body": body})


def error_parts(exc: DespinaError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    status = STATUS.get(exc.code, 500)
    return status, orjson.dumps({"error": exc.message}), list(EXTRA_HEADERS.get(exc.code, ()))


async def send_error(send_: Send, exc: DespinaError) -> None:
    status, body, extra = error_parts(exc)
    await send(send_, status, body, JSON, extra)
