"""The control plane's answers to commands (control/replies.py), against a real Redis and the real command
loop: a burst answered at once, and a gateway of the previous version answered as it expects."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import orjson
import pytest
import redis.asyncio as aioredis

from despina.contract.commands import INDEX, Answer, Command
from despina.contract.keys import FIELD, Keys
from despina.control.plane import ControlPlane
from despina.redis_client import connect
from despina.settings import Settings


@pytest.fixture
async def plane(tmp_path: Path, redis_url: str, key_prefix: str) -> AsyncIterator[ControlPlane]:
    """A control plane of an empty repository serving commands, its Redis pool of 8 connections."""
    redis = connect(redis_url, max_connections=8)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), redis)
    serving = asyncio.create_task(plane._serve_commands())
    yield plane
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    await plane.replies.close()
    await redis.aclose(close_connection_pool=True)


async def test_commands_answered_at_once_are_all_answered(plane: ControlPlane, redis_url: str,
                                                          key_prefix: str) -> None:
    """The control plane wrote each answer in a pipeline of its own: a hundred cold starts ending in one tick
    took a hundred connections of its pool at once, and past its 64 the answers were lost ("Too many
    connections"), their requests answered 503 a minute later. Here its pool has 8."""
    keys = Keys(key_prefix)
    gateway = aioredis.Redis.from_url(redis_url)
    answers = keys.control_answers("g1")
    try:
        commands = [Command(uuid.uuid4().hex, INDEX, deadline=time.time() + 30, reply=answers) for _ in range(100)]
        pipe = gateway.pipeline(transaction=False)
        for command in commands:
            pipe.xadd(keys.control_commands, {FIELD: command.dumps()})
        await pipe.execute()
        got: list[Answer] = []
        deadline = time.monotonic() + 10
        while len(got) < len(commands) and time.monotonic() < deadline:
            popped = cast(list[bytes] | None, await gateway.blpop([answers], timeout=1))
            got += [Answer.loads(popped[1])] if popped else []
        assert sorted(a.id for a in got) == sorted(c.id for c in commands)
        assert all(a.result() == [] for a in got)
        assert 0 < await gateway.ttl(answers) or not await gateway.exists(answers)  # it expires
        assert await gateway.xlen(keys.control_commands) == 0  # each acknowledged and deleted
    finally:
        await gateway.aclose()


async def test_a_gateway_of_the_previous_version_is_answered_on_the_commands_own_list(
        plane: ControlPlane, redis_url: str, key_prefix: str) -> None:
    """Its commands name no `reply` list: it waits on control_reply(id), where the answer still goes."""
    keys = Keys(key_prefix)
    gateway = aioredis.Redis.from_url(redis_url)
    try:
        old_id = uuid.uuid4().hex  # the command as the previous version wrote it
        await gateway.xadd(keys.control_commands, {FIELD: orjson.dumps(
            {"id": old_id, "op": INDEX, "model": "", "params": {}, "deadline": time.time() + 30})})
        got = cast(list[bytes] | None, await gateway.blpop([keys.control_reply(old_id)], timeout=10))
        assert got is not None and Answer.loads(got[1]).result() == []
        # a `reply` outside the answers' lists (any other key) is not written to either
        stray = Command(uuid.uuid4().hex, INDEX, deadline=time.time() + 30, reply=f"{key_prefix}:catalog")
        await gateway.xadd(keys.control_commands, {FIELD: stray.dumps()})
        got = cast(list[bytes] | None, await gateway.blpop([keys.control_reply(stray.id)], timeout=10))
        assert got is not None and not await gateway.exists(f"{key_prefix}:catalog")
    finally:
        await gateway.aclose()
