"""Starlette's side of the API's formats, for the routes that are not on the hot path: JSON bodies in,
JSON documents and `{"error": ...}` out (the statuses from http.error_parts, like every other error)."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ..contract.errors import DespinaError
from .http import error_parts, json_object, read_body


def json_response(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status, media_type="application/json")


def error_response(exc: DespinaError) -> Response:
    status, body, extra = error_parts(exc)
    return Response(body, status, {k.decode(): v.decode() for k, v in extra}, media_type="application/json")


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request's body as a JSON object; an empty body is an empty object."""
    body = await read_body(request.scope, request.receive, limit)
    if not body.strip():
        return {}
    return json_object(body)
