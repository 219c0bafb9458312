"""The gateway's HTTP/1.1 connections: what a server facing clients it cannot trust does around the requests.

uvicorn's httptools protocol reads a request's head without limit and without a deadline, answers a
malformed request at once (dropping the answers still owed to the requests pipelined before it), and
closes the connection straight after an error answer, even while the client is still sending: the kernel
then resets the connection and the client may never read the answer. Here, as nginx and Go's net/http do:

- a request's line and headers are held to HEAD_MAX bytes (431);
- an answer that ends the connection (400, 408, 431) comes after the answers owed to the requests
  before it;
- a connection that ends while the client may still be sending closes lingering: the gateway shuts down
  its side, reads and drops what still comes, and closes once the client closes, goes quiet for
  LINGER_IDLE_S, or LINGER_S have passed;
- a client that shuts down its sending side (a half-close) still gets the answers owed to the requests
  it sent whole, and the connection closes after them (a request it cut short is answered 400).

Its read, keep-alive and write timeouts are timeouts.py's (Timeouts, this class's base). The subclass
(protocol.GatewayProtocol) has the parser's callbacks keep `_head_open` (a request's head is being read)
and `_body_open` (its body is).
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from .. import fds
from . import http
from .timeouts import Timeouts, _unread

log = logging.getLogger("despina.gateway")

# A request's line and headers, at most (its method aside)
HEAD_MAX = 64 * 1024
HEAD_TOO_LARGE = b'{"error":"the request line and headers are over the limit of %d bytes"}' % HEAD_MAX
LINGER_S = 30.0      # the longest a connection lingers (nginx's lingering_time)
LINGER_IDLE_S = 5.0  # ... and how long it waits for more from the client (nginx's lingering_timeout)
REFUSED_LINGER_S = 1.0  # the longest a connection refused past the limit lingers
LIMIT_WARN_S = 60.0  # at most one warning this often that connections past the limit are refused
CUT_SHORT = b'{"error":"malformed HTTP request: the client closed its side before the request was complete"}'
# the answer to HTTP/2's connection preface, which gRPC clients open with (perf_analyzer -i grpc)
NO_HTTP2 = ("an HTTP/2 client (gRPC?) was refused: this server speaks HTTP/1.1 only and has no gRPC "
            "endpoint; use the HTTP/REST API (tritonclient.http, perf_analyzer -i http)")


class HeadTooLarge(Exception):
    """Raised from the parser's callback for a head that came whole in one read, over HEAD_MAX."""


class Ended(Exception):
    """Raised from the parser's callback that has ended the connection: the parser reads no further."""


class LastWord:
    """An answer that ends the connection, in the pipeline in the place of the request it answers."""

    __slots__ = ("data",)

    def __init__(self, status: int, body: bytes) -> None:
        self.data = http.response_head(status, len(body), http.JSON, [], True) + body

    def say(self, protocol: ConnectionProtocol) -> None:
        if not protocol._lingering and not protocol.transport.is_closing():
            protocol.transport.write(self.data)
            protocol._linger()


class Clients:
    """A gateway's client connections and their limit: how many it holds, its limit (fds.connection_limit),
    how many it refused past the limit since it started (its metrics show these three: app.Gateway reports
    them), the refused ones not yet closed, and when it last warned of refusals and how many there were."""

    __slots__ = ("held", "limit", "refused", "refusing", "warned_at", "warned_refused")

    def __init__(self, limit: int) -> None:
        self.held, self.limit, self.refused, self.refusing = 0, limit, 0, 0
        self.warned_at, self.warned_refused = -math.inf, 0

    def figures(self) -> dict[str, int]:
        return {"held": self.held, "limit": self.limit, "refused": self.refused}


class ConnectionProtocol(Timeouts):
    clients: Clients  # the gateway's; set by protocol.protocol_class
    _over = False       # this connection was refused past the limit, and is not closed yet
    _head_open = False  # a request's head is being read
    _head_size = 0      # its bytes so far (0: it began in the last read, not yet counted)
    _head_at = 0.0      # when its first byte was read
    _body_open = False  # a request's body is being read
    _big_read = False   # the read being parsed is larger than HEAD_MAX: a head may come whole in it, over it
    _ended = False      # no more requests are read: an answer that ends the connection is on its way
    _lingering = False
    _linger_until = 0.0
    _eof = False        # the client has shut down its sending side: nothing more comes
    _draining = False   # the server is stopping: each answer ends its connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        clients = self.clients
        clients.held = len(self.connections)
        if clients.held > clients.limit:
            self._over_limit()

    def _over_limit(self) -> None:
        """A connection past the limit: answered 503 at once (the client reads it as the answer to what it
        sends), and closed, lingering, so that the descriptors of the connections held and of Redis's are
        kept. Without a limit, the open-files limit cut in: a reset for the client, nothing in the log, and
        503s from a gateway that could not open a connection to Redis."""
        clients = self.clients
        clients.refused += 1
        now = self.loop.time()
        if now - clients.warned_at >= LIMIT_WARN_S:  # a flood logs a line a minute, not one per connection
            log.warning("%d client connection(s) refused with 503 (the gateway holds %d, its limit: "
                        "DESPINA_MAX_CONNECTIONS, or the open-files limit, ulimit -n, less %d)",
                        clients.refused - clients.warned_refused, len(self.connections) - 1, fds.RESERVE)
            clients.warned_at, clients.warned_refused = now, clients.refused
        self._ended = self._over = True
        clients.refusing += 1
        body = b'{"error":"the gateway holds as many connections as it may (%d): try again"}' % clients.limit
        self.transport.write(http.response_head(503, len(body), http.JSON, [(b"retry-after", b"1")], True)
                             + body)
        # Lingering, the client reads its answer even if its request comes after it; but a flood of clients
        # that neither send nor close would hold a descriptor each meanwhile. So a short linger, and none
        # past a quarter of the reserve (the answer is sent, and a client may see a reset instead).
        if clients.refusing > fds.RESERVE // 4:
            self.transport.close()
            return
        self._linger()
        if self._lingering and not self.transport.is_closing():
            self._linger_until = self.loop.time() + REFUSED_LINGER_S
            self._stop_read_timer()
            self._arm_read_timer(REFUSED_LINGER_S, self._linger_check)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.clients.held = len(self.connections)
        if self._over:
            self._over = False
            self.clients.refusing -= 1

    def shutdown(self) -> None:
        """The server is stopping (SIGTERM). uvicorn closed an idle connection here at once: a request its
        client sent on it just then (a load balancer reuses its connections for a few seconds after a pod
        is told to stop) was cut off unanswered, and a POST cannot safely be sent again. An idle connection
        stays open instead: the requests that come on it are answered, the last received ending it
        (_drain_mark), and its keep-alive timeout closes it if none comes (the one moment a client knows not
        to send, being told the timeout)."""
        self._draining = True
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.keep_alive \
                or getattr(cycle, "response_started", False) or self._more_sent():
            return  # (more sent: the requests in it are read, and the last of them is marked so)
        cycle.keep_alive = None  # the last request read: its answer ends the connection (_drain_mark)
        if isinstance(cycle, RequestResponseCycle):
            answer_drained(self, cycle)

    # While the server drains, the answer that ends a connection is the last one owed on it. uvicorn ended it
    # with the answer to the request in progress, or to the first request read after the drain began, and
    # the requests the client had pipelined behind that one (read, or sent and not read yet) were cut off
    # unanswered: a POST cannot safely be sent again. So the last request read is marked (keep_alive None:
    # its answer ends the connection, and says so), the mark moves on to each request read after it, and
    # the marked request's answer keeps the connection if the client has sent more by the time it goes.
    def _drain_mark(self, previous: Any, keep_alive: bool) -> bool | None:
        """The keep-alive of a request read while the server drains (None: marked, if the client asked to
        keep the connection), and `previous`, the request read before it, no longer marked if its answer
        has not begun."""
        if previous is not None and previous.keep_alive is None and not previous.response_complete \
                and not getattr(previous, "response_started", False):
            previous.keep_alive = True
        return None if keep_alive else False

    def _more_sent(self) -> bool:
        """The client has sent more than the requests read: a request's head begun, or bytes not read yet
        (not just the rest of a body being read)."""
        return not self._body_open and (self._head_open or _unread(self.transport) > 0)

    def data_received(self, data: bytes) -> None:
        if self._head_open or self._ended:
            self._guarded(data)
        elif len(data) > HEAD_MAX:  # the protocol's on_headers_complete checks each head that ends in it
            self._big_read = True
            try:
                self._feed(data)
            finally:
                self._big_read = False
        else:
            self._feed(data)
        if self._head_open or self._body_open:
            self._reading(data)

    def _feed(self, data: bytes) -> None:
        self._idle_since = None  # busy: the keep-alive timer, when it fires, leaves the connection open
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, Ended):
                return
            if isinstance(exc.__context__, HeadTooLarge):  # raised by a callback (the parser wraps it)
                self._last_word(431, HEAD_TOO_LARGE)
                return
            if self.parser.get_method() == b"PRI":  # llhttp stops at the preface: "Pause on PRI/Upgrade"
                self.logger.warning(NO_HTTP2)
                self._last_word(400, orjson.dumps({"error": NO_HTTP2}))
                return
            self.logger.warning("Invalid HTTP request received.")
            self._last_word(400, orjson.dumps({"error": f"malformed HTTP request: {exc}"}))
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol's, not uvicorn's None
        """The client sends no more: a half-close (shutdown(SHUT_WR): HTTP/1.0 clients, `nc -N`, some
        proxies), which says that the client has sent all it will, not that it has stopped listening (RFC 9112
        §9.6 as the HTTP WG clarified it). The answers owed to the requests it sent whole still go, and the
        connection closes after the last one. uvicorn closed the connection here, and the answers were lost.
        (A client that closed outright makes the first answer written fail, as before.)"""
        self._eof = True
        cycle = self.cycle
        if self._lingering:
            return None  # the end that a lingering close waits for
        if self._head_open or (self._body_open and cycle is not None and not cycle.response_complete):
            self._last_word(400, CUT_SHORT)  # a request that can never be whole
        elif self._ended:
            pass  # an answer that ends the connection is on its way (_linger closes after it)
        elif cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False  # the last request read is answered last: its answer ends the connection
        else:
            return None  # nothing owed: close
        return True  # keep the connection open for writing

    def _guarded(self, data: bytes) -> None:
        """A read while a request's head is open, or once the connection has ended. uvicorn's protocol read a
        head without limit: a client that sent headers without end was never answered, and grew the parser's
        buffer (copied whole at each read) until memory ran out."""
        if self._ended:
            if self._lingering:
                self._read_at = self.loop.time()
            return
        room = HEAD_MAX - self._head_size
        self._head_size += len(data)
        if len(data) <= room:
            self._feed(data)
            return
        self._feed(data[:room])  # the head may end in it, and what follows is a body, or more requests
        if self._ended or self.transport.is_closing():  # a malformed head: answered 400
            return
        if self._head_open:
            if self._head_size:  # the same head, still open
                self._last_word(431, HEAD_TOO_LARGE)
                return
            self._head_began(self.loop.time(), data, room)  # another request's, begun in the part
            if self._ended:
                return
        self.transport.get_protocol().data_received(data[room:])  # type: ignore[attr-defined]  # ours, or an upgrade's

    def _head_began(self, now: float, data: bytes, end: int) -> None:
        """A request's head began in data[:end] (a read, or its part fed last), and is still open: its header
        time starts, and its size is what of it came: from its request line (found by its URL, after which an
        open head has no blank line) to `end`, or, its request line incomplete, its URL so far."""
        self._head_at = now
        at = data.rfind(self.url + b" HTTP/", 0, end) if self.url else -1
        self._head_size = end - at if at >= 0 and data.find(b"\r\n\r\n", at, end) < 0 else len(self.url)
        if self._head_size >= HEAD_MAX:  # (a read larger than the limit)
            self._last_word(431, HEAD_TOO_LARGE)

    def _check_head(self) -> None:
        """Raise HeadTooLarge for a head over HEAD_MAX (the protocol calls this for the heads that end in a
        read larger than that: one that came whole in it was not counted)."""
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > HEAD_MAX:
            raise HeadTooLarge

    def _last_word(self, status: int, body: bytes) -> None:
        """Answer with `status` and end the connection: after the answers owed to the requests read before
        (pipelined), in the place of the request whose body is being read, if any."""
        self._ended = True
        self._stop_read_timer()
        word, cycle, pipeline = LastWord(status, body), self.cycle, self.pipeline
        if self._body_open and cycle is not None and not cycle.response_complete:
            _silence(cycle)  # this answers it
            if pipeline and pipeline[0][0] is cycle:  # it waits its turn: the answer takes its place
                pipeline[0] = (word, None)  # type: ignore[assignment]
                return
        elif (cycle is not None and not cycle.response_complete) or pipeline:
            pipeline.appendleft((word, None))  # type: ignore[arg-type]
            self.flow.pause_reading()
            return
        word.say(self)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is LastWord:
            cycle.say(self)
        else:
            super()._start_asgi_task(cycle, app)

    def _close(self) -> None:
        """Close after an answer that ends the connection: lingering if the client may still be sending."""
        if self._head_open or self._body_open or self._ended or _unread(self.transport):
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        transport = self.transport
        if self._lingering or transport.is_closing():
            return
        self._ended = self._lingering = True
        self._stop_read_timer()
        if self._eof or not transport.can_write_eof():  # (the client has already closed its side)
            transport.close()
            return
        transport.write_eof()  # once what is written has gone: the client reads its answer, then the end
        self.flow.resume_reading()
        now = self._read_at = self.loop.time()
        self._linger_until = now + LINGER_S
        self._arm_read_timer(LINGER_IDLE_S, self._linger_check)

    def _linger_check(self) -> None:
        self._read_timer, self._read_timer_at = None, math.inf
        now = self.loop.time()
        until = min(self._read_at + LINGER_IDLE_S, self._linger_until)
        if now >= until:  # quiet for LINGER_IDLE_S, or lingering for LINGER_S
            self.transport.close()
        else:
            self._arm_read_timer(until - now, self._linger_check)


def _silence(cycle: Any) -> None:
    """A request that the connection's last word answers: it reads no more, and writes nothing, and what it
    read of its body goes (a protocol and its request refer to each other: kept, it stayed until a garbage
    collection)."""
    cycle.disconnected = cycle.response_complete = True
    cycle.body = b""
    if isinstance(cycle, RequestResponseCycle):
        cycle.waiting_for_100_continue = False
    cycle.message_event.set()


def answer_drained(protocol: ConnectionProtocol, cycle: RequestResponseCycle) -> None:
    """An ASGI request marked by the drain (keep_alive None): as its answer begins, it ends the connection
    unless the client has sent more by then (ConnectionProtocol._drain_mark)."""
    send = cycle.send

    async def answering(message: Any) -> None:
        if not cycle.response_started:
            if cycle.keep_alive is None:
                cycle.keep_alive = protocol._more_sent()
            if not cycle.keep_alive:
                ending(protocol, cycle)
        await send(message)

    cycle.send = answering  # type: ignore[method-assign]


def ending(protocol: ConnectionProtocol, cycle: RequestResponseCycle) -> None:
    """An ASGI request whose answer ends the connection: its close lingers if need be, and its answer
    advertises no keep-alive."""
    cycle.transport = ClosingTransport(protocol)  # type: ignore[assignment]
    cycle.default_headers = [h for h in cycle.default_headers if h[0] != b"keep-alive"]


class ClosingTransport:
    """The transport as an ASGI cycle that ends its connection sees it: its close() lingers if need be."""

    def __init__(self, protocol: ConnectionProtocol) -> None:
        self._protocol, self._transport = protocol, protocol.transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol._close()
