"""The connection (Resp): pipelines written in one `transport.write`, their replies parsed by hiredis and
matched in order; (re)connected lazily, with the credentials and database of a redis-py client (`like`).
"""
from __future__ import annotations

import asyncio
import itertools
import ssl
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import RedisSSLContext, SSLConnection, parse_url
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..redis_client import CONNECT_TIMEOUT_S, keep_alive
from .wire import Command, gather

READER_KEPT = 1 << 20  # bytes a connection's reader may have taken before it is let go (data_received)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.fed = 0  # bytes fed to the reader since it was made
        self.waiting: deque[tuple[list[Any], int, asyncio.Future[list[Any]]]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        self.fed += len(data)
        waiting = self.waiting
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(ConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                return
            if self.fed > READER_KEPT and not self.reader.has_data():
                # hiredis keeps its buffer at the size of the largest reply until more data comes, and a
                # blocking read may bring none for long: a large reply's copy stayed in memory meanwhile.
                # Read to its end (nothing of another reply begun), the reader is let go for a new one.
                self.reader, self.fed = hiredis.Reader(), 0
            if not waiting:  # a reply nobody asked for: the stream is out of step
                self.fail(ConnectionError("unexpected reply from Redis"))
                return
            replies, expected, fut = waiting[0]
            replies.append(reply)
            if len(replies) == expected:
                waiting.popleft()
                if not fut.done():
                    fut.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"lost the connection to Redis: {exc or 'closed'}"))

    def fail(self, error: Exception) -> None:
        self.lost = self.lost or error
        while self.waiting:
            fut = self.waiting.popleft()[2]
            if not fut.done():
                fut.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class Resp:
    """One lazily (re)connected Redis connection. `execute` sends a pipeline and returns its replies;
    an error reply raises ResponseError unless `errors` is False (then it is in the list)."""

    def __init__(self, options: Mapping[str, Any], identify: bool = False) -> None:
        self.options = options  # as redis-py's parse_url gives them
        # with `identify`, the connection's CLIENT ID once connected, where another connection may end
        # its blocking command with CLIENT UNBLOCK (None: not known, or the server does not allow it)
        self.identify = identify
        self.client_id: int | None = None
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        # callers that found no connection, in the order they came: written first, in one write, when it
        # opens (a later caller must not overtake them: a decoupled model's responses keep their order)
        self._queued: deque[tuple[Sequence[Command], asyncio.Future[asyncio.Future[list[Any]]]]] = deque()

    @classmethod
    def from_url(cls, url: str) -> Resp:
        return cls(parse_url(url))

    @classmethod
    def like(cls, redis: aioredis.Redis, identify: bool = False) -> Resp:
        """A connection to the server a redis-py client talks to, with its credentials and database."""
        pool = redis.connection_pool
        return cls({**pool.connection_kwargs, "connection_class": pool.connection_class}, identify)

    async def execute(self, commands: Sequence[Command], errors: bool = True) -> list[Any]:
        if not commands:
            return []
        sent = self.send(commands)
        if sent is None:
            turn: asyncio.Future[asyncio.Future[list[Any]]] = asyncio.get_running_loop().create_future()
            self._queued.append((commands, turn))
            self._connect()
            sent = [await turn]
        return await self.replies(sent[0], errors)

    @property
    def connected(self) -> bool:
        protocol = self._protocol
        return protocol is not None and protocol.lost is None and protocol.transport is not None

    def send(self, *pipelines: Sequence[Command]) -> list[asyncio.Future[list[Any]]] | None:
        """Several pipelines in one write, so one wake-up of the server, each answered by a future of its
        own (await them with `replies`); a blocking command may end the last one without holding up the
        others' replies. None while not connected: `execute` connects."""
        if not self.connected:
            return None
        assert self._protocol is not None
        return _write(self._protocol, pipelines)

    def _connect(self) -> None:
        """Open the connection (one attempt at a time); `_opened` writes what was queued meanwhile."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._opened)

    def _opened(self, connecting: asyncio.Future[_Protocol]) -> None:
        self._connecting = None
        queued = [(commands, turn) for commands, turn in self._queued if not turn.done()]  # not cancelled
        self._queued.clear()
        if connecting.cancelled():
            error: BaseException | None = ConnectionError("lost the connection to Redis")
        else:
            error = connecting.exception()
        if error is None:
            self._protocol = connecting.result()
            if queued:
                for (_, turn), fut in zip(queued, _write(self._protocol, [c for c, _ in queued])):
                    turn.set_result(fut)
            return
        for _, turn in queued:  # every caller of this attempt fails with it, at once
            turn.set_exception(error)

    async def replies(self, fut: asyncio.Future[list[Any]], errors: bool = True, shield: bool = False
                      ) -> list[Any]:
        """What `send` answered with: as `execute` returns it, and raises. Cancelled, the connection
        starts afresh (the replies would come to the next caller), unless `shield`: then the future
        stays, and takes its replies, to keep those sent with it (a blocking read cancelled while the
        commands before it are still answered)."""
        try:
            replies = await (asyncio.shield(fut) if shield else fut)
        except asyncio.CancelledError:
            if shield:  # nobody will look at its outcome: retrieved here, so that none is reported
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            elif self._protocol is not None:
                self._protocol.fail(ConnectionError("a command was cancelled"))
            raise
        if errors:
            for reply in replies:
                if isinstance(reply, hiredis.ReplyError):
                    raise ResponseError(str(reply))
        return replies

    async def _open(self) -> _Protocol:
        o = self.options
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if "path" in o:
                    _, protocol = await loop.create_unix_connection(_Protocol, o["path"])
                else:
                    transport, protocol = await loop.create_connection(
                        _Protocol, o.get("host", "localhost"), o.get("port", 6379), ssl=self._ssl())
                    keep_alive(transport.get_extra_info("socket"))
        except OSError as exc:  # the built-in TimeoutError (asyncio.timeout's) is one too
            kind = RedisTimeoutError if isinstance(exc, TimeoutError) else ConnectionError
            raise kind(f"cannot connect to Redis: {exc or 'timed out'}") from exc  # (its errno: fds.shortage)
        # the connection's own commands first; it is this Resp's (connected) only after them (_opened)
        hello: list[Command] = []
        if o.get("password"):
            # AUTH's two-argument form, as redis-py's HELLO AUTH: its one-argument form is refused by a Redis
            # that asks no password ("called without any password configured"), which redis-py's
            # connections were let on: every request failed on this connection, the gateway still ready
            hello.append(["AUTH", o.get("username") or "default", o["password"]])
        if o.get("db"):
            hello.append(["SELECT", o["db"]])
        try:
            if hello:
                await self.replies(_write(protocol, [hello])[0])
            self.client_id = None
            if self.identify:  # UNBLOCK of id 0 (no client) answers 0 where this user may unblock at all
                known, allowed = await self.replies(
                    _write(protocol, [[["CLIENT", "ID"], ["CLIENT", "UNBLOCK", 0]]])[0], errors=False)
                self.client_id = known if type(known) is int and type(allowed) is int else None
        except BaseException:
            protocol.fail(ConnectionError("closed"))
            raise
        return protocol

    def _ssl(self) -> ssl.SSLContext | None:
        """A rediss:// connection's TLS context as redis-py builds it (RedisSSLContext), from the options its
        SSLConnection takes (ssl_certfile, ssl_keyfile, ssl_check_hostname, ssl_ca_path, ...) and with its
        defaults. Built here from two of them, it sent no client certificate (one Redis asks for by
        default) and checked the hostname that ssl_check_hostname=false had redis-py leave alone."""
        o = self.options
        if o.get("connection_class") is not SSLConnection:
            return None
        tls: dict[str, Any] = {"cert_reqs": "required", "check_hostname": True}  # SSLConnection's defaults
        tls.update((name[4:], value) for name, value in o.items() if name.startswith("ssl_"))
        return RedisSSLContext(**tls).get()

    def close(self) -> None:
        if self._connecting is not None:  # the callers waiting for it fail (_opened)
            self._connecting.cancel()
        if self._protocol is not None:
            self._protocol.fail(ConnectionError("closed"))
            self._protocol = None


def _write(protocol: _Protocol, pipelines: Sequence[Sequence[Command]]) -> list[asyncio.Future[list[Any]]]:
    """Pipelines in one write on a connection, each answered by a future of its own."""
    assert protocol.transport is not None
    loop = asyncio.get_running_loop()
    futures = []
    for commands in pipelines:
        fut: asyncio.Future[list[Any]] = loop.create_future()
        if commands:
            protocol.waiting.append(([], len(commands), fut))
        else:
            fut.set_result([])
        futures.append(fut)
    data = gather(itertools.chain(*pipelines))
    if isinstance(data, bytes):
        protocol.transport.write(data)
    else:  # large arguments as they are (uvloop's writelines copies none of them)
        protocol.transport.writelines(data)
    return futures
