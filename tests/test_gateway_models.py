"""The gateway's model view (gateway/models.py) against a Redis of the test's own, whose command counts
(INFO commandstats) are the view's and its writers' alone: a refresh reads again only what changed, and
sees every change the control plane and the workers make."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from despina.contract.cluster import VersionStatus, pack_detail
from despina.contract.instance_groups import completed_config
from despina.gateway.models import ModelView

from .cluster_support import Cluster, own_cluster

PREFIX = "despina-view"


class ViewCluster(Cluster):
    async def place(self, *names: str) -> None:
        """Register models (identity ONNX) on the worker, as the control plane does, and let it load them."""
        for name in names:
            self.put(name)
        await self.settle()

    async def settle(self) -> None:
        """The catalog written, the worker synced to it and its heartbeat written."""
        await self.catalog.flush()
        await self.worker.sync()
        await self.loaded()
        await self.worker._heartbeat()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[ViewCluster]:
    async with own_cluster(tmp_path, PREFIX, ViewCluster) as made:
        yield made


def moved(before: dict[str, int], after: dict[str, int], *names: str) -> dict[str, int]:
    return {n: after.get(n, 0) - before.get(n, 0) for n in names}


async def test_nothing_is_read_again_while_nothing_changed_and_each_change_is_seen(cluster: ViewCluster) -> None:
    """Every refresh (twice a second, in every gateway) read the whole catalog and every worker's state:
    at 400 models 0.5 MB each time, at 2,000 2.6 MB, though nothing changed."""
    await cluster.place("m0", "m1", "m2")
    view = ModelView(cluster.redis, cluster.keys)
    await view.refresh()
    assert sorted(view.models) == ["m0", "m1", "m2"] and view.ready == {"m0": {1}, "m1": {1}, "m2": {1}}

    before = await cluster.calls()
    for _ in range(5):
        await cluster.worker._heartbeat()  # each heartbeat writes the same state again
        await view.refresh()
    assert moved(before, await cluster.calls(), "hgetall", "hmget") == {"hgetall": 0, "hmget": 0}
    assert view.connected and view.ready == {"m0": {1}, "m1": {1}, "m2": {1}}

    cluster.catalog.remove("m2")  # the control plane unloads a model: the catalog changes, then the worker
    await cluster.catalog.flush()
    await view.refresh()
    assert sorted(view.models) == ["m0", "m1"] and "m2" in view.ready
    await cluster.settle()
    await view.refresh()
    assert view.ready == {"m0": {1}, "m1": {1}}

    await cluster.place("m3")
    await view.refresh()
    assert sorted(view.models) == ["m0", "m1", "m3"] and view.ready == {"m0": {1}, "m1": {1}, "m3": {1}}


async def test_a_catalog_published_again_after_redis_lost_its_data_is_read(cluster: ViewCluster) -> None:
    """Redis restarted empty, and the control plane published the catalog again (one change in it) before
    the view's next refresh: a generation that started again at 1 would read as the one seen before."""
    await cluster.place("m0")
    view = ModelView(cluster.redis, cluster.keys)
    await view.refresh()
    await cluster.redis.flushall()
    await view.refresh()
    assert not view.connected and "m0" in view.models  # routes on as before, not ready

    cluster.catalog.republish()
    cluster.catalog.put(replace(cluster.catalog.entries["m0"], reason="published again"))
    await cluster.catalog.flush()
    await cluster.worker._heartbeat()
    await view.refresh()
    assert view.connected and view.models["m0"].entry.reason == "published again"

    await cluster.redis.flushall()  # lost again, and published again with one change before any refresh
    cluster.catalog.republish()
    cluster.catalog.put(replace(cluster.catalog.entries["m0"], reason="and again"))
    await cluster.catalog.flush()
    await view.refresh()
    assert view.models["m0"].entry.reason == "and again"


async def test_writers_of_the_previous_version_are_read_every_time(cluster: ViewCluster) -> None:
    """A control plane of the previous version writes no generation, a worker no digest of its state: what
    they write is read at every refresh, as before, so their changes are seen."""
    await cluster.place("m0")
    entry = cluster.catalog.entries["m0"]
    await cluster.redis.delete(cluster.keys.catalog_generation)
    await cluster.redis.hset(cluster.keys.worker("old"), mapping={
        "models": orjson.dumps({"m9": {"1": "READY"}}),
        "detail": pack_detail({"m9": {1: VersionStatus("READY", "r9")}})})
    await cluster.redis.sadd(cluster.keys.workers, "old")
    view = ModelView(cluster.redis, cluster.keys)
    await view.refresh()
    before = await cluster.calls()
    await cluster.redis.hset(cluster.keys.catalog, "m9", replace(entry, name="m9", workers=("old",)).dumps())
    await view.refresh()
    await view.refresh()
    assert moved(before, await cluster.calls(), "hgetall", "hmget") == {"hgetall": 2, "hmget": 2}
    assert sorted(view.models) == ["m0", "m9"] and view.ready == {"m0": {1}, "m9": {1}}


async def test_a_refresh_reads_the_lengths_of_the_streams_requests_went_to(cluster: ViewCluster) -> None:
    """With max_stream_length (on by default) every refresh read the length of every stream that serves:
    4,000 XLENs a second for 2,000 idle models. Now those of the streams requests went to since the last
    refresh, and a full one is still refused."""
    await cluster.place("m0")
    entry = cluster.catalog.entries["m0"]
    cluster.catalog.put(replace(entry, name="m9", workers=("old",)))
    await cluster.catalog.flush()
    await cluster.redis.hset(cluster.keys.worker("old"), mapping={  # READY there; nothing reads its stream
        "models": orjson.dumps({"m9": {"1": "READY"}}), "state": b"9"})
    await cluster.redis.sadd(cluster.keys.workers, "old")
    stream = cluster.keys.request_stream("m9", 1)
    for _ in range(3):
        await cluster.redis.xadd(stream, {"m": b""})
    view = ModelView(cluster.redis, cluster.keys, max_stream_length=3)
    await view.refresh()
    assert view.ready == {"m0": {1}, "m9": {1}}

    before = await cluster.calls()
    await view.refresh()
    assert moved(before, await cluster.calls(), "xlen") == {"xlen": 0}
    assert view.resolve("m9", None)[1] == 1 and view.resolve("m9", None)[1] == 1  # requests for m9
    before = await cluster.calls()
    await view.refresh()
    assert moved(before, await cluster.calls(), "xlen") == {"xlen": 1}
    assert view.full == {stream}
    await view.refresh()  # none since
    assert view.full == set()


async def test_the_gpus_a_serving_worker_saw_are_read_with_its_state(cluster: ViewCluster) -> None:
    """GET .../config shows KIND_AUTO as Triton does, resolved where the model runs: the gateway knows how
    from the GPUs each worker's backend saw (none here; a worker with two reports 2), the most of any."""
    await cluster.place("m0")
    entry = cluster.catalog.entries["m0"]
    cluster.catalog.put(replace(entry, name="m9", workers=("gpu",)))
    await cluster.catalog.flush()
    await cluster.redis.hset(cluster.keys.worker("gpu"), mapping={
        "models": orjson.dumps({"m0": {"1": "READY"}, "m9": {"1": "READY"}}), "state": b"1",
        "detail": pack_detail({"m0": {1: VersionStatus("READY", "r0")},
                               "m9": {1: VersionStatus("READY", "r9", gpus=2)}})})
    await cluster.redis.sadd(cluster.keys.workers, "gpu")
    view = ModelView(cluster.redis, cluster.keys)
    await view.refresh()
    assert view.states.gpus == {("m9", 1): 2}  # m0: no GPU on the test's worker, nor in the other's word
    groups = completed_config(view.models["m9"].spec, view.states.gpus[("m9", 1)])["instance_group"]
    assert [(g["kind"], g["gpus"]) for g in groups] == [("KIND_GPU", [0, 1])]
    assert [(g["kind"], g["gpus"]) for g in completed_config(view.models["m0"].spec, 0)["instance_group"]] \
        == [("KIND_CPU", [])]
