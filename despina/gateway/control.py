"""The gateway's line to the control plane: a command on its stream, the answer on a reply list."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..contract.commands import Answer, Command
from ..contract.errors import Unavailable
from ..contract.keys import FIELD, Keys

COMMANDS_MAXLEN = 10_000
# Calls waiting for their answers at once. Each waits in a BLPOP on one of the gateway's Redis connections
# (64, redis_client.connect) for as long as the control plane takes: past this many, a call waits for a
# turn, so that a burst of repository calls while the control plane is slow or restarting leaves the pool
# to requests and the model view (which, without a connection, turns the gateway not ready).
CONCURRENT_CALLS = 32


class ControlClient:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._turns = asyncio.Semaphore(CONCURRENT_CALLS)
        self._stopping = asyncio.Event()  # give_up: the calls still waiting are answered now

    async def call(self, op: str, model: str = "", params: dict[str, Any] | None = None,
                   timeout: float = 60.0) -> Any:
        """Send one command and wait for its answer: the data, or the control plane's error raised here."""
        deadline = time.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                await self._turns.acquire()
        except TimeoutError:
            raise self._silent(op, timeout) from None
        try:
            command = Command(uuid.uuid4().hex, op, model, params or {}, deadline)
            try:
                await self.redis.xadd(self.keys.control_commands, {FIELD: command.dumps()},
                                      maxlen=COMMANDS_MAXLEN, approximate=True)
                got = await self._answer(command, deadline)
            except (RedisError, ConnectionError, OSError) as exc:
                raise Unavailable(f"the control plane cannot be reached (Redis: {exc})") from None
        finally:
            self._turns.release()
        if got is None:
            raise self._silent(op, timeout)
        return Answer.loads(cast(bytes, got[1])).result()

    async def _answer(self, command: Command, deadline: float) -> Any:
        """The command's answer (None: none came by its deadline), unless the gateway gives up first."""
        reply = asyncio.ensure_future(self.redis.blpop([self.keys.control_reply(command.id)],
                                                       timeout=max(deadline - time.time(), 0.0) + 1.0))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((reply, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not reply.done():
                reply.cancel()  # redis-py drops the connection it was read on
        if not reply.done() or reply.cancelled():
            raise Unavailable(f"the server is stopping, and the control plane did not answer '{command.op}' "
                              "within its drain time (DESPINA_DRAIN_TIMEOUT_S)")
        return reply.result()

    def give_up(self) -> None:
        """The drain's time is nearly spent: the calls still waiting (a load, a wake) are answered 503 rather
        than left to a connection cut at the end; the control plane still does what they asked."""
        self._stopping.set()

    @staticmethod
    def _silent(op: str, timeout: float) -> Unavailable:
        return Unavailable(f"the control plane did not answer '{op}' within {timeout:g} s "
                           "(is `despina control` running?)")
