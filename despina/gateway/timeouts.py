"""The gateway's HTTP/1.1 connections' timeouts (the base of connection.ConnectionProtocol):

- a request's line and headers must all come within `header_timeout` seconds of their first byte, and a
  body may pause at most `body_timeout` seconds between two reads (408). Neither counts while the gateway
  keeps the client waiting (an answer it owes, a 100 Continue not yet sent, what the client sent left
  unread), nor while a request waits for its answer (the request timeout's business), nor between requests
  (the keep-alive timeout's). The timer is armed only when a read leaves a request incomplete: a request
  whose head and body come in one read costs two flags;
- an idle connection closes `timeout_keep_alive` seconds after its last answer, as uvicorn's, with one
  timer re-armed when it fires;
- a connection whose client reads none of what the gateway has to send it for `write_timeout` seconds is
  cut (nginx's send_timeout): uvicorn's flow control stops the gateway reading from a client that does
  not read its answers, but kept the connection, its pipelined requests and the answers not yet sent for
  as long as the client kept its socket open, and a connection closed with answers still unsent waited for
  the client to read them.
"""
from __future__ import annotations

import asyncio
import fcntl
import math
import struct
import termios
from collections.abc import Callable
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class Timeouts(HttpToolsProtocol):
    header_timeout: float  # seconds (settings.header_timeout_s); set by protocol.protocol_class
    body_timeout: float
    write_timeout: float
    cycle: Any  # uvicorn's RequestResponseCycle, or the subclass's request in its place

    # connection.ConnectionProtocol's: a request's head or body being read, since when (the head), and
    # whether the connection has ended
    _head_open: bool
    _head_size: int
    _head_at: float
    _body_open: bool
    _ended: bool
    _head_began: Callable[[float, bytes, int], None]
    _last_word: Callable[[int, bytes], None]

    _read_at = 0.0      # the last read (while a request was incomplete, or lingering)
    _read_timer: asyncio.TimerHandle | None = None
    _read_timer_at = math.inf  # when it fires
    _waited = False     # the last check found the gateway keeping the client waiting
    _unsent = -1        # bytes waiting to be sent at the last write check that found them stuck (-1: none)
    # the write check of all this class's connections: one timer while there are any
    _write_check: ClassVar[asyncio.TimerHandle | None] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle()  # a connection that never sends a byte closes as an idle one does
        cls = type(self)
        if cls._write_check is None:
            cls._write_check = self.loop.call_later(self.write_timeout, _check_writes, cls, self.connections,
                                                    self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop_read_timer()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    # The read timeouts: one timer, armed when a read leaves a request incomplete and moved only when the
    # deadline comes nearer; a timer that fires early (the body came on meanwhile) sets itself again.
    def _reading(self, data: bytes) -> None:
        if self._ended:
            return
        now = self._read_at = self.loop.time()
        if self._head_open:
            if self._head_size == 0:  # its first byte came in this read
                self._head_began(now, data, len(data))
                if self._ended:
                    return
            deadline = self._head_at + self.header_timeout
        else:
            deadline = now + self.body_timeout
        if deadline < self._read_timer_at:  # no timer (inf), or one for later
            self._stop_read_timer()
            self._arm_read_timer(deadline - now, self._read_check)

    def _read_check(self) -> None:
        self._read_timer, self._read_timer_at = None, math.inf
        if self._ended or not (self._head_open or self._body_open) or self.transport.is_closing() \
                or self.transport.get_protocol() is not self:
            return
        now = self.loop.time()
        if self._client_waits():
            self._waited = True
        elif self._waited:  # the client waited on the gateway until lately: its time starts again now
            self._waited = False
        else:
            deadline = (self._head_at + self.header_timeout if self._head_open
                        else self._read_at + self.body_timeout)
            if deadline <= now:
                self._timed_out()
            else:
                self._arm_read_timer(deadline - now, self._read_check)
            return
        self._head_at = self._read_at = now
        self._arm_read_timer(self.header_timeout if self._head_open else self.body_timeout, self._read_check)

    def _client_waits(self) -> bool:
        """The client is waiting on the gateway: what it sent is not read yet (reading is paused while
        earlier requests are answered, or while a route has not asked for the body), or it waits for the
        100 Continue that the route sends when it asks for the body."""
        if _unread(self.transport):
            return True
        return self._body_open and bool(getattr(self.cycle, "waiting_for_100_continue", False))

    def _timed_out(self) -> None:
        if self._head_open:
            what = f"the request line and headers did not all come within {self.header_timeout:g} s"
        elif self.cycle is not None and self.cycle.response_complete:
            self.transport.close()  # answered before its body came (refused), and the rest never came
            return
        else:
            what = f"no more of the request body came for {self.body_timeout:g} s"
        self._last_word(408, orjson.dumps({"error": f"request timeout: {what}"}))

    def _arm_read_timer(self, delay: float, check: Callable[[], None]) -> None:
        self._read_timer = self.loop.call_later(delay, check)
        self._read_timer_at = self.loop.time() + delay

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer, self._read_timer_at = None, math.inf

    # The keep-alive timeout, as uvicorn's (an idle connection closes timeout_keep_alive seconds after
    # its last answer), with one timer re-armed when it fires instead of one made and cancelled per
    # request (3 µs a request on a small model).
    _idle_since: float | None = None  # when the last answer went out, while nothing new has come

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None  # busy: the timer, when it fires, leaves the connection open

    def _idle(self) -> None:
        """Nothing to answer or read: the connection closes if it stays so for the timeout."""
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self._keep_alive_check)

    def _keep_alive_check(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None or self._ended:
            return  # a request is open: its answer arms the timer again (or the connection is ending)
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_check)
        elif not _unread(self.transport):
            self.timeout_keep_alive_handler()
        # else a request reached the socket as the timeout fell, not yet read (the loop runs its timers
        # before it reads): closing now would reset the connection under it, and it is read next

    # The write timeout. What the gateway writes goes to the kernel, then to the transport's buffer once the
    # kernel's is full; past the buffer's high-water mark the transport pauses writing, and the protocol stops
    # reading and answering (uvicorn's flow control). While writing is paused, or the connection is closing,
    # nothing more is written to it: what waits to be sent (in the buffer and the kernel) only shrinks as the
    # client reads. If it has not shrunk between two checks, write_timeout seconds apart, the client reads
    # nothing.
    def resume_writing(self) -> None:
        self._unsent = -1
        super().resume_writing()

    def _check_unsent(self) -> None:
        transport = self.transport
        buffered = transport.get_write_buffer_size()
        if buffered == 0 or not (self.flow.write_paused or transport.is_closing()):
            self._unsent = -1
            return
        unsent = buffered + _in_kernel(transport)
        if 0 <= self._unsent <= unsent:  # nothing sent since the last check
            transport.abort()
        else:
            self._unsent = unsent


def _check_writes(cls: type[Timeouts], connections: set[Any], loop: asyncio.AbstractEventLoop
                  ) -> None:
    """Cut the connections whose clients read nothing since the last check; check again while there are any
    (the set is uvicorn's server's: an upgraded connection's protocol is another class)."""
    cls._write_check = None
    for protocol in list(connections):
        if isinstance(protocol, cls) and protocol.transport is not None:
            protocol._check_unsent()
    if connections:
        cls._write_check = loop.call_later(cls.write_timeout, _check_writes, cls, connections, loop)


def _in_kernel(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this connection that the client has not acknowledged (read) yet."""
    sock = transport.get_extra_info("socket")
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0])
    except (AttributeError, OSError, ValueError):  # no socket left: nothing waits
        return 0


def _unread(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this connection that the loop has not read yet."""
    sock = transport.get_extra_info("socket")
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0])
    except (AttributeError, OSError, ValueError):  # no socket left: nothing to read
        return 0
