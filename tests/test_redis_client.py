"""despina.redis_client's clients against a real Redis."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from despina.redis_client import connect, connect_worker


async def test_a_closed_client_leaves_no_connection_to_redis(redis_url: str, key_prefix: str) -> None:
    """connect builds the client's pool itself, so closing the client closes the pool: a client given a
    pool of its own leaves it open on aclose, and every role's connections stayed open after it stopped
    (an in-process gateway, a test's, kept them until the process ended)."""
    names = [f"closing-{kind}-{key_prefix.strip(':')}" for kind in ("plain", "worker")]
    check = aioredis.Redis.from_url(redis_url)
    try:
        for name, make in zip(names, (connect, connect_worker), strict=True):
            client = make(f"{redis_url}{'&' if '?' in redis_url else '?'}client_name={name}")
            await asyncio.gather(*(client.ping() for _ in range(3)))  # a few connections in its pool
            assert any(c["name"] == name for c in await check.client_list())
            await client.aclose()
        for _ in range(100):  # the server lists a closed connection until it has read the close
            if not any(c["name"] in names for c in await check.client_list()):
                break
            await asyncio.sleep(0.05)
        assert [c["name"] for c in await check.client_list() if c["name"] in names] == []
    finally:
        await check.aclose()
