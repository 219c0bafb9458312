"""The gateway's line to the control plane: a command on its stream, the answer on this gateway's list.

Every call's command names one answers list of this client (`Keys.control_answers`); one reader waits on
it for all of them and hands each answer to its call by the command's id. A call holds no connection of
its own while it waits, so a cold start of hundreds of models at once waits for nothing but the cold starts.
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import clock, logs
from ..contract.commands import Answer, Command
from ..contract.errors import DespinaError, Unavailable
from ..contract.keys import FIELD, Keys
from . import refusals

log = logging.getLogger("despina.gateway")

COMMANDS_MAXLEN = 10_000
# Calls waiting for their answers at once, at most: each holds its command and a future, nothing else.
# Past it, a call is answered 503 at once (a gateway hit by that many cold starts at once is overloaded).
MAX_CALLS = 4096
# How long the reader's one wait on the answers list lasts before it looks again (it stops once no call
# waits); a stop cancels it.
READ_WAIT_S = 5.0
# Answers taken in one read besides the first (LPOP's count: Redis 6.2).
READ_COUNT = 1000
# A call is over (its answer, else 503) this long before its time, so that what the gateway answers reaches
# a client that waits exactly that long (a timeout the same as the server's); the control plane is told to
# answer as long before that again, so that its answer (why a wake failed, say) comes, not the gateway's
# "did not answer". Of a short call, a part of its time (answer_room).
ANSWER_ROOM_S = 0.25


def answer_room(timeout: float) -> float:
    """How long before its time a call of `timeout` seconds is over."""
    return min(ANSWER_ROOM_S, max(timeout, 0.0) / 8)


class ControlClient:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.answers = keys.control_answers(f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        # command id -> the call waiting for its answer (None: the gateway gave up waiting)
        self._calls: dict[str, asyncio.Future[Answer | None]] = {}
        self._outbox: list[tuple[Command, asyncio.Future[None]]] = []  # commands to send, and who waits
        self._sender: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False  # give_up: the calls still waiting are answered now
        self._failed = logs.Throttled(log)

    async def call(self, op: str, model: str = "", params: dict[str, Any] | None = None,
                   timeout: float = 60.0) -> Any:
        """Send one command and wait for its answer: the data, or the control plane's error raised here;
        over answer_room(timeout) before `timeout` runs out."""
        if len(self._calls) >= MAX_CALLS:
            raise Unavailable(f"{MAX_CALLS} calls of the control plane (loads, unloads, cold starts, index) "
                              "wait for their answers in this gateway already; try again later")
        room = answer_room(timeout)
        command = Command(uuid.uuid4().hex, op, model, params or {}, clock.now() + timeout - 2 * room,
                          self.answers)
        answer: asyncio.Future[Answer | None] = asyncio.get_running_loop().create_future()
        self._calls[command.id] = answer  # before it is sent: an answer may come at once
        try:
            async with asyncio.timeout(timeout - room):
                await self._send(command)
                if not self._stopping:
                    self._read()
                    await answer
        except TimeoutError:
            raise self._silent(op, timeout) from None
        finally:
            self._calls.pop(command.id, None)
        got = answer.result() if answer.done() else None
        if got is None:
            raise Unavailable(f"the server is stopping, and the control plane did not answer '{op}' "
                              "within its drain time (DESPINA_DRAIN_TIMEOUT_S)")
        return got.result()

    def give_up(self) -> None:
        """The drain's time is nearly spent: the calls still waiting (a load, a wake) are answered 503 rather
        than left to a connection cut at the end; the control plane still does what they asked."""
        self._stopping = True
        for answer in self._calls.values():
            if not answer.done():
                answer.set_result(None)

    async def close(self) -> None:
        for task in (self._sender, self._reader):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # -- sending: the commands of a moment in one round trip -----------------------------------------

    async def _send(self, command: Command) -> None:
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outbox.append((command, sent))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all())
        await sent

    async def _send_all(self) -> None:
        """One pipeline at a time, of every command waiting to go: a burst of calls takes one connection of
        the gateway's pool, not one each (past the pool's 64, redis-py refuses a command)."""
        while self._outbox:
            batch, self._outbox = self._outbox, []
            pipe = self.redis.pipeline(transaction=False)
            for command, _ in batch:
                pipe.xadd(self.keys.control_commands, {FIELD: command.dumps()}, maxlen=COMMANDS_MAXLEN,
                          approximate=True)
            failed: DespinaError | None = None
            try:
                await pipe.execute()
            except (RedisError, ConnectionError, OSError) as exc:
                failed = _unreachable(exc)
            for _, sent in batch:
                if sent.done():  # its call is gone (its time ran out)
                    continue
                if failed is None:
                    sent.set_result(None)
                else:
                    sent.set_exception(failed)

    # -- reading: every call's answer, by one reader ---------------------------------------------------

    def _read(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_all())

    async def _read_all(self) -> None:
        """Wait for answers while some call waits for one; an answer whose call is gone is dropped."""
        while self._calls:
            try:
                first = cast(list[bytes] | None, await self.redis.blpop([self.answers], READ_WAIT_S))
                if first is None:
                    continue
                rest = cast(list[bytes] | None, await self.redis.lpop(self.answers, READ_COUNT))
            except (RedisError, ConnectionError, OSError) as exc:
                self._failed.log("gateway: reading the control plane's answers failed (%s)", exc)
                failed = _unreachable(exc)
                for answer in self._calls.values():
                    if not answer.done():
                        answer.set_exception(failed)
                return
            for raw in (first[1], *(rest or ())):
                try:
                    got = Answer.loads(raw)
                except (ValueError, AttributeError):  # (orjson's error is a ValueError)
                    log.error("gateway: dropping a malformed answer of the control plane: %r", raw[:200])
                    continue
                call = self._calls.pop(got.id, None)  # (so that the reader stops once all are answered)
                if call is not None and not call.done():
                    call.set_result(got)

    @staticmethod
    def _silent(op: str, timeout: float) -> Unavailable:
        return Unavailable(f"the control plane did not answer '{op}' within {timeout:g} s "
                           "(is `despina control` running?)")


def _unreachable(exc: BaseException) -> Unavailable:
    return refusals.unreachable("the control plane cannot be reached (Redis)", exc)
