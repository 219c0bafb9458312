"""A lean Redis connection for the hot loops: the gateway's request writes and reply reads, and a
worker's stream reads and reply writes.

redis-py's asyncio pipeline spends about 140 µs of CPU per round trip on this machine (command
objects, the connection pool, retries, event hooks); the same two commands packed by hand and parsed
by hiredis cost 60, and the hot loops make one or two round trips per batch. Commands are written in
one `transport.write` and their replies matched in order, so one connection carries pipelines from
several callers; a blocking read needs a connection of its own. Errors are redis-py's exception
types (ConnectionError, TimeoutError, ResponseError), so callers handle both clients alike. Every
other use of Redis stays on redis-py (redis_client.connect).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import numbers
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from hiredis import pack_command
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .redis_client import CONNECT_TIMEOUT_S, keep_alive

Arg = bytes | str | int | float
Command = Sequence[Arg] | bytes  # bytes, or Parts: a command packed already (`Prefix`)
LARGE = 1 << 16  # an argument this long is written as it is, never copied into its command's bytes


class Parts(list[bytes]):
    """A command packed in parts, its large arguments (LARGE) among them as they are: `gather` and the
    connection's write pass them on without copying them (a 100 MB tensor was copied twice here)."""


def pack(commands: Iterable[Command]) -> bytes:
    """Commands in RESP (arrays of bulk strings), packed by hiredis in C: a worker's reply pipeline
    of some 60 arguments costs 11 µs this way and 30 in Python. hiredis takes str, bytes, int and
    float (repr's digits, as redis-py writes them); a command with anything else (a bool, a numpy
    integer) is packed here, each argument as its int or float value. A command given as bytes or
    Parts was packed already (`Prefix`)."""
    packed = gather(commands)
    return packed if isinstance(packed, bytes) else b"".join(packed)


def gather(commands: Iterable[Command]) -> bytes | list[bytes]:
    """`pack`'s bytes; or, where a command holds a large argument (Parts), the parts to write one after
    the other: each large argument alone, what lies between them joined."""
    out = []
    large = False
    for command in commands:
        if type(command) is bytes:
            out.append(command)
            continue
        if type(command) is Parts:
            out += command
            large = True
            continue
        try:  # the ignore: hiredis's stub types the command as a 1-tuple
            out.append(pack_command(command if type(command) is tuple  # type: ignore[arg-type]
                                    else tuple(command)))
        except TypeError:
            out.append(_pack_slowly(command))
    if not large:
        return b"".join(out)
    parts: list[bytes] = []
    small: list[bytes] = []
    for part in out:
        if len(part) < LARGE:
            small.append(part)
            continue
        if small:
            parts.append(b"".join(small))
            small = []
        parts.append(part)
    if small:
        parts.append(b"".join(small))
    return parts


class Prefix:
    """A command's leading arguments, packed once, for a command a hot loop sends again and again with
    only its last arguments new (a reply stream's XADD, a statistics hash's EVAL): `command(*rest)`
    packs just those. hiredis spends ~1,800 instructions an argument, most of them in sprintf writing
    its length; a worker's pipeline repeats some 25 of its arguments every batch. `prefix` keeps them."""

    __slots__ = ("_count", "_packed")

    def __init__(self, *args: Arg) -> None:
        self._count = len(args)
        self._packed = pack([args]).split(b"\r\n", 1)[1]  # the arguments, without "*N"

    def command(self, *rest: Arg) -> bytes | Parts:
        out = [b"*%d\r\n" % (self._count + len(rest)), self._packed]
        large = False
        for arg in rest:
            data = arg if type(arg) is bytes else _data(arg)
            if len(data) < 1024:  # a small one formatted in one go; a large one not copied for it
                out.append(b"$%d\r\n%b\r\n" % (len(data), data))
            else:
                out += (b"$%d\r\n" % len(data), data, b"\r\n")
                large = large or len(data) >= LARGE
        return Parts(out) if large else b"".join(out)


@functools.lru_cache(maxsize=1024, typed=True)  # typed: 1 and 1.0 are packed apart
def prefix(*args: Arg) -> Prefix:
    """The Prefix of these leading arguments, kept for the next command that repeats them (Batch's)."""
    return Prefix(*args)


@functools.lru_cache(maxsize=1024, typed=True)
def packed(*command: Arg) -> bytes:
    """A command with nothing new in it, packed once and kept (a reply stream's PEXPIRE, a worker's read)."""
    return pack([command])


def _pack_slowly(command: Sequence[Arg]) -> bytes:
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        data = _data(arg)
        out += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(out)


def _data(arg: Arg) -> bytes:
    """An argument's bytes: str as UTF-8, an integer (a bool, a numpy one) as its value, anything else as
    a float's repr."""
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, numbers.Integral):
        return b"%d" % int(arg)
    return repr(float(arg)).encode()


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
            raise kind(f"cannot connect to Redis: {exc or 'timed out'}") from None
        # the connection's own commands first; it is this Resp's (connected) only after them (_opened)
        hello: list[Command] = []
        if o.get("password"):
            user = [o["username"]] if o.get("username") else []
            hello.append(["AUTH", *user, o["password"]])
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
        o = self.options
        if o.get("connection_class") is not SSLConnection:
            return None
        context = ssl.create_default_context(cafile=o.get("ssl_ca_certs"))
        if o.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

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


class ReadAlong:
    """A loop's next blocking read, waiting to go out with the next write of the connection it reads on
    (one write, one wake-up of the server, where a read of its own would make two). The reader `wait`s;
    the writer's `send` takes the read along if one waits, or `release` lets it go alone."""

    def __init__(self) -> None:
        self._waiting: asyncio.Future[asyncio.Future[list[Any]] | None] | None = None

    async def wait(self, limit_s: float | None = None) -> asyncio.Future[list[Any]] | None:
        """The read as a write sent it (await it with Resp.replies), or None: read now (released, or
        no write came within `limit_s`)."""
        loop = asyncio.get_running_loop()
        waiting = self._waiting = loop.create_future()
        timer = None if limit_s is None else loop.call_later(limit_s, self.release)
        try:
            return await waiting
        finally:
            if timer is not None:
                timer.cancel()
            self._waiting = None

    def release(self) -> None:
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(None)

    def send(self, commands: list[Command],
             send_with: Callable[[list[Command]], Sequence[asyncio.Future[list[Any]]] | None]
             ) -> asyncio.Future[list[Any]] | None:
        """When a read waits: `send_with(commands)` writes the commands and the read together and returns
        their futures (or None: it could not, the read goes alone); the read's goes to the reader.
        The commands' future, or None: send them as usual."""
        waiting = self._waiting
        if waiting is None or waiting.done():
            return None
        sent = send_with(commands)
        waiting.set_result(None if sent is None else sent[-1])
        return None if sent is None else sent[0]


class Batch:
    """Commands gathered for one `Resp.execute`, named as redis-py's pipeline names them (the subset
    the hot loops use), so that helpers fill either. Each is packed as it is added, its leading
    arguments (the command, its keys: the same batch after batch) from a kept `prefix`."""

    def __init__(self) -> None:
        self.commands: list[Command] = []

    def __len__(self) -> int:
        return len(self.commands)

    def xadd(self, stream: str, fields: dict[bytes | str, Arg], maxlen: int | None = None,
             approximate: bool = True) -> None:
        trim: tuple[Arg, ...] = ("MAXLEN", "~" if approximate else "=", maxlen) if maxlen else ()
        rest: list[Arg] = []
        for kv in fields.items():
            rest += kv
        self.commands.append(prefix("XADD", stream, *trim, "*").command(*rest))

    def pexpire(self, key: str, ms: int) -> None:
        self.commands.append(packed("PEXPIRE", key, ms))

    def hincrby(self, key: str, field: str, n: int) -> None:
        self.commands.append(prefix("HINCRBY", key, field).command(n))

    def decrby(self, key: str, n: int) -> None:
        self.commands.append(prefix("DECRBY", key).command(n))

    def eval(self, script: str, numkeys: int, *args: Arg) -> None:
        self.commands.append(prefix("EVAL", script, numkeys, *args[:numkeys]).command(*args[numkeys:]))

    def xack(self, stream: str, group: str, *ids: bytes) -> None:
        self.commands.append(prefix("XACK", stream, group).command(*ids))

    def xdel(self, stream: str, *ids: bytes) -> None:
        self.commands.append(prefix("XDEL", stream).command(*ids))

    def srem(self, key: str, *members: Arg) -> None:
        self.commands.append(("SREM", key, *members))


def fields(raw: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's flat [field, value, ...] as a dict, as redis-py gives it."""
    it = iter(raw)
    return dict(zip(it, it))
