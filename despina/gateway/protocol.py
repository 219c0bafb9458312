"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol, with the infer routes answered
straight from the parser.

For POST .../infer and /fn/{model} the parser's callbacks fill a `HotRequest` instead of an ASGI
request cycle; when its body is complete the route queues it, and the reply callback writes the
whole response in one `transport.write`. No ASGI messages, no task, no header regexes per request:
on a tiny model uvicorn's cycle cost a quarter of the gateway's CPU. Everything else (other routes,
pipelining order, keep-alive, graceful shutdown, upgrades, malformed requests) stays uvicorn's:
a `HotRequest` takes the request cycle's place in the protocol and has the few attributes the
protocol reads of one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..contract.errors import Code, DespinaError
from . import http
from .auth import AuthPolicy, check_target, classify
from .http import Headers
from .infer import Route, fail

log = logging.getLogger("despina.gateway")

PREFIX, SUFFIX = b"/v2/models/", b"/infer"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class HotRoutes:
    """Which paths skip ASGI, and what they share: the auth policy and the body limit."""

    def __init__(self, infer: Route, fn: Route, policy: AuthPolicy, max_body_bytes: int) -> None:
        self.infer, self.fn, self.policy, self.max_body_bytes = infer, fn, policy, max_body_bytes

    def match(self, path: bytes) -> tuple[Route, dict[str, str]] | None:
        if path.startswith(PREFIX) and path.endswith(SUFFIX):
            parts = path[len(PREFIX):-len(SUFFIX)].split(b"/")
            if len(parts) == 1 and parts[0]:
                return self.infer, {"model": parts[0].decode("latin-1")}
            if len(parts) == 3 and parts[1] == b"versions" and parts[0] and parts[2]:
                model, version = parts[0].decode("latin-1"), parts[2].decode("latin-1")
                return self.infer, {"model": model, "version": version}
        elif path.startswith(b"/fn/") and path.count(b"/") == 2 and len(path) > 4:
            return self.fn, {"model": path[4:].decode("latin-1")}
        return None


def protocol_class(routes: HotRoutes) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), bound to this gateway's routes."""
    return type("GatewayProtocol", (GatewayProtocol,), {"routes": routes})


class GatewayProtocol(HttpToolsProtocol):
    routes: HotRoutes

    def on_message_begin(self) -> None:
        # uvicorn builds the ASGI scope here; a hot request needs none, the others get it below
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _asgi(self) -> None:
        """Hand the request to uvicorn's ASGI cycle, with the scope it would have built."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers
        super().on_headers_complete()

    def on_headers_complete(self) -> None:
        # a request answered while its buffer was parsed armed the keep-alive timer: this one is next
        self._unset_keepalive_if_required()
        parser = self.parser
        if parser.get_method() != b"POST" or self.root_path or parser.should_upgrade():
            self._asgi()
            return
        path = httptools.parse_url(self.url).path
        if b"%" in path:  # escaped names: uvicorn's path, and the router's checks
            self._asgi()
            return
        match = self.routes.match(path)
        if match is None:
            self._asgi()
            return
        route, params = match
        request = HotRequest(self, route, params, path.decode("latin-1"), self.headers,
                             parser.get_http_version() != "1.0" and parser.should_keep_alive(),
                             self.expect_100_continue)
        previous, self.cycle = self.cycle, request  # type: ignore[assignment]
        if previous is None or previous.response_complete:
            request.start()
        else:  # pipelined behind a request not yet answered: it starts when that one is
            self.flow.pause_reading()
            self.pipeline.appendleft((request, None))  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        if not self.pipeline:
            super().on_response_complete()  # resumes reading, or arms the keep-alive timer
            return
        # Requests already read wait their turn: start the next, but read no more from the client
        # until they are all answered. (uvicorn resumes reading here, and a client that pipelines
        # without reading its answers grows the queue by a read buffer per answer.)
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        cycle, app = self.pipeline.pop()
        self._start_asgi_task(cycle, app)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if isinstance(cycle, HotRequest):
            cycle.start()
        else:
            super()._start_asgi_task(cycle, app)


class HotRequest:
    """One hot request: in the protocol, its request cycle; to its route, the exchange it answers."""

    method = "POST"

    def __init__(self, protocol: GatewayProtocol, route: Route, params: dict[str, str], path: str,
                 headers: Headers, keep_alive: bool, expect_100: bool) -> None:
        self.protocol, self.route, self.params, self.path = protocol, route, params, path
        self.headers = headers
        self.keep_alive = keep_alive
        self.expect_100 = expect_100
        self.body = bytearray()   # the protocol appends what it parses
        self.more_body = True     # ... and sets this when the message is complete
        self.started = False
        self.queued = False
        self.disconnected = False
        self.response_complete = False

    @property
    def message_event(self) -> HotRequest:
        """The protocol calls .set() on this after each body part, at the end, and on disconnect.
        (A property, not an attribute: a request referring to itself would live until a collection.)"""
        return self

    def start(self) -> None:
        """Its turn on the connection has come: check path and credentials, then read its body."""
        self.started = True
        routes = self.protocol.routes
        try:
            target = classify(self.path)
            routes.policy.check(target, self.headers)
            check_target(target)
            http.check_length(self.headers, routes.max_body_bytes)
        except DespinaError as exc:
            self._refuse(exc)
            return
        if self.more_body and self.expect_100 and not self.protocol.transport.is_closing():
            self.protocol.transport.write(CONTINUE)
        self.set()

    def set(self) -> None:
        if not self.started or self.queued or self.response_complete:
            return
        if self.disconnected:
            self.response_complete = True
            return
        if len(self.body) > self.protocol.routes.max_body_bytes:
            self._refuse(http.too_large(self.protocol.routes.max_body_bytes))
        elif self.more_body:
            self.protocol.flow.resume_reading()  # paused past uvicorn's high-water mark
        else:
            self.queued = True
            self.body = bytes(self.body)  # type: ignore[assignment]
            try:
                self.route(self)
            except Exception:  # a fault here would otherwise end up in the parser, the client hanging
                log.exception("POST %s failed", self.path)
                fail(self, DespinaError("internal error (the gateway's log has the details)", Code.INTERNAL),
                     None)

    def _refuse(self, exc: DespinaError) -> None:
        """Answer before the body is read. The parser skips the rest of it, as uvicorn does, unless the
        body is too large: then the connection closes rather than read it."""
        if self.more_body and isinstance(exc, http.BodyTooLarge):
            self.keep_alive = False
        fail(self, exc, http.header(self.headers, b"x-request-id"))

    def respond(self, status: int, body: bytes, content_type: bytes, extra: Headers) -> None:
        if self.response_complete:
            return
        self.response_complete = True
        protocol = self.protocol
        transport = protocol.transport
        if self.disconnected or transport.is_closing():
            return
        head = http.response_head(status, len(body), content_type, extra, not self.keep_alive)
        if len(body) < 65536:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        if not self.keep_alive:
            transport.close()
        if protocol.flow.write_paused:
            # the client is not reading its answers: read no more requests from it until it does
            # (uvicorn's cycle waits the same way), or a pipelining client could fill our memory
            protocol.flow.pause_reading()
            task = asyncio.ensure_future(_complete_when_drained(protocol))
            protocol.tasks.add(task)
            task.add_done_callback(protocol.tasks.discard)
        else:
            protocol.on_response_complete()


async def _complete_when_drained(protocol: GatewayProtocol) -> None:
    await protocol.flow.drain()  # also set when the connection is lost
    protocol.on_response_complete()
