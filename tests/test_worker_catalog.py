"""How a worker follows the catalog (workers/worker.py sync), against a Redis of the test's own whose command
counts (INFO commandstats) are the worker's and the catalog writer's alone: the catalog is read again only
when its generation moved, every change is seen, and what sync retries on its own still happens though
nothing in the catalog moved."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from despina.control.repository import load_model

from .cluster_support import Cluster, own_cluster

PREFIX = "despina-follow"

ENSEMBLE = """name: "e0"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling { step [ { model_name: "m0" model_version: -1
  input_map { key: "in" value: "IN" } output_map { key: "out" value: "OUT" } } ] }
"""


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with own_cluster(tmp_path, PREFIX, Cluster) as made:
        yield made


async def test_the_catalog_is_read_again_only_when_it_moved_and_each_change_is_seen(cluster: Cluster) -> None:
    """Each worker read the whole catalog every second though nothing moved: 0.49 MB a second per worker at
    400 models."""
    cluster.put("m0")
    cluster.put("m1")
    await cluster.catalog.flush()
    await cluster.worker.sync()
    await cluster.loaded()
    assert cluster.serving() == ["m0", "m1"]

    before = await cluster.hgetalls()
    for _ in range(5):
        await cluster.worker.sync()
    assert await cluster.hgetalls() - before == 0

    cluster.catalog.remove("m1")  # the control plane unloads one model and places another
    cluster.put("m2")
    await cluster.catalog.flush()
    await cluster.worker.sync()
    await cluster.loaded()
    assert cluster.serving() == ["m0", "m2"]
    assert sorted(cluster.worker.catalog) == ["m0", "m2"]
    assert await cluster.hgetalls() - before == 1


async def test_under_a_control_plane_of_the_previous_version_the_catalog_is_read_every_time(
        cluster: Cluster) -> None:
    """A control plane of the previous version writes the catalog and no generation (and the generation a
    later one left expires): each sync reads the catalog, and sees its changes."""
    cluster.put("m0")
    await cluster.catalog.flush()
    await cluster.redis.delete(cluster.keys.catalog_generation)
    await cluster.worker.sync()
    await cluster.loaded()
    entry = cluster.catalog.entries["m0"]

    before = await cluster.hgetalls()
    await cluster.worker.sync()
    await cluster.redis.hset(cluster.keys.catalog, "m0", replace(entry, workers=()).dumps())
    await cluster.worker.sync()
    assert await cluster.hgetalls() - before == 2
    assert cluster.serving() == []


async def test_an_ensemble_that_could_not_start_starts_at_a_later_sync_though_nothing_moved(
        cluster: Cluster) -> None:
    """sync runs every second for what it retries on its own, besides the catalog: an ensemble whose start
    here failed (Redis refused its stream) starts at the next sync once it can, with no change in the
    catalog to read."""
    cluster.put("m0")
    folder = cluster.folders / "e0"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(ENSEMBLE)
    cluster.catalog.put(load_model(folder))
    await cluster.catalog.flush()
    stream = cluster.keys.request_stream("e0", 1)
    await cluster.redis.set(stream, b"not a stream")  # its consumer group cannot be made: the start fails
    await cluster.worker.sync()
    await cluster.loaded()
    await cluster.worker.sync()  # m0 READY: the ensemble could run here, and fails to start
    assert cluster.serving() == ["m0"] and cluster.worker.hosts == {}

    await cluster.redis.delete(stream)
    before = await cluster.hgetalls()
    await cluster.worker.sync()
    assert list(cluster.worker.hosts) == [("e0", 1)]
    assert await cluster.hgetalls() - before == 0


async def test_a_load_stopped_as_it_announces_itself_is_forgotten(cluster: Cluster) -> None:
    """A load unloaded while it was announcing that it starts (the heartbeat before it) stayed LOADING in
    the worker's state for good: an unload waited for it in vain, and a load of the model again never
    started (one of the same files was on its way, as far as the worker knew)."""
    cluster.put("m0")
    await cluster.catalog.flush()
    async with cluster.worker._beating:  # a heartbeat on its way: the load waits to announce itself
        await cluster.worker.sync()
        _, task = cluster.worker.loading[("m0", 1)]
        while cluster.worker._next_announce is None and cluster.worker._announcing is None:
            await asyncio.sleep(0)  # (the load's announce begun: it waits for the heartbeat held here)
        cluster.catalog.remove("m0")
        await cluster.catalog.flush()
        await cluster.worker.sync()
    await asyncio.gather(task, return_exceptions=True)
    await cluster.worker._announced()
    assert cluster.worker.loading == {} and "m0" not in cluster.worker.detail()

    cluster.put("m0")
    await cluster.catalog.flush()
    await cluster.worker.sync()
    await cluster.loaded()
    assert cluster.serving() == ["m0"]
