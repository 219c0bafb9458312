"""The gateway's calls of the control plane (gateway/control.py) against a real Redis: bursts, limits, the
drain, and both ends of the protocol (the real control plane's command loop, a gateway of an earlier
version)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from despina.contract.commands import INDEX, WAKE, Answer, Command
from despina.contract.errors import Code, DespinaError, Unavailable
from despina.contract.keys import FIELD, Keys
from despina.control.plane import ControlPlane
from despina.gateway import control
from despina.gateway.control import ControlClient
from despina.gateway.models import ModelView
from despina.redis_client import connect
from despina.settings import Settings


async def commands_sent(redis: aioredis.Redis, keys: Keys, n: int, timeout: float = 10.0) -> list[Command]:
    """The first `n` commands on the control plane's stream, once there are that many (else what came)."""
    deadline = time.monotonic() + timeout
    while await redis.xlen(keys.control_commands) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    entries = await redis.xrange(keys.control_commands, count=n)
    return [Command.loads(fields[FIELD]) for _, fields in entries]


async def answer(redis: aioredis.Redis, keys: Keys, command: Command, data: Any) -> None:
    """What the control plane does: the answer on the list the command names, with its id (a command that
    names none, on its own list)."""
    if command.reply:
        await redis.rpush(command.reply, Answer(data, id=command.id).dumps())
    else:
        await redis.lpush(keys.control_reply(command.id), Answer(data).dumps())


async def test_a_burst_of_cold_starts_is_sent_at_once_and_waits_on_no_connection_each(
        redis_url: str, key_prefix: str) -> None:
    """Each call waited for its answer in a BLPOP of its own, on one of the gateway's 64 pooled connections,
    so at most 32 waited at once: 100 cold models woken together through one gateway queued behind 32 cold
    starts, the last first answer three cold starts late. (Before that cap, a burst took the whole pool, and
    the model view's refresh failed "Too many connections".) Now every command goes at once, and one reader
    takes every answer: a pool of 4 connections serves 200 calls."""
    keys = Keys(key_prefix)
    redis, plane = connect(redis_url, max_connections=4), aioredis.Redis.from_url(redis_url)
    client = ControlClient(redis, keys)
    calls = [asyncio.ensure_future(client.call(WAKE, f"m{n}", {"n": n}, timeout=30.0)) for n in range(200)]
    try:
        sent = await commands_sent(plane, keys, len(calls))
        assert len(sent) == len(calls)  # every one sent before any is answered
        assert not any(call.done() for call in calls)
        assert await redis.ping()  # the pool is the gateway's still
        for command in reversed(sent):  # answered in any order: each goes to its own call
            await answer(plane, keys, command, command.params["n"])
        assert await asyncio.gather(*calls) == list(range(200))
    finally:
        for call in calls:
            call.cancel()
        await client.close()
        await redis.aclose(close_connection_pool=True)
        await plane.aclose()


async def test_calls_past_the_limit_are_answered_503_at_once(redis_url: str, key_prefix: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound on calls waiting is about memory, and past it a call is refused at once with a reason."""
    monkeypatch.setattr(control, "MAX_CALLS", 3)
    keys = Keys(key_prefix)
    redis, plane = connect(redis_url), aioredis.Redis.from_url(redis_url)
    client = ControlClient(redis, keys)
    calls = [asyncio.ensure_future(client.call(INDEX, params={"n": n}, timeout=30.0)) for n in range(3)]
    try:
        sent = await commands_sent(plane, keys, 3)
        with pytest.raises(Unavailable, match="3 calls of the control plane .* wait for their answers"):
            await client.call(INDEX, timeout=30.0)
        for command in sent:
            await answer(plane, keys, command, command.params["n"])
        assert sorted(await asyncio.gather(*calls)) == [0, 1, 2]
        assert await plane.xlen(keys.control_commands) == 3  # the refused call sent nothing
    finally:
        await client.close()
        await redis.aclose(close_connection_pool=True)
        await plane.aclose()


async def test_a_late_answer_is_dropped_and_the_drain_answers_what_still_waits(redis_url: str,
                                                                               key_prefix: str) -> None:
    keys = Keys(key_prefix)
    redis, plane = connect(redis_url), aioredis.Redis.from_url(redis_url)
    client = ControlClient(redis, keys)
    try:
        with pytest.raises(Unavailable, match="did not answer 'index' within 0.2 s"):
            await client.call(INDEX, timeout=0.2)
        (late,) = await commands_sent(plane, keys, 1)
        await answer(plane, keys, late, "late")  # its call is gone: read and dropped
        waiting = [asyncio.ensure_future(client.call(WAKE, f"m{n}", timeout=30.0)) for n in range(5)]
        await commands_sent(plane, keys, 6)
        assert await plane.llen(client.answers) == 0
        client.give_up()
        for call in waiting:
            with pytest.raises(Unavailable, match="did not answer 'wake' within its drain time"):
                await call
        with pytest.raises(Unavailable, match="did not answer 'index' within its drain time"):
            await client.call(INDEX, timeout=30.0)
        assert await plane.xlen(keys.control_commands) == 7  # the control plane still does what they asked
    finally:
        await client.close()
        await redis.aclose(close_connection_pool=True)
        await plane.aclose()


async def test_calls_answered_by_the_control_plane(tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The real control plane's command loop: answers and its errors reach their calls."""
    keys = Keys(key_prefix)
    redis = connect(redis_url)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), redis)
    serving = asyncio.create_task(plane._serve_commands())
    client = ControlClient(redis, keys)
    try:
        assert await asyncio.gather(*(client.call(INDEX, timeout=30.0) for _ in range(100))) == [[]] * 100
        with pytest.raises(DespinaError, match="unknown model 'nothing'") as raised:
            await client.call(WAKE, "nothing", timeout=30.0)
        assert raised.value.code == Code.NOT_FOUND
        assert await redis.xlen(keys.control_commands) == 0  # each acknowledged and deleted
    finally:
        await client.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await plane.replies.close()
        await redis.aclose(close_connection_pool=True)


async def test_a_call_is_over_within_its_time_and_the_control_plane_answers_sooner(redis_url: str,
                                                                                   key_prefix: str) -> None:
    """A call waited a second past its time for the control plane's answer: with no control plane running, a
    request for a model scaled to zero got its 503 a second after the server's request timeout, and a client
    that waits as long as the server saw its own timeout instead. Now the call is over a moment before its
    time, and the control plane's deadline leaves its answer room to come back before that."""
    keys = Keys(key_prefix)
    redis, plane = connect(redis_url), aioredis.Redis.from_url(redis_url)
    client = ControlClient(redis, keys)
    try:
        sent = time.monotonic()
        asked = time.time()
        with pytest.raises(Unavailable, match="did not answer 'wake' within 2 s"):
            await client.call(WAKE, "m", timeout=2.0)
        took = time.monotonic() - sent
        assert 2.0 - 2 * control.ANSWER_ROOM_S < took < 2.0, took
        (command,) = await commands_sent(plane, keys, 1)
        assert command.deadline <= asked + 2.0 - 2 * control.ANSWER_ROOM_S + 0.05, command.deadline - asked
    finally:
        await client.close()
        await redis.aclose(close_connection_pool=True)
        await plane.aclose()


async def test_a_caller_that_joins_a_longer_wake_stops_waiting_at_its_own_time(redis_url: str,
                                                                              key_prefix: str) -> None:
    """A cold start already on its way is joined, and lasts its first caller's time: a caller with less time
    (an ensemble's later step, say) waited it out, answered 503 seconds after its own deadline. The wake
    goes on for its first caller."""
    keys = Keys(key_prefix)
    redis, plane = connect(redis_url), aioredis.Redis.from_url(redis_url)
    view = ModelView(redis, keys)
    first = asyncio.ensure_future(view._wake("m", None, 4.0))
    try:
        await commands_sent(plane, keys, 1)
        sent = time.monotonic()
        with pytest.raises(Unavailable, match="model 'm' did not load within 1 s"):
            await view._wake("m", None, 1.0)
        assert time.monotonic() - sent < 1.0
        assert not first.done() and await plane.xlen(keys.control_commands) == 1  # one wake, still waited on
        (command,) = await commands_sent(plane, keys, 1)
        await answer(plane, keys, command, 1)
        assert await first == 1
    finally:
        first.cancel()
        await view.close()
        await redis.aclose(close_connection_pool=True)
        await plane.aclose()
