"""The control plane's view of the workers (control/state.py Workers) against a Redis of the test's own, whose
command counts (INFO commandstats) are the test's alone: a worker's hash is read again only when its state
moved, every change is seen, and a worker whose heartbeats stopped is still found dead."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis

from despina.contract.cluster import VersionStatus, WorkerInfo, pack_detail
from despina.contract.keys import Keys
from despina.control.state import Workers
from despina.redis_client import connect, connect_worker
from despina.settings import Settings
from despina.workers.worker import Worker

from .reliability_support import RedisProcess, own_redis

PREFIX = "despina-workers"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisProcess]:
    with own_redis(tmp_path) as process:
        yield process


@pytest.fixture
async def redis(server: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    client = connect(server.url)
    try:
        yield client
    finally:
        await client.aclose(close_connection_pool=True)


async def hgetalls(redis: aioredis.Redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


async def test_a_workers_hash_is_read_again_only_when_its_state_moved(server: RedisProcess,
                                                                      redis: aioredis.Redis) -> None:
    """Each tick (every second, 20 a second while anything moves) read every worker's whole hash: 22 KB a
    worker at 133 models, 1 ms of the control plane's CPU a tick at 3 workers, 9 ms at 10 of 400 models."""
    keys = Keys(PREFIX)
    workers = [Worker(Settings(key_prefix=PREFIX), connect_worker(server.url)) for _ in range(2)]
    a, b = workers
    try:
        a.failures[("m0", 1)] = ("r1", "broken")
        for w in workers:
            await w._heartbeat()
        await redis.set(keys.control_leader, "a-plane")  # a worker gone while nobody leads is not dead
        view = Workers(redis, keys)
        assert await view.refresh() == {}
        assert sorted(view.status) == sorted([a.id, b.id])
        assert view.status[a.id].failed("m0", 1, "r1") == "broken"

        before = await hgetalls(redis)
        for _ in range(5):
            for w in workers:
                await w._heartbeat()  # the same state, written again
            assert await view.refresh() == {}
        assert await hgetalls(redis) - before == 0

        b.failures[("m1", 1)] = ("r2", "also broken")  # one worker's state moves: that one is read
        await b._heartbeat()
        await view.refresh()
        assert view.status[b.id].failed("m1", 1, "r2") == "also broken"
        assert view.status[a.id].failed("m0", 1, "r1") == "broken"
        assert await hgetalls(redis) - before == 1

        await redis.delete(keys.worker(a.id))  # its heartbeats stopped: the key expired
        assert list(await view.refresh()) == [a.id]
        assert list(view.status) == [b.id]
        assert await redis.smembers(keys.workers) == {b.id.encode()}
    finally:
        for w in workers:
            await w.redis.aclose(close_connection_pool=True)


async def test_a_worker_of_the_previous_version_is_read_every_time(redis: aioredis.Redis) -> None:
    """A worker of the previous version writes no digest of its state: its hash is read at every tick, and
    its changes seen."""
    keys = Keys(PREFIX)
    key = keys.worker("old")

    async def beat(state: str) -> None:
        await redis.hset(key, mapping={"info": WorkerInfo("old").dumps(),
                                       "models": orjson.dumps({"m0": {"1": state}}),
                                       "detail": pack_detail({"m0": {1: VersionStatus(state, "r1")}})})
        await redis.sadd(keys.workers, "old")

    await beat("LOADING")
    view = Workers(redis, keys)
    await view.refresh()
    before = await hgetalls(redis)
    await beat("READY")
    await view.refresh()
    await view.refresh()
    assert await hgetalls(redis) - before == 2
    assert view.ready_on("m0", 1, "r1") == ["old"]
