"""A worker's health port (DESPINA_WORKER_HEALTH_PORT) for Kubernetes' probes.

/livez answers while the worker's event loop does. /readyz answers 200 once a placement of the control plane
has seen the worker and every load placed on it has ended, loaded or failed (a failed one is listed, and
the control plane gives it to another worker): a rolling update then stops an old worker only when the new
one serves what it was given. Answered from the worker's own state, without Redis.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from .worker import Worker


def readiness(worker: Worker) -> dict[str, object]:
    """Whether the worker is ready, why not, and its loads under way and failed."""
    loading = sorted(f"{name}/{version}" for name, version in worker.loading)
    if worker.stopping:
        reason = "stopping"
    elif not worker.placed:
        reason = "the control plane has not placed models since this worker joined" if worker.leads \
            else "no control plane leads"
    elif loading:
        reason = f"loading {', '.join(loading)}"
    else:
        reason = ""
    return {"ready": not reason, "reason": reason, "loading": loading,
            "waiting_for_registry": {f"{n}/{v}": why for (n, v), why in sorted(worker.fetch_errors.items())},
            "failed": {f"{n}/{v}": why for (n, v), (_, why) in sorted(worker.failures.items())}}


def create_app(state_of: Callable[[], dict[str, object]]) -> Starlette:
    """The health port's app; `state_of` gives readiness() of the worker."""
    async def livez(request: Request) -> Response:
        return Response(b"", 200)

    async def readyz(request: Request) -> Response:
        state = state_of()
        return Response(orjson.dumps(state), 200 if state["ready"] else 503, media_type="application/json")

    return Starlette(routes=[Route("/livez", livez, methods=["GET"]),
                             Route("/readyz", readyz, methods=["GET"])])
