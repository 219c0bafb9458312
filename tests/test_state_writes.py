"""What the control plane and the workers write to Redis for the others to read, against a real Redis:
the newest state is the one that stays, whatever writes are in flight at once."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import redis.asyncio as aioredis

from despina.contract.catalog import CatalogEntry
from despina.contract.cluster import WorkerStatus
from despina.contract.keys import Keys
from despina.control.state import Catalog
from despina.settings import Settings
from despina.workers.worker import Worker

ROUNDS = 300


async def test_two_flushes_in_flight_leave_the_newest_entry(redis_url: str, key_prefix: str) -> None:
    """The control plane once flushed from the registry scan and from its tick at the same moment;
    each pipeline took its own connection, the older one sometimes reached Redis last, and a model
    stayed placed nowhere (its workers never loaded it). Fresh connections each round make the two
    writes race for real; without one flush at a time about 2 % of rounds end stale."""
    keys = Keys(key_prefix)
    stale = 0
    for _ in range(ROUNDS):
        redis = aioredis.Redis.from_url(redis_url)  # an empty pool: each flush opens its own connection
        catalog = Catalog(redis, keys)
        placed_nowhere = CatalogEntry("m", "/repo/m", {}, (1,))
        catalog.put(placed_nowhere)
        first = asyncio.create_task(catalog.flush())
        await asyncio.sleep(0)  # the first flush is on its way
        catalog.put(replace(placed_nowhere, workers=("w0",)))
        await asyncio.gather(first, catalog.flush())
        stale += CatalogEntry.loads(await redis.hget(keys.catalog, "m")).workers != ("w0",)
        await redis.delete(keys.catalog)
        await redis.aclose()
    assert stale == 0, f"{stale} of {ROUNDS} rounds left the older entry in Redis"


async def test_a_failed_flush_is_written_again_but_not_what_was_removed_meanwhile(
        redis_url: str, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    redis = aioredis.Redis.from_url(redis_url)
    catalog = Catalog(aioredis.Redis.from_url("redis://127.0.0.1:1/0"), keys)  # nothing listens there: the flush fails
    catalog.put(CatalogEntry("kept", "/repo/kept", {}, (1,)))
    catalog.put(CatalogEntry("gone", "/repo/gone", {}, (1,)))
    failing = asyncio.create_task(catalog.flush())
    await asyncio.sleep(0)  # the flush is connecting
    catalog.remove("gone")
    try:
        await failing
    except Exception:
        pass
    else:
        raise AssertionError("a flush to a closed port succeeded")
    await catalog.redis.aclose()
    catalog.redis = redis
    await catalog.flush()
    assert sorted(await redis.hkeys(keys.catalog)) == [b"kept"]
    await redis.delete(keys.catalog)
    await redis.aclose()


async def test_a_worker_s_newest_heartbeat_is_the_one_that_stays(redis_url: str, key_prefix: str) -> None:
    """The heartbeat loop and an announcement can beat at the same moment: the later state must win,
    or the others see a version LOADING (or gone) for a beat after it serves."""
    stale = 0
    for _ in range(ROUNDS):
        redis = aioredis.Redis.from_url(redis_url)
        worker = Worker(Settings(key_prefix=key_prefix), redis)
        worker.failures[("m", 1)] = ("r1", "first")
        first = asyncio.create_task(worker._heartbeat())
        await asyncio.sleep(0)  # the first beat is on its way
        worker.failures[("m", 1)] = ("r1", "second")
        await asyncio.gather(first, worker._heartbeat())
        status = WorkerStatus.from_hash(worker.id, await redis.hgetall(worker.keys.worker(worker.id)))
        stale += status.detail["m"][1].error != "second"
        await redis.delete(worker.keys.worker(worker.id), worker.keys.workers)
        await redis.aclose()
    assert stale == 0, f"{stale} of {ROUNDS} rounds left the older heartbeat in Redis"
