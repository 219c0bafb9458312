"""Triton's model repository extension: index, load, unload.

The gateway owns no model state: each call becomes a command to the control plane (see
gateway/control.py) and the answer comes back to the client as Triton would give it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract.commands import INDEX, LOAD, UNLOAD
from ..contract.errors import DespinaError, InvalidArgument
from .auth import check_key_may_rewrite
from .responses import error_response, json_body, json_response

if TYPE_CHECKING:
    from .app import Gateway

INDEX_TIMEOUT_S = 30.0
EXTENSIONS = ["model_repository", "model_repository(unload_dependents)"]


def repository_routes(gw: Gateway) -> list[Route]:
    async def index(request: Request) -> Response:
        try:
            doc = await json_body(request, gw.settings.max_body_bytes)
            ready = doc.get("ready")
            if ready is not None and not isinstance(ready, bool):
                raise InvalidArgument("'ready' must be true or false")
            rows = await gw.view.control.call(INDEX, "", {"ready": ready}, INDEX_TIMEOUT_S)
        except DespinaError as exc:
            return error_response(exc)
        return json_response(rows)

    async def load(request: Request) -> Response:
        try:
            params = _parameters(await json_body(request, gw.settings.max_body_bytes))
            check_key_may_rewrite(request.scope, params)
            await gw.view.control.call(LOAD, request.path_params["model"], params, gw.settings.load_timeout_s)
            await gw.view.refresh()  # a readiness call right after the answer must see the model
        except DespinaError as exc:
            return error_response(exc)
        return Response(b"", 200)

    async def unload(request: Request) -> Response:
        try:
            params = _parameters(await json_body(request, gw.settings.max_body_bytes))
            dependents = params.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InvalidArgument("'unload_dependents' must be true or false")
            await gw.view.control.call(UNLOAD, request.path_params["model"],
                                       {"unload_dependents": dependents}, gw.settings.load_timeout_s)
            await gw.view.refresh()
        except DespinaError as exc:
            return error_response(exc)
        return Response(b"", 200)

    return [
        Route("/v2/repository/index", index, methods=["POST"]),
        Route("/v2/repository/models/{model}/load", load, methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", unload, methods=["POST"]),
    ]


def _parameters(doc: dict[str, Any]) -> dict[str, Any]:
    params = doc.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):  # ([], 0, "" or false were taken as no parameters)
        raise InvalidArgument("'parameters' must be a JSON object")
    return params
