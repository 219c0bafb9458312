"""One way to connect to Redis, used by every role."""
from __future__ import annotations

import redis.asyncio as aioredis


def connect(url: str, max_connections: int = 64) -> aioredis.Redis:
    # socket_timeout=None avoids a timeout object per read; health checks catch dead sockets.
    pool = aioredis.ConnectionPool.from_url(
        url, max_connections=max_connections, socket_timeout=None, socket_connect_timeout=2.0,
        health_check_interval=0, retry_on_timeout=False)
    return aioredis.Redis(connection_pool=pool)
