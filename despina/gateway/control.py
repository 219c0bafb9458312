"""The gateway's line to the control plane: a command on its stream, the answer on a reply list."""
from __future__ import annotations

import time
import uuid
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..contract.commands import Answer, Command
from ..contract.errors import Unavailable
from ..contract.keys import FIELD, Keys

COMMANDS_MAXLEN = 10_000


class ControlClient:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def call(self, op: str, model: str = "", params: dict[str, Any] | None = None,
                   timeout: float = 60.0) -> Any:
        """Send one command and wait for its answer: the data, or the control plane's error raised here."""
        command = Command(uuid.uuid4().hex, op, model, params or {}, time.time() + timeout)
        try:
            await self.redis.xadd(self.keys.control_commands, {FIELD: command.dumps()},
                                  maxlen=COMMANDS_MAXLEN, approximate=True)
            got = await self.redis.blpop([self.keys.control_reply(command.id)], timeout=timeout + 1.0)
        except (RedisError, ConnectionError, OSError) as exc:
            raise Unavailable(f"the control plane cannot be reached (Redis: {exc})") from None
        if got is None:
            raise Unavailable(f"the control plane did not answer '{op}' within {timeout:g} s "
                              "(is `despina control` running?)")
        return Answer.loads(cast(bytes, got[1])).result()
