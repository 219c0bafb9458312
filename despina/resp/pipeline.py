"""What the hot loops build on a connection: a Batch of commands for one `Resp.execute`, a blocking read
that goes out with the next write (ReadAlong), and a stream entry's fields.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from .wire import Arg, Command, packed, prefix


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
