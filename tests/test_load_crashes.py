"""A model whose load kills the worker loading it (a backend that crashes, the OOM killer's SIGKILL): the
control plane sees the workers die while loading it, fails it after two deaths with why, places it on no
worker again, and the other models serve; a load tries it again. Real processes: the backend's load sends
SIGKILL to its own worker."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from despina.contract.catalog import CatalogEntry
from despina.contract.cluster import VersionStatus, WorkerInfo, WorkerStatus
from despina.contract.keys import Keys
from despina.control.crashes import Crashes
from despina.control.placement import place
from despina.control.state import Catalog, Workers

from .conftest import Server
from .control_support import index, wait_until

CRASH_MODULE = '''
import os
import signal

from despina.workers.backends import Backend


class CrashBackend(Backend):
    """Its load kills the process loading it, as the OOM killer does, while the marker file exists."""

    def load(self):
        if os.path.exists(self.spec.config["parameters"]["marker"]["string_value"]):
            os.kill(os.getpid(), signal.SIGKILL)

    def execute(self, inputs, outputs):
        return {"y": inputs["x"] + 1}
'''
CONFIG = '''
backend: "crash"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]
parameters { key: "marker" value: { string_value: "MARKER" } }
'''
BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
WHY = "the worker loading it died 2 times"
ENV = {"DESPINA_WORKER_TTL_S": "2"}  # a dead worker is seen in 2 s


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A tiny installed distribution whose entry point names the crashing backend."""
    path = tmp_path / "site"
    info = path / "despina_crash_backend-0.1.dist-info"
    info.mkdir(parents=True)
    (path / "despina_crash_backend.py").write_text(CRASH_MODULE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: despina-crash-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[despina.backends]\ncrash = despina_crash_backend:CrashBackend\n")
    return path


def write_model(repo: Path, name: str, marker: Path, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.replace("MARKER", str(marker)) + extra)


def state(url: str, name: str) -> tuple[str, str]:
    row = next((m for m in index(url) if m["name"] == name), {})
    return row.get("state", ""), row.get("reason", "")


def deaths(server: Server) -> int:
    return len(re.findall(r"worker \d+ exited with -9", server.logs()))


def test_a_load_that_kills_its_worker_fails_after_two_deaths_and_the_others_serve(
        serve: Callable[..., Server], tmp_path: Path, site: Path) -> None:
    repo, marker = tmp_path / "repo", tmp_path / "crash"
    marker.touch()
    write_model(repo, "boom", marker)
    write_model(repo, "fine", tmp_path / "never")
    server = serve(repo, "--workers", "2", "--model-control-mode", "explicit", "--load-model", "fine",
                   wait_models=("fine",), env={**ENV, "PYTHONPATH": str(site)})
    r = httpx.post(f"{server.url}/v2/repository/models/boom/load", timeout=120)
    assert r.status_code == 400 and WHY in r.json()["error"], r.text
    assert state(server.url, "boom") == ("UNAVAILABLE", r.json()["error"].split(": ", 1)[1]), index(server.url)
    # no crash loop: serve (which stops everything at a role's 5th crash in a minute) and the workers live on
    time.sleep(5)
    assert server.process.poll() is None, server.logs()
    assert deaths(server) == 2, server.logs()
    r = httpx.post(f"{server.url}/v2/models/boom/infer", json=BODY, timeout=30)
    assert r.status_code in (404, 503) and WHY in r.json()["error"], r.text
    wait_until(lambda: httpx.post(f"{server.url}/v2/models/fine/infer", json=BODY, timeout=30).status_code == 200,
               what="fine serves")
    metrics = httpx.get(server.metrics_url, timeout=30).text
    assert re.search(r'despina_model_load_crashes_total\{model="boom",version="1"\} 2', metrics), metrics
    status = server.metrics_url.removesuffix("/metrics") + "/status.json"

    def status_row() -> dict[str, object] | None:  # (the control plane samples every 2 s)
        row = next((m for m in httpx.get(status).json()["models"] if m["name"] == "boom"), None)
        return row if row is not None and row["load_crashes"] == 2 else None

    row = wait_until(status_row, 10, what="the status page's row")
    assert row["failed"] and WHY in str(row["reason"]), row
    # a load through the API tries it again: it serves now that its load no longer crashes
    marker.unlink()
    r = httpx.post(f"{server.url}/v2/repository/models/boom/load", timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/v2/models/boom/infer", json=BODY, timeout=30).status_code == 200


def test_a_model_loading_beside_the_crashing_one_is_not_blamed(
        serve: Callable[..., Server], tmp_path: Path, site: Path) -> None:
    repo, marker = tmp_path / "repo", tmp_path / "crash"
    marker.touch()
    write_model(repo, "boom", marker)
    write_model(repo, "fine", tmp_path / "never")
    server = serve(repo, "--workers", "1", health="live", env={**ENV, "PYTHONPATH": str(site)})
    wait_until(lambda: WHY in state(server.url, "boom")[1], timeout=60, what="boom failed")
    wait_until(lambda: httpx.post(f"{server.url}/v2/models/fine/infer", json=BODY, timeout=30).status_code == 200,
               what="fine serves")
    assert state(server.url, "fine")[0] == "READY"
    time.sleep(3)
    assert server.process.poll() is None and deaths(server) == 2, server.logs()


def test_a_cold_start_that_kills_its_worker_backs_off_without_killing_more(
        serve: Callable[..., Server], tmp_path: Path, site: Path) -> None:
    repo, marker = tmp_path / "repo", tmp_path / "crash"
    write_model(repo, "boom", marker, 'parameters { key: "idle_timeout_s" value: { string_value: "1" } }\n')
    server = serve(repo, "--workers", "2", wait_models=("boom",), env={**ENV, "PYTHONPATH": str(site)})
    assert httpx.post(f"{server.url}/v2/models/boom/infer", json=BODY, timeout=30).status_code == 200
    wait_until(lambda: "unloading it" in server.logs(), timeout=30, what="boom scaled to zero")
    time.sleep(1)
    marker.touch()
    r = httpx.post(f"{server.url}/v2/models/boom/infer", json=BODY, timeout=60)
    assert r.status_code == 503 and WHY in r.json()["error"], r.text
    # the next requests hear it at once; after the backoff one tries again, and its load is refused, not
    # placed on a worker to kill it
    r = httpx.post(f"{server.url}/v2/models/boom/infer", json=BODY, timeout=60)
    assert r.status_code == 503 and WHY in r.json()["error"], r.text
    time.sleep(3)
    r = httpx.post(f"{server.url}/v2/models/boom/infer", json=BODY, timeout=60)
    assert r.status_code == 503 and WHY in r.json()["error"], r.text
    time.sleep(3)
    assert server.process.poll() is None and deaths(server) == 2, server.logs()


def test_a_control_plane_that_took_over_places_a_model_that_killed_workers_on_none() -> None:
    """The deaths are counted in the control plane that saw them; the failure they gave is in the catalog, and
    one that took over (it saw no death) places the model on no worker all the same."""
    redis = aioredis.Redis()  # (nothing here talks to it)
    keys = Keys("test-crashes")
    catalog, workers = Catalog(redis, keys), Workers(redis, keys)
    crashes = Crashes(redis, keys, catalog, workers)
    why = crashes.why(2)
    failed = CatalogEntry("boom", "/m/boom", {"name": "boom"}, (1,), revisions={1: "r1"}, failed={1: why})
    assert crashes.hold(failed, ("w1",), "") == ((), f"version 1 failed: {why}")
    other = replace(failed, failed={1: "some other load error"})
    assert crashes.hold(other, ("w1",), "") == (("w1",), "")


async def test_one_event_that_ends_several_workers_counts_one_death_and_a_leaving_worker_none(
        redis_url: str, key_prefix: str) -> None:
    """Workers found dead at one look (a Redis that stalled past their TTL, a node with two of them) are one
    event: a model loading on two replicas was failed by one stall. A worker told to stop and killed at the
    end of its grace blames nothing. And a model one version of which killed workers is placed on no worker,
    its other versions with it: a worker loads every version it is given, and died again."""
    client = aioredis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    catalog, workers = Catalog(client, keys), Workers(client, keys)
    crashes = Crashes(client, keys, catalog, workers)
    m = CatalogEntry("m", "/m/m", {"name": "m"}, (1,), revisions={1: "r1"}, workers=("w1", "w2"))
    catalog.entries["m"] = m

    def loading(wid: str, leaving: bool = False) -> WorkerStatus:
        return WorkerStatus(WorkerInfo(wid), {"m": {1: VersionStatus("LOADING", "r1")}}, leaving=leaving)

    try:
        counted: set[tuple[str, int]] = set()
        for wid in ("w1", "w2"):  # one look finds both dead
            await crashes.died(wid, loading(wid), counted)
        assert crashes.fail(m).failed == {}  # a suspect, not failed
        await crashes.died("w3", loading("w3", leaving=True), set())
        assert crashes.fail(m).failed == {}
        await crashes.died("w4", loading("w4"), set())  # a second event: its load it is
        assert 1 in crashes.fail(m).failed
        two = replace(m, versions=(1, 2), revisions={1: "r1", 2: "r2"}, failed={2: crashes.why(2)})
        assert crashes.hold(two, ("w9",), "") == ((), f"version 2 failed: {crashes.why(2)}")
    finally:
        await client.delete(keys.stats("m", 1))
        await client.aclose()


async def test_a_suspect_goes_to_a_settled_worker_not_the_one_placement_likes_best(
        redis_url: str, key_prefix: str) -> None:
    """A version a worker died loading is placed where no other model loads. Placement's own choice (the
    worker with the fewest bytes committed) was filtered afterwards, so the suspect waited for that worker's
    loads while another sat settled: after a node crash in a large start, suspects came back one by one."""
    client = aioredis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    catalog, workers = Catalog(client, keys), Workers(client, keys)
    crashes = Crashes(client, keys, catalog, workers)
    suspect = CatalogEntry("s", "/m/s", {"name": "s"}, (1,), revisions={1: "r1"})
    other = CatalogEntry("o", "/m/o", {"name": "o"}, (1,), revisions={1: "q1"}, workers=("w1",))
    catalog.entries.update(s=suspect, o=other)
    homes = {w: WorkerInfo(w, memory_bytes=2**34) for w in ("w1", "w2")}
    workers.status = {"w1": WorkerStatus(homes["w1"], {"o": {1: VersionStatus("LOADING", "", "q1")}}),
                      "w2": WorkerStatus(homes["w2"], {})}
    used = {"w1": 0, "w2": 2**30}  # placement's liking: w1
    try:
        assert place(suspect, homes, used, 1) == (("w1",), "")
        await crashes.died("w0", WorkerStatus(WorkerInfo("w0"), {"s": {1: VersionStatus("LOADING", "r1")}}),
                           set())
        busy = crashes.busy(suspect, homes)
        assert busy == {"w1"}
        assert crashes.hold(suspect, *place(suspect, homes, used, 1, busy), busy) == (("w2",), "")
        workers.status["w2"] = WorkerStatus(homes["w2"], {"o": {1: VersionStatus("LOADING", "", "q1")}})
        catalog.entries["o"] = replace(other, workers=("w1", "w2"))  # now nowhere is settled: it waits
        busy = crashes.busy(suspect, homes)
        placed, why = crashes.hold(suspect, *place(suspect, homes, used, 1, busy), busy)
        assert placed == () and "waits for the other loads on worker w1, w2" in why, why
        assert crashes.busy(other, homes) == set()  # a model no worker died loading: nothing left out
    finally:
        await client.delete(keys.stats("s", 1))
        await client.aclose()
