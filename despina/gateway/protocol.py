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

import logging
import time
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..contract.errors import DespinaError
from . import http
from .auth import AuthPolicy, Target, check_target, classify
from .connection import Clients, ConnectionProtocol, Ended, LastWord, answer_drained, ending
from .cors import CorsPolicy
from .hot_request import HotRequest, TracedHotRequest
from .http import Headers
from .infer import Route
from .trace import Tracer

log = logging.getLogger("despina.gateway")

PREFIX, SUFFIX = b"/v2/models/", b"/infer"


class HotRoutes:
    """Which paths skip ASGI, and what they share: the auth policy, the body limit and the CORS policy
    (None: off)."""

    MATCHES_MAX = 4096  # paths remembered with what they name (a client cannot grow it past this)

    def __init__(self, infer: Route, fn: Route, policy: AuthPolicy, max_body_bytes: int,
                 cors: CorsPolicy | None = None) -> None:
        self.infer, self.fn, self.policy, self.max_body_bytes = infer, fn, policy, max_body_bytes
        self.cors = cors
        self.tracer = infer.gateway.tracer  # Triton's tracing: whether it is on (TracedHotRequest)
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
                 "write_timeout": write_timeout, "clients": clients, "tracer": routes.tracer})


class GatewayProtocol(ConnectionProtocol):
    routes: HotRoutes
    headers: Headers
    tracer: Tracer
    # the class of the next hot request: HotRequest (set below), or TracedHotRequest for the one whose
    # message began while tracing was on (it takes back the class's own)
    _hot: type[HotRequest]
    _began = 0  # when that message began (time.time_ns())

    def on_message_begin(self) -> None:
        # uvicorn builds the ASGI scope here; a hot request needs none, the others get it below
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._head_open, self._head_size = True, 0
        if self.tracer.on:  # all that a request pays for tracing while it is off: this test
            self._began, self._hot = time.time_ns(), TracedHotRequest  # HTTP_RECV_START

    def _asgi(self) -> None:
        """Hand the request to uvicorn's ASGI cycle, with the scope it would have built."""
        url, headers, expect, previous = self.url, self.headers, self.expect_100_continue, self.cycle
        self.__dict__.pop("_hot", None)  # not a hot request: the next one is a HotRequest unless traced
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
        request = self._hot(self, match, self.headers, keep_alive, self.expect_100_continue)
        previous, self.cycle = self.cycle, request
        if previous is None or previous.response_complete:
            request.start()
        else:  # pipelined behind a request not yet answered: it starts when that one is
            self.flow.pause_reading()
            self.pipeline.appendleft((request, None))  # type: ignore[arg-type]

    # uvicorn's on_body and on_message_complete, for a hot request: it is never an upgrade
    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if not isinstance(cycle, HotRequest):  # (a TracedHotRequest too)
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
        if not isinstance(cycle, HotRequest):  # (a TracedHotRequest too)
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
            if self.flow.read_paused:  # (its own test, without its call)
                self.flow.resume_reading()
            if self.timeout_keep_alive_task is None:
                self._idle()
            else:  # _idle's, without its call: the timer is armed
                self._idle_since = self.loop.time()
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


GatewayProtocol._hot = HotRequest
