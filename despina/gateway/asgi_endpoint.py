"""The routes of gateway/infer.py (and generate.py) as ASGI endpoints, for the requests Starlette's router
serves (an escaped path, a body uvicorn read): the hot HTTP protocol answers the others itself."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..contract.errors import DespinaError
from . import http
from .http import Headers, Receive, Scope, Send

if TYPE_CHECKING:
    from .infer import Route


class AsgiExchange:
    """An exchange under an ASGI server: the answer is sent by the endpoint that waits for it."""

    def __init__(self, scope: Scope, body: bytes) -> None:
        self.method, self.path = scope["method"], scope["path"]
        self.headers, self.params, self.body = scope["headers"], scope["path_params"], body
        self.answer: asyncio.Future[tuple[int, bytes, bytes, Headers]] = \
            asyncio.get_running_loop().create_future()

    def respond(self, status: int, body: bytes, content_type: bytes, extra: Headers) -> None:
        if not self.answer.done():
            self.answer.set_result((status, body, content_type, extra))


class AsgiEndpoint:
    """A route as an ASGI endpoint (for Starlette's router). An instance, not a function: Starlette's
    Route calls a function as request -> response, an instance as the ASGI app it is."""

    def __init__(self, route: Route) -> None:
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.route.gateway.settings.max_body_bytes
        try:
            body = await http.read_body(scope, receive, limit)
        except DespinaError as exc:
            await http.send_error(send, exc)
            return
        except ConnectionResetError:
            return
        ex = self.exchange(scope, body)
        del body  # the exchange's now, let go of once decoded (InferRoute.queue), not held while answered
        self.route(ex)
        await self.answer(ex, receive, send)

    def exchange(self, scope: Scope, body: bytes) -> AsgiExchange:
        return AsgiExchange(scope, body)

    async def answer(self, ex: AsgiExchange, receive: Receive, send: Send) -> None:
        """Send the exchange's answer once the route gives it (`receive`: what the client says after its
        body, that it went away)."""
        status, out, content_type, extra = await ex.answer
        await http.send(send, status, out, content_type, extra)
