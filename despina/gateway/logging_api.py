"""Triton's logging extension: `GET /v2/logging` answers the log settings, `POST /v2/logging` changes
those it names (log_info, log_warning, log_error, log_verbose_level, log_format; log_file only as "",
every process logging to standard error) and answers them all.

The settings are the cluster's, not one process's: they are kept in Redis (Keys.log_settings) and
announced on the events channel, and every gateway, worker and control plane follows them at once
(logs.apply), as it does when it starts or reconnects (logs.follow).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import logs
from ..contract.errors import DespinaError
from .responses import error_response, json_body, json_response

if TYPE_CHECKING:
    from .app import Gateway

EXTENSION = "logging"


def logging_routes(gw: Gateway) -> list[Route]:
    def read(raw: bytes | None) -> dict[str, Any]:
        settings = logs.defaults(gw.settings.log_level)
        return logs.merged(settings, orjson.loads(raw)) if raw else settings  # older names read as today's

    async def get(request: Request) -> Response:
        return json_response(read(cast(bytes | None, await gw.redis.get(gw.keys.log_settings))))

    async def post(request: Request) -> Response:
        try:
            update = await json_body(request, gw.settings.max_body_bytes)
            raw = await gw.view.announce(
                gw.keys.log_settings, lambda kept: orjson.dumps(logs.merged(read(kept), update)), logs.EVENT)
        except DespinaError as exc:
            return error_response(exc)
        settings = orjson.loads(raw)
        logs.apply(settings)  # this process at once; the others as the event reaches them
        return json_response(settings)

    return [Route("/v2/logging", get, methods=["GET"]), Route("/v2/logging", post, methods=["POST"])]
