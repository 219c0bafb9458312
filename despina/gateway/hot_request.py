"""A hot request (protocol.py): in its connection's protocol, the request cycle; to its route, the exchange
it answers. Its body is read into it, its route called when the body is whole, and its answer written in one
`transport.write`. A TracedHotRequest is one whose message began while tracing was on: it also has Triton's
HTTP timestamps for the request's trace."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..contract.errors import Code, DespinaError
from . import http
from .auth import check_target
from .http import Headers
from .infer import fail

if TYPE_CHECKING:
    from .protocol import GatewayProtocol, Match
    from .trace import Trace

log = logging.getLogger("despina.gateway")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


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
            if routes.policy.active:  # (its own first test, without its call)
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


class TracedHotRequest(HotRequest):
    """A hot request whose message began while tracing was on: it has Triton's HTTP timestamps, for its
    trace if its route traces it (trace.Trace.over_http sets `traced`)."""

    __slots__ = ("began", "received", "traced")

    def __init__(self, protocol: GatewayProtocol, match: Match, headers: Headers, keep_alive: bool | None,
                 expect_100: bool) -> None:
        super().__init__(protocol, match, headers, keep_alive, expect_100)
        self.began, self.received = protocol._began, 0  # HTTP_RECV_START, HTTP_RECV_END
        self.traced: Trace | None = None
        del protocol._hot  # the next request is a HotRequest again, unless tracing is still on

    def set(self) -> None:
        if not self.more_body and not self.received:  # the whole body is here (it may wait its turn)
            self.received = time.time_ns()
        super().set()

    def respond(self, status: int, body: bytes, content_type: bytes, extra: Headers) -> None:
        traced = self.traced
        if traced is None or self.response_complete:
            super().respond(status, body, content_type, extra)
            return
        traced.stamp("HTTP_SEND_START")
        super().respond(status, body, content_type, extra)
        traced.stamp("HTTP_SEND_END")
async def _complete_when_drained(protocol: GatewayProtocol) -> None:
    await protocol.flow.drain()  # also set when the connection is lost
    protocol.on_response_complete()
