"""Triton's shared-memory extension's HTTP API: status, register and unregister of system shared memory
regions (gateway/shm.py keeps them), and of CUDA ones, which this server cannot map: their status is
empty, a registration is refused with the reason, unregistering is a no-op.

Without --allow-client-shm every call is refused, as in Triton, and nothing is registered.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract.errors import Code, DespinaError, InvalidArgument, NotFound
from .responses import error_response, json_body, json_response

if TYPE_CHECKING:
    from .app import Gateway

EXTENSION = "system_shared_memory"
SYSTEM, CUDA = "/v2/systemsharedmemory", "/v2/cudasharedmemory"
DISABLED = ("shared memory is not allowed on this server: start it with --allow-client-shm "
            "(DESPINA_ALLOW_CLIENT_SHM=1)")
NO_CUDA = ("CUDA shared memory is not supported by this server: its gateways read and write tensors in "
           "host memory; use system shared memory")


def _size(doc: dict[str, Any], field: str, default: int | None = None) -> int:
    value = doc.get(field, default)
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"field '{field}' must be a non-negative integer")
    return value


def shm_routes(gw: Gateway) -> list[Route]:
    shm = gw.shm
    limit = gw.settings.max_body_bytes

    def guarded(call: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if shm is None:
                    raise DespinaError(DISABLED, Code.FAILED_PRECONDITION)
                return await call(request)
            except DespinaError as exc:
                return error_response(exc)
        return endpoint

    async def status(request: Request) -> Response:
        assert shm is not None
        return json_response(shm.status(request.path_params.get("region", "")))

    async def register(request: Request) -> Response:
        assert shm is not None
        doc = await json_body(request, limit)
        key = doc.get("key")
        if type(key) is not str or not key:
            raise InvalidArgument("field 'key' must be the shared memory object's key (a string)")
        shm.register(request.path_params["region"], key, _size(doc, "offset", 0), _size(doc, "byte_size"))
        return Response(b"", 200)

    async def unregister(request: Request) -> Response:
        assert shm is not None
        shm.unregister(request.path_params.get("region", ""))
        return Response(b"", 200)

    async def cuda_status(request: Request) -> Response:
        name = request.path_params.get("region")
        if name:
            raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
        return json_response([])

    async def cuda_register(request: Request) -> Response:
        raise InvalidArgument(NO_CUDA)

    async def cuda_unregister(request: Request) -> Response:
        return Response(b"", 200)  # none is ever registered

    routes = []
    for base, calls in ((SYSTEM, (status, register, unregister)),
                        (CUDA, (cuda_status, cuda_register, cuda_unregister))):
        get, post, drop = (guarded(c) for c in calls)
        routes += [Route(f"{base}/status", get, methods=["GET"]),
                   Route(f"{base}/region/{{region}}/status", get, methods=["GET"]),
                   Route(f"{base}/region/{{region}}/register", post, methods=["POST"]),
                   Route(f"{base}/unregister", drop, methods=["POST"]),
                   Route(f"{base}/region/{{region}}/unregister", drop, methods=["POST"])]
    return routes
