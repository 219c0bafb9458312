"""Scale-to-zero: an idle model is unloaded from every worker, and the next requests bring it back."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import orjson
import redis

from despina.contract.catalog import IDLE as SCALED_TO_ZERO
from despina.contract.catalog import LOADED, CatalogEntry
from despina.contract.cluster import VersionStatus, WorkerInfo, pack_detail
from despina.contract.keys import FIELD, Keys
from despina.control.plane import ControlPlane
from despina.redis_client import connect
from despina.settings import Settings

from .conftest import Server, settled_stats
from .control_support import ROW, expected, index, mlp_folder, wait_until, worker_hashes

MB = 1024 * 1024
IDLE = 'parameters { key: "idle_timeout_s" value: { string_value: "1" } }'


def loaded_models(redis_url: str, prefix: str) -> set[str]:
    """What the workers' model tables hold."""
    return {name for h in worker_hashes(redis_url, prefix).values()
            for name in orjson.loads(h.get(b"models", b"{}"))}


def test_an_idle_model_unloads_and_fifty_first_requests_cause_one_load(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", extra=IDLE)
    mlp_folder(repo, "steady")  # no idle timeout: stays
    server = serve(repo, wait_models=("mlp", "steady"))
    assert httpx.post(f"{server.url}/fn/mlp", json=ROW).status_code == 200

    wait_until(lambda: "mlp" not in loaded_models(redis_url, key_prefix), 15, what="mlp to be unloaded")
    assert "steady" in loaded_models(redis_url, key_prefix)
    row = next(r for r in index(server.url) if r["name"] == "mlp")
    assert row["state"] == "UNAVAILABLE" and row["reason"].startswith("idle")
    assert httpx.get(f"{server.url}/v2/models/mlp").status_code == 200   # still registered
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(f"{server.url}/fn/mlp", json=ROW) for _ in range(50)))

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 50
    assert all(np.allclose(r.json()["y"], expected(0), atol=1e-4) for r in answers)
    assert server.logs().count("loaded mlp version 1 in") == 2   # at start, and one cold start

    client = redis.Redis.from_url(redis_url)
    try:
        cold = orjson.loads(client.hget(Keys(key_prefix).cold_starts, "mlp"))
    finally:
        client.close()
    assert cold["count"] == 1 and 0 < cold["last_ms"] < 5000
    print(f"cold start of mlp from the local registry: {cold['last_ms']} ms "
          f"(the worker's load {cold['last_load_ms']} ms)")
    assert "mlp: cold start took" in server.logs()
    # every request counts once in the statistics, the first one's and the fifty that waited for the load
    assert settled_stats(server.url, "mlp")["inference_stats"]["success"]["count"] == 51
    # the cold start's time in a histogram (a summary had no buckets: no quantile of cold starts)
    metrics = httpx.get(server.metrics_url).text
    assert "# TYPE despina_cold_start_duration_seconds histogram" in metrics
    labels = 'model="mlp",version="1"'
    assert f'despina_cold_start_duration_seconds_bucket{{{labels},le="+Inf"}} 1' in metrics
    assert f"despina_cold_start_duration_seconds_count{{{labels}}} 1" in metrics
    assert f'despina_cold_start_duration_seconds_bucket{{{labels},le="10"}} 1' in metrics  # it took < 5 s


def test_a_model_is_not_idle_before_any_worker_has_loaded_it(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The idle clock starts when the model serves: a worker that joins after the idle timeout has
    passed still loads it, and it answers."""
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", extra=IDLE)
    server = serve(repo, "--workers", "0", env={"DESPINA_WORKER_TTL_S": "1"}, health="live")
    time.sleep(3)  # the control plane's start-up hold (1 s) and the idle timeout (1 s) both pass
    wait_until(lambda: "placed on no worker" in server.logs(), 30, what="the model placed on no worker")
    log = (tmp_path / "late-worker.log").open("wb")
    worker = subprocess.Popen([sys.executable, "-m", "despina", "worker", "--redis-url", redis_url,
                               "--key-prefix", key_prefix], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "DESPINA_WORKER_TTL_S": "1"})
    try:
        wait_until(lambda: "mlp" in loaded_models(redis_url, key_prefix), 30, what="the late worker to load mlp")
        r = httpx.post(f"{server.url}/fn/mlp", json=ROW, timeout=30)
        assert r.status_code == 200 and np.allclose(r.json()["y"], expected(0), atol=1e-4)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        log.close()


SLEEPY = """
import pathlib
import time
import numpy as np
import triton_python_backend_utils as pb_utils

RUNNING = {running!r}


class TritonPythonModel:
    def execute(self, requests):
        pathlib.Path(RUNNING).touch()
        time.sleep(30)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, np.float32))]) for _ in requests]
"""


def test_a_standalone_workers_drain_ends_within_the_drain_timeout(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """`despina worker` (a Kubernetes pod) waited for its models to answer all they had read, however
    long they took, until the grace period's SIGKILL; it now leaves after DESPINA_DRAIN_TIMEOUT_S, and
    the control plane requeues what it read at once."""
    repo = tmp_path / "repo"
    (repo / "sleepy" / "1").mkdir(parents=True)
    running = tmp_path / "running"
    (repo / "sleepy" / "1" / "model.py").write_text(SLEEPY.format(running=str(running)))
    (repo / "sleepy" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\ninput [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')
    # (its gateway's drain too: it held the killed client's request for 30 s at the end)
    server = serve(repo, "--workers", "0", health="live", env={"DESPINA_DRAIN_TIMEOUT_S": "1"})
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen([sys.executable, "-m", "despina", "worker", "--redis-url", redis_url,
                               "--key-prefix", key_prefix], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "DESPINA_DRAIN_TIMEOUT_S": "1"})
    asking: subprocess.Popen[bytes] | None = None
    try:
        wait_until(lambda: "sleepy" in loaded_models(redis_url, key_prefix), 30, what="the worker to load it")
        body = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        asking = subprocess.Popen([sys.executable, "-c", "import httpx, sys; httpx.post(sys.argv[1], "
                                   f"json={body!r}, timeout=60)", f"{server.url}/v2/models/sleepy/infer"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # the request is in the model's 30 s execute (a sleep of 1.5 s was not always enough for a loaded
        # machine to start the client and get its request there: the worker then had nothing to drain)
        wait_until(running.exists, 30, what="the request to run")
        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        worker.wait(25)
        took = time.monotonic() - started
    finally:
        for process in (worker, asking):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        log.close()
    text = (tmp_path / "worker.log").read_text()
    assert took < 12, (took, text[-2000:])  # 1 s of drain, then up to 5 s for the thread in the model's code
    assert "was not all answered within 1 s (DESPINA_DRAIN_TIMEOUT_S)" in text


def test_a_failed_cold_start_is_not_timed_into_the_next_load(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A cold start whose load fails ends there: its clock kept running until some later load (here the
    load API's, after the files were mended) made the model READY, and that load was counted as a cold
    start lasting from the failed wake-up (meanwhile the control plane ticked 20 times a second)."""
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", extra=IDLE)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "mlp", wait_models=("mlp",))
    assert httpx.post(f"{server.url}/fn/mlp", json=ROW).status_code == 200
    wait_until(lambda: "mlp" not in loaded_models(redis_url, key_prefix), 15, what="mlp to be unloaded")
    onnx = repo / "mlp" / "1" / "model.onnx"
    good = onnx.read_bytes()
    onnx.write_bytes(b"not an onnx model")
    r = httpx.post(f"{server.url}/fn/mlp", json=ROW, timeout=30)
    assert r.status_code == 503 and "load failed for model 'mlp'" in r.json()["error"], r.text
    time.sleep(2)  # the model stays broken a while before someone mends it
    onnx.write_bytes(good)
    assert httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=30).status_code == 200
    assert httpx.post(f"{server.url}/fn/mlp", json=ROW, timeout=30).status_code == 200

    client = redis.Redis.from_url(redis_url)
    try:
        cold = client.hget(Keys(key_prefix).cold_starts, "mlp")
    finally:
        client.close()
    # no cold start succeeded (the load API's load is none); the one that failed is counted as such
    doc = orjson.loads(cold)
    assert doc["count"] == 0 and doc["failed"] == 1, doc
    assert "mlp: cold start took" not in server.logs()


HELD = """
import os
import time
import triton_python_backend_utils as pb_utils

HOLD = {hold!r}


class TritonPythonModel:
    def initialize(self, args):
        while os.path.exists(HOLD):  # a load as slow as the test wants
            time.sleep(0.05)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
"""


def test_a_request_that_joins_a_cold_start_waits_its_own_timeout(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Requests that come during a cold start share its wake, which lasted the first one's timeout: a
    request that came 4 s after the first was refused (503) when the first one's 6 s ran out, and the
    model was READY a moment later, well within its own."""
    repo, hold = tmp_path / "repo", tmp_path / "hold"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(HELD.format(hold=str(hold)))
    (repo / "slow" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n' + IDLE + "\n")
    server = serve(repo, "--request-timeout", "6", wait_models=("slow",))
    wait_until(lambda: "slow" not in loaded_models(redis_url, key_prefix), 15, what="slow to be unloaded")
    hold.touch()
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}

    async def first_and_joining() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = asyncio.create_task(client.post("/v2/models/slow/infer", json=body))
            await asyncio.sleep(4)
            joining = asyncio.create_task(client.post("/v2/models/slow/infer", json=body))
            refused = await first  # the load still held: its 6 s run out
            hold.unlink()
            return [refused, await joining]

    refused, joined = asyncio.run(first_and_joining())
    assert refused.status_code == 503 and "did not load within" in refused.json()["error"], refused.text
    assert joined.status_code == 200, joined.text


class OneWorker:
    """A ControlPlane (1 s idle timeout) against the test Redis, its catalog holding `entries`, which it has
    placed on worker "w": a heartbeat hash that the test writes (`reports`)."""

    def __init__(self, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
        self.client, self.setup = connect(redis_url), connect(redis_url)
        self.keys = Keys(key_prefix)
        self.plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix,
                                           idle_timeout_s=1), self.client)

    async def start(self, *entries: CatalogEntry) -> None:
        for e in entries:
            self.plane.catalog.put(e)
        await self.setup.hset(self.keys.worker("w"), "info", WorkerInfo("w", memory_bytes=1000 * MB).dumps())
        await self.setup.sadd(self.keys.workers, "w")
        await self.plane.lifecycle.tick()  # places them on w
        assert all(self.plane.catalog.entries[e.name].workers == ("w",) for e in entries if e.footprint)

    async def reports(self, state: str, *models: str) -> None:
        detail = pack_detail({m: {1: VersionStatus(state, "r1")} for m in models})
        await self.setup.hset(self.keys.worker("w"), mapping={"detail": detail, "state": state})  # (its digest)
        await self.plane.workers.refresh()

    def target(self, name: str) -> str:
        return self.plane.catalog.entries[name].target

    async def close(self) -> None:
        await self.client.aclose(close_connection_pool=True)
        await self.setup.aclose(close_connection_pool=True)


def model(name: str) -> CatalogEntry:
    return CatalogEntry(name, f"/repo/{name}", {"name": name}, (1,), revisions={1: "r1"}, footprint=MB)


async def test_a_models_idle_clock_starts_at_the_first_check_that_sees_it_serve(
        tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The idle clock started at the last check that saw the model still loading, which may be a tick (a
    second; more on a busy machine) before it served: a model with a 1 s timeout was unloaded by the first
    check that saw it serve, before anyone could call it (a flaky ensemble test's step model went idle so,
    before its first request)."""
    w = OneWorker(tmp_path, redis_url, key_prefix)
    try:
        await w.start(model("m"))
        await w.reports("LOADING", "m")
        await w.plane.lifecycle._scale_to_zero()  # a check while it loads...
        await asyncio.sleep(1.2)  # ...and none for longer than its idle timeout
        await w.reports("READY", "m")
        await w.plane.lifecycle._scale_to_zero()  # the first check that sees it serve
        assert w.target("m") == LOADED
        await asyncio.sleep(1.2)  # and now it has served its timeout uncalled
        await w.plane.lifecycle._scale_to_zero()
        assert w.target("m") == SCALED_TO_ZERO
    finally:
        await w.close()


async def test_a_request_queued_for_an_ensemble_keeps_the_models_it_calls(
        tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A worker that runs an ensemble itself calls the models straight, through none of their streams,
    and keeps the request in the ensemble's stream until it answers it. The models' idle check read only
    their own streams: a step waiting behind a longer one (or a request queued for the ensemble) found
    its model scaled to zero. Such a request now counts as one queued for each model the ensemble calls."""
    ensemble = CatalogEntry("e", "/repo/e", {"name": "e", "platform": "ensemble", "ensemble_scheduling": {
        "step": [{"model_name": "m"}, {"model_name": "post"}]}}, (1,))
    w = OneWorker(tmp_path, redis_url, key_prefix)
    try:
        await w.start(model("m"), model("post"), model("other"), ensemble)
        await w.reports("READY", "m", "post", "other")
        await w.plane.lifecycle._scale_to_zero()  # their idle clocks start
        await asyncio.sleep(1.2)  # none is called for longer than its idle timeout...
        entry = await w.setup.xadd(w.keys.request_stream("e", 1), {FIELD: b"queued"})  # ...but one is queued
        await w.plane.lifecycle._scale_to_zero()
        assert {n: w.target(n) for n in ("m", "post", "other")} == {
            "m": LOADED, "post": LOADED, "other": SCALED_TO_ZERO}
        await w.setup.xdel(w.keys.request_stream("e", 1), entry)  # answered
        await w.plane.lifecycle._scale_to_zero()
        assert w.target("m") == w.target("post") == SCALED_TO_ZERO
    finally:
        await w.close()


def test_a_model_that_calls_an_ensemble_whose_steps_are_scaled_to_zero_waits_for_them(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A Python model's call (BLS) of an ensemble whose model was scaled to zero failed at once ("ensemble
    runs on no worker") and woke nothing, where a client's request for the same ensemble wakes the model.
    The call now wakes the models the ensemble calls and waits, within its time, for a worker to run it."""
    from .test_backend_python import write_model
    from .test_bls import CALLER, add_onnx_add_sub, caller_config
    from .test_ensemble import ensemble_config, step, write

    repo = tmp_path / "repo"
    write_model(repo, "caller", CALLER, caller_config("caller"))
    add_onnx_add_sub(repo)
    config = repo / "add_sub" / "config.pbtxt"
    config.write_text(config.read_text() + IDLE + "\n")
    tensors = ("sum", "diff")
    write(repo, "ens", ensemble_config(
        "ens", step("add_sub", {"a": "a", "b": "b"}, {t: t for t in tensors}),
        inputs="input [ " + ", ".join(f'{{ name: "{t}" data_type: TYPE_FP32 dims: [ 4 ] }}' for t in "ab") + " ]\n",
        outputs="output [ " + ", ".join(f'{{ name: "{t}" data_type: TYPE_FP32 dims: [ 4 ] }}' for t in tensors) + " ]\n"))
    server = serve(repo, wait_models=("caller", "add_sub"))
    wait_until(lambda: "add_sub" not in loaded_models(redis_url, key_prefix), 20, what="add_sub to be unloaded")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    r = httpx.post(f"{server.url}/v2/models/caller/infer", timeout=30, json={
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 4], "data": x.ravel().tolist()}],
        "parameters": {"target": "ens"}})
    assert r.status_code == 200, r.text
    assert [o["data"] for o in r.json()["outputs"]] == [(x + 1).ravel().tolist(), (x - 1).ravel().tolist()]
