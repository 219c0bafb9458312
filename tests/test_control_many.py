"""A repository of many models: what the control plane does for each must not grow with the others."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from despina.contract import records
from despina.contract.catalog import IDLE, LOADED, CatalogEntry
from despina.contract.cluster import VersionStatus, WorkerInfo, pack_detail
from despina.contract.keys import FIELD, GROUP, Keys
from despina.contract.records import InferRequest
from despina.control.plane import ControlPlane
from despina.redis_client import connect
from despina.settings import Settings

MB = 1024 * 1024


def catalog(n: int) -> list[CatalogEntry]:
    """n small models and, for every ten of them, an ensemble of two."""
    models = [CatalogEntry(f"m{i:03d}", f"/repo/m{i:03d}", {"name": f"m{i:03d}"}, (1,), revisions={1: "r1"},
                           footprint=10 * MB) for i in range(n)]
    ensembles = [CatalogEntry(f"e{i:03d}", f"/repo/e{i:03d}", {
        "name": f"e{i:03d}", "platform": "ensemble",
        "ensemble_scheduling": {"step": [{"model_name": f"m{i:03d}"}, {"model_name": f"m{i + 1:03d}"}]}},
        (1,)) for i in range(0, n, 10)]
    return models + ensembles


async def placed_by_one_tick(tmp_path: Path, redis_url: str, key_prefix: str, n: int,
                             monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict[str, CatalogEntry]]:
    """How many times one tick asked a catalog entry whether it serves, placing `n` models (and their
    ensembles) on two workers with room for all of them; and the catalog after it."""
    client = connect(redis_url)
    keys = Keys(key_prefix)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), client)
    try:
        for wid in ("a", "b"):
            await client.hset(keys.worker(wid), "info", WorkerInfo(wid, memory_bytes=100_000 * MB).dumps())
            await client.sadd(keys.workers, wid)
        for e in catalog(n):
            plane.catalog.put(e)
        asked = 0
        serving = CatalogEntry.serving

        def counted(entry: CatalogEntry) -> bool:
            nonlocal asked
            asked += 1
            return serving.fget(entry)  # type: ignore[attr-defined,no-any-return]

        monkeypatch.setattr(CatalogEntry, "serving", property(counted))
        await plane.lifecycle.tick()
        monkeypatch.setattr(CatalogEntry, "serving", serving)
        return asked, dict(plane.catalog.entries)
    finally:
        await client.delete(keys.workers, keys.worker("a"), keys.worker("b"), keys.catalog)
        await client.aclose(close_connection_pool=True)


async def test_a_tick_looks_at_each_model_a_few_times_not_once_per_other_model(
        tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Placing each model summed what every other model takes and looked through every ensemble: a tick
    of n models took n^2 steps (1.4 s of the control plane's event loop at 2,000 models, with ticks 50 ms
    apart while anything loads). Placement itself is unchanged: spread evenly, an ensemble's models
    together."""
    small, _ = await placed_by_one_tick(tmp_path, redis_url, key_prefix, 40, monkeypatch)
    large, entries = await placed_by_one_tick(tmp_path, redis_url, key_prefix, 160, monkeypatch)
    assert large < 6 * small, (small, large)  # 4x the models: 4x the work, not 16x
    models = [e for e in entries.values() if not e.name.startswith("e")]
    assert all(len(e.workers) == 1 for e in models)
    on_a = sum(e.workers == ("a",) for e in models)
    assert abs(on_a - (len(models) - on_a)) <= 16, on_a  # the pairs of an ensemble may tip it a little
    for i in range(0, 160, 10):
        assert entries[f"m{i:03d}"].workers == entries[f"m{i + 1:03d}"].workers


async def test_a_tick_that_nothing_moved_reconciles_no_model(tmp_path: Path, redis_url: str, key_prefix: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle control plane reconciled every model on every tick (400 models: 5 ms of CPU a second, 20 times
    that while anything loads) though the catalog and the workers had not moved. A tick now passes over the
    models only when something they are placed from moved, and then decides as before."""
    client = connect(redis_url)
    keys = Keys(key_prefix)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), client)
    reconciled: list[str] = []
    reconcile = plane.lifecycle._reconcile

    def counted(e: CatalogEntry, *args: object) -> CatalogEntry:
        reconciled.append(e.name)
        return reconcile(e, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(plane.lifecycle, "_reconcile", counted)
    try:
        await client.set(keys.control_leader, plane.id)  # it leads: a worker gone then is dead (state.py)
        for wid in ("a", "b"):
            await client.hset(keys.worker(wid), mapping={  # ("state": the digest of what it serves)
                "info": WorkerInfo(wid, memory_bytes=100_000 * MB).dumps(), "state": b"0"})
            await client.sadd(keys.workers, wid)
        for e in catalog(20):
            plane.catalog.put(e)
        await plane.lifecycle.tick()
        await plane.lifecycle.tick()  # (finds its own placement unchanged)
        reconciled.clear()
        await plane.lifecycle.tick()
        assert reconciled == []
        on_b = sorted(n for n, e in plane.catalog.entries.items() if e.workers == ("b",))
        assert on_b
        new = CatalogEntry("late", "/repo/late", {"name": "late"}, (1,), revisions={1: "r1"}, footprint=MB)
        plane.catalog.put(new)  # a model comes: every model is reconciled once more
        await plane.lifecycle.tick()
        assert len(reconciled) == 21 and plane.catalog.entries["late"].workers
        await client.delete(keys.worker("b"))  # worker b's heartbeat expires: its models move to a
        await plane.lifecycle.tick()
        assert all(plane.catalog.entries[n].workers == ("a",) for n in on_b)
        failed = {"m000": {"1": {"failed": "r1", "error": "boom"}}}  # a's state moves: m000 failed there
        await client.hset(keys.worker("a"), mapping={"detail": orjson.dumps(failed), "state": b"1"})
        await plane.lifecycle.tick()
        assert plane.catalog.entries["m000"].failed == {1: "boom"}
    finally:
        await client.delete(keys.workers, keys.worker("a"), keys.worker("b"), keys.catalog)
        await client.aclose(close_connection_pool=True)


@contextmanager
def round_trips(monkeypatch: pytest.MonkeyPatch, client: aioredis.Redis) -> Iterator[list[list[tuple[str, str]]]]:
    """What the client sends meanwhile: each round trip's commands, as (command, key)."""
    trips: list[list[tuple[str, str]]] = []
    single, execute = type(client).execute_command, Pipeline.execute

    def named(args: tuple[Any, ...]) -> tuple[str, str]:
        return str(args[0]).upper(), str(args[1]) if len(args) > 1 else ""

    async def counted_single(self: Any, *args: Any, **kw: Any) -> Any:
        trips.append([named(args)])
        return await single(self, *args, **kw)

    async def counted_execute(self: Any, *args: Any, **kw: Any) -> Any:
        if len(self):
            trips.append([named(command) for command, _ in self.command_stack])
        return await execute(self, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(type(client), "execute_command", counted_single)
        m.setattr(Pipeline, "execute", counted_execute)
        yield trips


async def requeue_after_death(tmp_path: Path, redis_url: str, key_prefix: str, n: int,
                              monkeypatch: pytest.MonkeyPatch) -> int:
    """`n` models placed on worker "w", every stream with its group (as a worker's loads leave them); w had
    read 2 entries of m000, 150 of m001 (more than a page of XPENDING) and 3 of m002's priority level 2, and
    its heartbeat stops. Returns the round trips of the tick that finds it dead, after checking that every
    entry it had read is back on its stream and w is forgotten there."""
    client, setup = connect(redis_url), connect(redis_url)
    keys = Keys(key_prefix)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), client)
    read = {keys.request_stream("m000", 1): 2, keys.request_stream("m001", 1): 150,
            keys.request_stream("m002", 1, 2): 3}
    try:
        await setup.set(keys.control_leader, plane.id)  # it leads: a worker gone then is dead (state.py)
        await setup.hset(keys.worker("w"), "info", WorkerInfo("w", memory_bytes=100_000 * MB).dumps())
        await setup.sadd(keys.workers, "w")
        levels = {"dynamic_batching": {"priority_levels": 2}}
        for i in range(n):
            config = {"name": f"m{i:03d}", **(levels if i == 2 else {})}
            plane.catalog.put(CatalogEntry(f"m{i:03d}", f"/repo/m{i:03d}", config, (1,), revisions={1: "r1"},
                                           footprint=MB))
        await plane.lifecycle.tick()
        assert all(e.workers == ("w",) for e in plane.catalog.entries.values())
        pipe = setup.pipeline(transaction=False)
        for e in plane.catalog.entries.values():
            for stream in e.streams(keys, 1):
                pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)
        await pipe.execute()
        for stream, count in read.items():
            for i in range(count):
                await setup.xadd(stream, {FIELD: records.encode([InferRequest(f"{i}", "r", time.time() + 60, ())])})
            got = await setup.xreadgroup(GROUP, "w", {stream: ">"}, count=count)
            assert len(got[0][1]) == count
        await setup.delete(keys.worker("w"))  # its heartbeat expires

        with round_trips(monkeypatch, client) as trips:
            await plane.lifecycle.tick()

        for stream, count in read.items():
            assert (await setup.xpending(stream, GROUP))["pending"] == 0
            assert await setup.xlen(stream) == count  # each one back, as an entry of its own
            assert not [c for c in await setup.xinfo_consumers(stream, GROUP) if c["name"] == b"w"]
            again = await setup.xreadgroup(GROUP, "alive", {stream: ">"}, count=count + 1)
            ids = sorted(records.decode_requests(f[FIELD])[0].id for _, f in again[0][1])
            assert ids == sorted(str(i) for i in range(count))
        assert not await setup.sismember(keys.workers, "w")
        return len(trips)
    finally:
        await client.aclose(close_connection_pool=True)
        await setup.aclose(close_connection_pool=True)


async def test_a_dead_workers_entries_are_requeued_in_round_trips_that_do_not_grow_with_the_models(
        tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's death requeued what it had read one queue at a time, each its own round trips, for every
    model in the catalog (two for a queue the worker never read: 1,000 models took 2,000 round trips and
    0.56 s on loopback, while the requests waited). Every entry it had read still goes back on its stream,
    and the round trips depend on the queues it had read, not on how many models there are."""
    few = await requeue_after_death(tmp_path, redis_url, key_prefix, 10, monkeypatch)
    many = await requeue_after_death(tmp_path, redis_url, f"{key_prefix}:many", 200, monkeypatch)
    assert many <= few + 2, (few, many)


async def loaded_and_ready(plane: ControlPlane, setup: aioredis.Redis, n: int) -> None:
    """`n` models placed on worker "w", which reports them all READY."""
    keys = plane.keys
    for i in range(n):
        plane.catalog.put(CatalogEntry(f"m{i:03d}", f"/repo/m{i:03d}", {"name": f"m{i:03d}"}, (1,),
                                       revisions={1: "r1"}, footprint=MB))
    await setup.hset(keys.worker("w"), "info", WorkerInfo("w", memory_bytes=100_000 * MB).dumps())
    await setup.sadd(keys.workers, "w")
    await plane.lifecycle.tick()
    detail = pack_detail({name: {1: VersionStatus("READY", "r1")} for name in plane.catalog.entries})
    await setup.hset(keys.worker("w"), mapping={"detail": detail, "state": b"1"})
    await plane.lifecycle.tick()
    assert all(plane.workers.ready_on(name, 1) for name in plane.catalog.entries)


async def test_a_scale_to_zero_check_reads_only_the_models_whose_idle_timeout_may_have_passed(
        tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With scale-to-zero on, every check (each second) read the last inference and the queue length of
    every version of every loaded model: 1,000 models, 2,000 commands a second and 33 ms of the control
    plane's loop. A loaded model's last inference only moves later, so it is read only once its idle
    timeout has passed since it was last seen used; it is unloaded, or kept, as before."""
    client, setup = connect(redis_url), connect(redis_url)
    keys = Keys(key_prefix)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix, idle_timeout_s=60),
                         client)
    life = plane.lifecycle
    try:
        await loaded_and_ready(plane, setup, 100)
        with round_trips(monkeypatch, client) as trips:
            await life._scale_to_zero()
        assert trips == []  # each one served just now: none can be idle for a minute
        for name in ("m000", "m001", "m002"):
            life.idle.awake_since[name] = time.time() - 3600  # woken an hour ago...
        await setup.hset(keys.stats("m001", 1), "last_inference", int(time.time() * 1000))  # ...m001 used since
        await setup.xadd(keys.request_stream("m002", 1), {FIELD: b"queued"})  # ...m002 has a request queued
        with round_trips(monkeypatch, client) as trips:
            await life._scale_to_zero()
        assert sorted(c for trip in trips for c in trip) == sorted(
            [("HGET", keys.stats(n, 1)) for n in ("m000", "m001", "m002")]
            + [("XLEN", keys.request_stream(n, 1)) for n in ("m000", "m001", "m002")])
        targets = {n: plane.catalog.entries[n].target for n in ("m000", "m001", "m002", "m003")}
        assert targets == {"m000": IDLE, "m001": LOADED, "m002": LOADED, "m003": LOADED}
        with round_trips(monkeypatch, client) as trips:
            await life._scale_to_zero()
        # m001 was used a moment ago: not read for a minute; m002 may still be idle; m000 was scaled to
        # zero: a request queued as it went down would wake it
        assert sorted(c for trip in trips for c in trip) == [
            ("HGET", keys.stats("m002", 1)), ("XLEN", keys.request_stream("m000", 1)),
            ("XLEN", keys.request_stream("m002", 1))]
    finally:
        await client.aclose(close_connection_pool=True)
        await setup.aclose(close_connection_pool=True)


async def test_the_queues_of_models_long_scaled_to_zero_are_read_a_tenth_at_a_time(
        tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check read the queue length (and the last inference, unused) of every model scaled to zero, in
    case a request was queued as it went down: 1,000 such models, 2,000 commands a second. They are read
    at every check while producers may still see the model serving (Idle.watch_s), then a tenth of them
    at each check: every one within ten checks, and a request queued there still wakes its model."""
    client, setup = connect(redis_url), connect(redis_url)
    keys = Keys(key_prefix)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), client)
    life = plane.lifecycle
    try:
        for i in range(100):
            plane.catalog.put(CatalogEntry(f"m{i:03d}", f"/repo/m{i:03d}", {"name": f"m{i:03d}"}, (1,),
                                           revisions={1: "r1"}, target=IDLE))
        streams = sorted(keys.request_stream(f"m{i:03d}", 1) for i in range(100))
        with round_trips(monkeypatch, client) as trips:
            await life._scale_to_zero()
        assert sorted(c for trip in trips for c in trip) == [("XLEN", s) for s in streams]  # just scaled to zero
        life.idle.watch_s = 0.0  # long ago, now
        with round_trips(monkeypatch, client) as trips:
            for _ in range(10):
                await life._scale_to_zero()
        assert sorted(c for trip in trips for c in trip) == [("XLEN", s) for s in streams]  # each once
        assert max(len(trip) for trip in trips) < 40
        await setup.xadd(keys.request_stream("m005", 1), {FIELD: b"queued"})
        for _ in range(10):
            await life._scale_to_zero()
        assert [n for n, e in plane.catalog.entries.items() if e.target != IDLE] == ["m005"]
    finally:
        await client.aclose(close_connection_pool=True)
        await setup.aclose(close_connection_pool=True)
