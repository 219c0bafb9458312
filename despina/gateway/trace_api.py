"""Triton's trace extension: `GET /v2[/models/{m}]/trace/setting` answers the trace settings that apply
(a model's over the global ones, trace_count what is left of it, as Triton's), `POST` changes those it
names and answers them all; a model keeps only the settings it was given, following the global ones for
the rest, and a null clears one of its own (an empty body changes nothing, as Triton's). The settings
are kept in Redis and followed by every gateway (trace.py), and trace_count is counted there, the server's
(each trace claimed from it). trace_file is the server's (--trace-file): a
POST naming one is refused, as Triton's is."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract.errors import DespinaError, InvalidArgument
from . import trace, trace_settings
from .responses import error_response, json_body, json_response

if TYPE_CHECKING:
    from .app import Gateway

EXTENSION = "trace"


def read(raw: bytes | None) -> dict[str, Any]:
    """The settings as kept in Redis (Keys.trace_settings)."""
    return orjson.loads(raw) if raw else {}


def trace_routes(gw: Gateway) -> list[Route]:
    async def current() -> dict[str, Any]:
        return read(cast(bytes | None, await gw.redis.get(gw.keys.trace_settings)))

    async def follow() -> None:
        try:
            gw.tracer.follow(await current())
        except (ValueError, TypeError, AttributeError) as exc:
            trace.log.warning("ignoring unreadable trace settings (%s)", exc)

    gw.view.followers[trace.EVENT] = follow
    claim = gw.redis.register_script(trace.CLAIM)

    async def claimer(counter: str, first: int) -> int:
        return int(await claim(keys=[gw.keys.trace_left(counter)], args=[first, trace.COUNT_KEPT_S]))

    gw.tracer.claimer = claimer  # trace_count is the server's: its gateways claim each trace from Redis

    async def shown(doc: dict[str, Any], model: str | None) -> dict[str, Any]:
        """The settings as Triton answers them, trace_count what is left of the server's count."""
        settings = gw.tracer.shown(doc, model)
        counter = gw.tracer.counter(doc, model)
        if counter:
            left = await gw.redis.get(gw.keys.trace_left(counter))
            if left is not None:  # (none yet: nothing claimed)
                settings["trace_count"] = str(max(int(left), 0))
        return settings

    def model_of(request: Request) -> str | None:
        model = request.path_params.get("model")
        known = gw.view.models.get(model) if model is not None else None
        # Triton's status and words (INVALID_ARG) for a model it lacks, and for one it has not loaded
        if model is not None and (known is None or not known.entry.loaded):
            raise InvalidArgument(f"Request for unknown model : {model}")
        return model

    async def get(request: Request) -> Response:
        try:
            model = model_of(request)
            return json_response(await shown(await current(), model))
        except DespinaError as exc:
            return error_response(exc)

    async def post(request: Request) -> Response:
        try:
            model = model_of(request)
            update = await json_body(request, gw.settings.max_body_bytes)
            raw = await gw.view.announce(gw.keys.trace_settings,
                                         lambda kept: changed(read(kept), model, update), trace.EVENT)
        except DespinaError as exc:
            return error_response(exc)
        doc = read(raw)
        gw.tracer.follow(doc)  # this gateway at once; the others as the event reaches them
        return json_response(await shown(doc, model))

    def changed(doc: dict[str, Any], model: str | None, update: dict[str, Any]) -> bytes:
        """The settings `doc` with `update` made to the global ones or the model's own; InvalidArgument
        when what would apply to any model is wrong."""
        if model is None:
            doc["global"] = trace_settings.merged(doc.get("global", {}), update)
        else:  # only what it sets: the rest follows the global settings, as they change (as Triton's)
            models = doc.get("models", {})
            own = trace_settings.merged(models.get(model, {}), update)
            if own:
                doc["models"] = {**models, model: own}
            else:
                models.pop(model, None)
        if update.get("trace_count") is not None:  # counted afresh, even at the value it had (Triton's)
            armed = doc.setdefault("armed", {})
            armed[model or ""] = armed.get(model or "", 0) + 1
        for name in [None, *doc.get("models", {})]:
            why = trace_settings.problem(trace_settings.effective(doc, name, gw.settings.trace_file))
            if why:
                raise InvalidArgument(why if name is None else f"model '{name}': {why}")
        return orjson.dumps(doc)

    routes = []
    for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting"):
        routes += [Route(path, get, methods=["GET"]), Route(path, post, methods=["POST"])]
    return routes
