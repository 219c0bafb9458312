"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol, with the infer routes answered
straight from the parser.

For POST .../infer and /fn/{model} the parser's callbacks fill a `HotRequest` instead of an ASGI
request cycle; when its body is complete the route queues it, and the reply callback writes the
whole response in one `transport.write`. No ASGI messages, no task, no header regexes per request:
on a tiny model uvicorn's cycle cost a quarter of the gateway's CPU. Everything else (other routes,
pipelining order, keep-alive, graceful shutdown, upgrades) stays uvicorn's, and the connection's
limits and last words are connection.py's, its timeouts timeouts.py's: a `HotRequest` takes the request
cycle's place in the protocol and has the few attributes the protocol reads of one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..contract.errors import Code, DespinaError
from . import http
from .auth import AuthPolicy, Target, check_target, classify
from .connection import Clients, ConnectionProtocol, Ended, LastWord, answer_drained, ending
from .cors import CorsPolicy
from .http import Headers
from .infer import Route, fail

log = logging.getLogger("despina.gateway")

PREFIX, SUFFIX = b"/v2/models/", b"/infer"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class HotRoutes:
    """Which paths skip ASGI, and what they share: the auth policy, the body limit and the CORS policy
    (None: off)."""

    MATCHES_MAX = 4096  # paths remembered with what they name (a client cannot grow it past this)

    def __init__(self, infer: Route, fn: Route, policy: AuthPolicy, max_body_bytes: int,
                 cors: CorsPolicy | None = None) -> None:
        self.infer, self.fn, self.policy, self.max_body_bytes = infer, fn, policy, max_body_bytes
        self.cors = cors
        # URL -> its route, path parameters, path as text, and what it names (checked)
        self._matched: dict[bytes, Match] = {}

    def match(self, url: bytes) -> Match | None:
        """The route of a request's URL when its path is a hot one, or None: ASGI serves it (escaped names
        too: uvicorn's path, and the router's checks). A path whose model name or version is invalid still
        matches: the request is refused in its turn (HotRequest.start). Raises httptools' error on a
        URL it cannot parse, as uvicorn's parsing does."""
        hit = self._matched.get(url)  # the raw URL: clients send the same few again and again
        if hit is not None:
            return hit
        path = httptools.parse_url(url).path
        if path.find(b"%") >= 0:
            return None
        found = self._route(path)
        if found is None:
            return None
        text = path.decode("latin-1")
        target = classify(text)
        try:
            check_target(target)
        except DespinaError:  # not remembered: refused each time, and such paths are the client's to vary
            return Match(found[0], found[1], text, target, checked=False)
        hit = Match(found[0], found[1], text, target, checked=True)
        if len(self._matched) >= self.MATCHES_MAX:
            self._matched.clear()
        self._matched[url] = hit
        return hit

    def _route(self, path: bytes) -> tuple[Route, dict[str, str]] | None:
        if path.startswith(PREFIX) and path.endswith(SUFFIX):
            parts = path[len(PREFIX):-len(SUFFIX)].split(b"/")
            if len(parts) == 1 and parts[0]:
                return self.infer, {"model": parts[0].decode("latin-1")}
            if len(parts) == 3 and parts[1] == b"versions" and parts[0] and parts[2]:
                model, version = parts[0].decode("latin-1"), parts[2].decode("latin-1")
                return self.infer, {"model": model, "version": version}
        elif path.startswith(b"/fn/"):
            parts = path[4:].split(b"/")
            if len(parts) == 1 and parts[0]:
                return self.fn, {"model": parts[0].decode("latin-1")}
            if len(parts) == 3 and parts[1] == b"versions" and parts[0] and parts[2]:
                return self.fn, {"model": parts[0].decode("latin-1"), "version": parts[2].decode("latin-1")}
        return None


class Match:
    """A hot path: its route, path parameters (shared by its requests: read, never changed), the path
    as text, and what it names for the auth policy."""

    __slots__ = ("route", "params", "path", "target", "checked")

    def __init__(self, route: Route, params: dict[str, str], path: str, target: Target, checked: bool
                 ) -> None:
        self.route, self.params, self.path, self.target = route, params, path, target
        self.checked = checked  # check_target passed: its requests need not check again


def protocol_class(routes: HotRoutes, header_timeout: float, body_timeout: float, write_timeout: float,
                   clients: Clients) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), bound to this gateway's routes, its connections'
    timeouts (seconds: settings.header_timeout_s, body_timeout_s, write_timeout_s) and its client
    connections' tally, whose limit is how many it holds at once."""
    return type("GatewayProtocol", (GatewayProtocol,),
                {"routes": routes, "header_timeout": header_timeout, "body_timeout": body_timeout,
                 "write_timeout": write_timeout, "clients": clients})


class GatewayProtocol(ConnectionProtocol):
    routes: HotRoutes
    headers: Headers

    def on_message_begin(self) -> None:
        # uvicorn builds the ASGI scope here; a hot request needs none, the others get it below
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._head_open, self._head_size = True, 0

    def _asgi(self) -> None:
        """Hand the request to uvicorn's ASGI cycle, with the scope it would have built."""
        url, headers, expect, previous = self.url, self.headers, self.expect_100_continue, self.cycle
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is previous:  # (an upgrade)
            return
        if self._draining:  # the server is stopping (connection.shutdown)
            cycle.keep_alive = self._drain_mark(previous, cycle.keep_alive)
            if cycle.keep_alive is None:
                answer_drained(self, cycle)
                return
        if not cycle.keep_alive:  # its answer ends the connection: it may linger
            ending(self, cycle)

    def on_headers_complete(self) -> None:
        if self._big_read:  # (connection.py)
            self._check_head()
        self._head_open = False
        self._body_open = True
        # a request answered while its buffer was parsed armed the keep-alive timer: this one is next
        self._idle_since = None  # (_unset_keepalive_if_required, without the call)
        parser = self.parser
        if parser.get_method() != b"POST" or self.root_path or parser.should_upgrade():
            self._asgi()
            return
        match = self.routes.match(self.url)
        if match is None:
            self._asgi()
            return
        wants = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        # the server is stopping (connection.shutdown)
        keep_alive = self._drain_mark(self.cycle, wants) if self._draining else wants
        request = HotRequest(self, match, self.headers, keep_alive, self.expect_100_continue)
        previous, self.cycle = self.cycle, request
        if previous is None or previous.response_complete:
            request.start()
        else:  # pipelined behind a request not yet answered: it starts when that one is
            self.flow.pause_reading()
            self.pipeline.appendleft((request, None))  # type: ignore[arg-type]

    # uvicorn's on_body and on_message_complete, for a hot request: it is never an upgrade
    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is not HotRequest:
            if cycle.response_complete and not self.parser.should_upgrade():
                self._drop(cycle.scope["headers"], len(body))
            else:
                super().on_body(body)
            return
        if cycle.response_complete:
            self._drop(cycle.headers, len(body))
            return
        if not cycle.body:  # the first part (usually all of it) is kept as it is, not copied
            cycle.body = body
        elif type(cycle.body) is bytes:
            cycle.body = bytearray(cycle.body) + body  # type: ignore[assignment]  # bytes once complete
        else:
            cycle.body += body
        if cycle.started:  # read whole, up to the limit: nothing to pause for, nothing paused
            if len(cycle.body) > self.routes.max_body_bytes:
                cycle.set()  # refused
        elif len(cycle.body) > HIGH_WATER_LIMIT:  # pipelined: read on when its turn comes (start)
            self.flow.pause_reading()

    def on_message_complete(self) -> None:
        self._body_open = False
        cycle = self.cycle
        if type(cycle) is not HotRequest:
            super().on_message_complete()
            if cycle is not None and cycle.response_complete and not self.parser.should_upgrade():
                self._dropped = 0
                self._idle()  # answered before its body was read (below)
            return
        if not cycle.response_complete:
            cycle.more_body = False
            cycle.set()
        else:
            # answered before its body was read (refused): the body's reads stopped the keep-alive timer
            # its answer armed, and no other answer comes to arm it again
            self._dropped = 0
            self._idle()

    # A request answered before its body was read (refused: 401, 404, 413...). uvicorn reads the rest of the
    # body and drops it, to keep the connection; a body of 10 GB was read to its end. The gateway drops at
    # most the body limit of it: a body declared over the limit, or longer, ends the connection instead,
    # lingering (as nginx does after a 413, and the hot routes' own 413 did).
    _dropped = 0  # the bytes of it dropped so far

    def _drop(self, headers: Headers, size: int) -> None:
        self._dropped += size
        limit = self.routes.max_body_bytes
        if self._dropped > limit or http.declared_over(headers, limit):
            self._close()
            raise Ended  # the parser reads no further (connection.py: _feed)

    # The ASGI cycle answering now. uvicorn tells only the last request read (self.cycle) that the client
    # has gone: with requests pipelined behind it, the one answering wrote to the closed transport, and
    # uvloop's error on that was an "Exception in ASGI application" traceback per connection.
    _running: Any = None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        running = self._running
        if running is not None and not running.response_complete:
            running.disconnected = True
            running.message_event.set()

    def on_response_complete(self) -> None:
        if not self.pipeline:
            # uvicorn's, with the keep-alive timer of timeouts.py
            self.server_state.total_requests += 1
            if self.transport.is_closing() or self._lingering:
                return
            self.flow.resume_reading()
            self._idle()
            return
        # Requests already read wait their turn: start the next, but read no more from the client
        # until they are all answered. (uvicorn resumes reading here, and a client that pipelines
        # without reading its answers grows the queue by a read buffer per answer.)
        self.server_state.total_requests += 1
        if self.transport.is_closing() or self._lingering:
            return
        self._unset_keepalive_if_required()
        cycle, app = self.pipeline.pop()
        self._start_asgi_task(cycle, app)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if isinstance(cycle, HotRequest):
            cycle.start()
            return
        if type(cycle) is not LastWord:
            self._running = cycle
        super()._start_asgi_task(cycle, app)


class HotRequest:
    """One hot request: in the protocol, its request cycle; to its route, the exchange it answers."""

    method = "POST"
    __slots__ = ("protocol", "match", "route", "params", "path", "headers", "keep_alive", "expect_100",
                 "body", "more_body", "started", "queued", "disconnected", "response_complete", "coding")
    coding: bytes | None  # the body's Content-Encoding (None: as sent), set by start: set() reads it after

    def __init__(self, protocol: GatewayProtocol, match: Match, headers: Headers, keep_alive: bool | None,
                 expect_100: bool) -> None:
        self.protocol, self.match = protocol, match
        # the route's __call__, bound: calling it so costs less than calling the route object
        self.route, self.params, self.path = match.route.__call__, match.params, match.path
        self.headers = headers
        self.keep_alive = keep_alive  # None: marked by the drain (connection._drain_mark)
        self.expect_100 = expect_100
        # the protocol's parts: the first as it came, the rest appended to a bytearray; bytes once the
        # message is complete (set)
        self.body = b""
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

    @property
    def waiting_for_100_continue(self) -> bool:
        """Its client waits for a 100 Continue before it sends the body (as uvicorn's cycle has it)."""
        return self.expect_100 and not self.started

    def start(self) -> None:
        """Its turn on the connection has come: check path and credentials, then read its body."""
        self.started = True
        routes = self.protocol.routes
        try:
            target = self.match.target
            routes.policy.check(target, self.headers)
            if not self.match.checked:
                check_target(target)
            self.coding = http.check_body(self.headers, routes.max_body_bytes)
        except DespinaError as exc:
            self._refuse(exc)
            return
        if self.more_body:
            if self.expect_100 and not self.protocol.transport.is_closing():
                self.protocol.transport.write(CONTINUE)
            flow = self.protocol.flow
            if flow.read_paused:  # pipelined behind another request, or past uvicorn's high-water mark
                flow.resume_reading()
            return
        self.set()

    def set(self) -> None:
        if not self.started or self.queued or self.response_complete:
            return
        if self.disconnected:
            self.response_complete = True
            self.body = b""  # nobody reads an answer: let go of what came of it (respond)
            return
        if len(self.body) > self.protocol.routes.max_body_bytes:
            self._refuse(http.too_large(self.protocol.routes.max_body_bytes))
        elif not self.more_body:
            self.queued = True
            self.body = bytes(self.body)
            if self.coding is not None:  # all that a body sent as it is pays for encodings: this test
                try:
                    self.body = http.decoded(self.body, self.coding, self.protocol.routes.max_body_bytes)
                except DespinaError as exc:
                    fail(self, exc, http.header(self.headers, b"x-request-id"))
                    return
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
        # Let go of the body now. The protocol and its last request refer to each other: after a closed
        # connection only a garbage collection frees them, which no number of large bodies brings about
        # (it counts objects, not bytes): a gateway whose clients connect for each request grew by every
        # body it answered.
        self.body = b""
        protocol = self.protocol
        transport = protocol.transport
        if self.disconnected or transport.is_closing():
            return
        close = not self.keep_alive
        if close and self.keep_alive is None:  # marked by the drain: the client may have sent more since
            self.keep_alive = protocol._more_sent()
            close = not self.keep_alive
        cors = protocol.routes.cors
        if cors is not None:  # all that an answer pays for CORS when it is off: this test
            extra = [*extra, *cors.headers(self.headers)]
        head = http.response_head(status, len(body), content_type, extra, close)
        if len(body) < 65536:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        if close:
            protocol._close()
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
