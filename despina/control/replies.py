"""The control plane's answers to commands, written together: each on the list its command names, and the
command acknowledged off its stream."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import redis.asyncio as aioredis

from ..contract.commands import Answer, Command
from ..contract.keys import CONTROL_GROUP, Keys

REPLY_TTL_S = 60


class Replies:
    """Commands answered at the same moment (a hundred cold starts that end in one tick) share one pipeline,
    one at a time: each in its own took a connection of the pool each, and past its 64 the answers were lost
    ("Too many connections"), their callers left waiting out their time."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self._queue: list[tuple[bytes, Command | None, Answer | None, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def send(self, entry_id: bytes, command: Command | None, answer: Answer | None) -> None:
        """Push the command's answer (None: nobody waits for one) and acknowledge its entry; raises what
        writing them raised."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((entry_id, command, answer, written))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all())
        await written

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    async def _write_all(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            pipe = self.redis.pipeline(transaction=False)
            for entry_id, command, answer, _ in batch:
                if command is not None and answer is not None:
                    self._push(pipe, command, answer)
                pipe.xack(self.keys.control_commands, CONTROL_GROUP, entry_id)
                pipe.xdel(self.keys.control_commands, entry_id)
            failed: BaseException | None = None
            try:
                await pipe.execute()
            except Exception as exc:  # each sender says what went wrong
                failed = exc
            for *_, written in batch:
                if written.done():
                    continue
                if failed is None:
                    written.set_result(None)
                else:
                    written.set_exception(failed)

    def _push(self, pipe: aioredis.client.Pipeline, command: Command, answer: Answer) -> None:
        if command.reply.startswith(self.keys.control_answers("")):  # the gateway's list of answers
            pipe.rpush(command.reply, replace(answer, id=command.id).dumps())
            pipe.expire(command.reply, REPLY_TTL_S)
        else:  # a gateway of an earlier version waits on a list of the command's own
            pipe.lpush(self.keys.control_reply(command.id), answer.dumps())
            pipe.expire(self.keys.control_reply(command.id), REPLY_TTL_S)
