"""Prometheus metrics and Triton's statistics after known traffic: exact counts, both agree."""
from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
import tritonclient.http as httpclient
from onnx import TensorProto

from despina import counters
from despina.contract import records
from despina.contract.errors import Code, DespinaError
from despina.contract.keys import FIELD, GROUP, IN_FLIGHT, Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.control import status
from despina.control.repository import load_model
from despina.counters import Deferred
from despina.examples import build_mlp, save_onnx
from despina.host_metrics import gpu_samples
from despina.metrics import render
from despina.workers.runner import ModelRunner
from despina.workers.stats import ensemble_counts, ensemble_successes, tally

from .conftest import FULL_QUEUE_DELAY, ROOT, Server, module_server, settled_stats
from .control_support import wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("metrics")
    build_mlp(repo / "m" / "1" / "model.onnx")
    (repo / "m" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 32\n'
        'dynamic_batching { max_queue_delay_microseconds: 20000 }\n')
    build_fails(repo / "fails" / "1" / "model.onnx")
    (repo / "fails" / "config.pbtxt").write_text(   # any width, as the model's; its graph fails all but 3
        'backend: "onnxruntime"\nmax_batch_size: 4\n'
        'input [{ name: "in", data_type: TYPE_FP32, dims: [-1] }]\n'
        'output [{ name: "out", data_type: TYPE_FP32, dims: [3] }]\n')
    build_mlp(repo / "q" / "1" / "model.onnx")
    (repo / "q" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 32\ndynamic_batching { max_queue_delay_microseconds: 500000 '
        'default_queue_policy { max_queue_size: 1 } }\n')
    shutil.copytree(ROOT / "model_repository" / "add_sub_python", repo / "add_sub_python")
    yield from module_server(repo, tmp_path_factory, redis_url, ("m", "fails", "q", "add_sub_python"),
                             env=FULL_QUEUE_DELAY)


def build_fails(path: Path) -> None:
    """'in' [N, W] + a constant of 3 -> 'out': a model whose shape takes any width and whose run fails in
    onnxruntime for all but 3 (a backend's own failure, after every check of the gateway and the worker)."""
    from onnx import helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["in", "three"], ["out"])], "fails",
        [helper.make_tensor_value_info("in", TensorProto.FLOAT, ["N", "W"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", "W"])],
        [numpy_helper.from_array(np.zeros(3, np.float32), "three")])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def v2(name: str, rows: int, width: int) -> bytes:
    return orjson.dumps({"inputs": [{"name": name, "shape": [rows, width], "datatype": "FP32",
                                     "data": np.ones(rows * width).tolist()}]})


def settled_scrape(server: Server, expected: dict[str, float]) -> dict[str, float]:
    """The metrics once they show `expected`: a burst's last counters may still be on their way, at
    most DEFER_S behind its replies (counters.py)."""
    deadline = time.monotonic() + 2
    while True:
        metrics = scrape(server)
        if all(metrics.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.01)


def scrape(server: Server) -> dict[str, float]:
    text = httpx.get(server.metrics_url).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_counts_are_exact_and_match_statistics(server: Server) -> None:
    async def traffic() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            m = [client.post(f"{server.url}/v2/models/m/infer", content=v2("x", 1, 256)) for _ in range(16)]
            m.append(client.post(f"{server.url}/v2/models/m/infer", content=v2("x", 3, 256)))
            q = [client.post(f"{server.url}/v2/models/q/infer", content=v2("x", 1, 256)) for _ in range(3)]
            bad = client.post(f"{server.url}/v2/models/fails/infer", content=v2("in", 1, 5))
            return [r.status_code for r in await asyncio.gather(*m, *q, bad)]

    statuses = asyncio.run(traffic())
    assert statuses[:17] == [200] * 17
    assert sorted(statuses[17:20]) == [200, 503, 503]
    assert statuses[20] == 500

    m, q, fails = ('{model="m",version="1"}', '{model="q",version="1"}', '{model="fails",version="1"}')
    metrics = settled_scrape(server, {f"nv_inference_request_success{m}": 17,
                                      f"nv_inference_request_success{q}": 1,
                                      'nv_inference_request_failure{model="fails",version="1",reason="BACKEND"}': 1})
    assert metrics[f"nv_inference_request_success{m}"] == 17
    assert metrics[f"nv_inference_count{m}"] == 19                 # a batch of 3 counts 3
    executions = metrics[f"nv_inference_exec_count{m}"]
    assert 1 <= executions < 17                                     # the 20 ms queue delay batched them
    assert metrics['nv_inference_request_failure{model="q",version="1",reason="REJECTED"}'] == 2
    assert metrics[f"nv_inference_request_success{q}"] == 1
    assert metrics['nv_inference_request_failure{model="fails",version="1",reason="BACKEND"}'] == 1
    assert metrics['nv_inference_request_failure{model="m",version="1",reason="OTHER"}'] == 0
    for model in (m, q, fails):
        assert metrics[f"nv_inference_pending_request_count{model}"] == 0
    assert metrics[f"nv_inference_queue_duration_us{m}"] > 0
    assert metrics[f"nv_inference_compute_infer_duration_us{m}"] > 0
    assert metrics['despina_batch_size_count{model="m",version="1"}'] == executions
    assert metrics['despina_batch_size_sum{model="m",version="1"}'] == 19
    assert metrics['despina_request_latency_seconds_count{model="m",version="1"}'] == 17
    assert metrics["despina_workers_alive"] == 1
    assert 0 <= metrics["nv_cpu_utilization"] <= 1 and metrics["nv_cpu_memory_total_bytes"] > 0

    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    stats = client.get_inference_statistics("m")["model_stats"][0]
    client.close()
    assert stats["inference_count"] == 19 and stats["execution_count"] == executions
    assert stats["inference_stats"]["success"]["count"] == 17
    assert sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == executions
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"]) == 19
    for step in ("compute_input", "compute_infer", "compute_output"):  # each batch size's own times
        assert all(b[step]["ns"] > 0 for b in stats["batch_stats"]), (step, stats["batch_stats"])
    assert stats["inference_stats"]["queue"]["ns"] // 1000 == pytest.approx(
        metrics[f"nv_inference_queue_duration_us{m}"], abs=1)


def test_a_python_models_compute_is_split_in_three_as_tritons_python_backend_splits_it(server: Server) -> None:
    """Triton's Python backend reports an execution in three parts (python_be.cc's ProcessRequests):
    compute input, the requests made ready for the model's process; compute infer, the round trip to it
    (the model's execute); compute output, its responses read back into the server's. Each counted once
    per request and per batch size, and the nv_inference_compute_*_duration_us counters say the same."""
    body = orjson.dumps({"inputs": [{"name": n, "shape": [2, 4], "datatype": "FP32", "data": [1.0] * 8}
                                    for n in ("INPUT0", "INPUT1")]})
    for _ in range(3):
        r = httpx.post(f"{server.url}/v2/models/add_sub_python/infer", content=body)
        assert r.status_code == 200, r.text
    stats = settled_stats(server.url, "add_sub_python")
    inference = stats["inference_stats"]
    assert inference["success"]["count"] >= 3
    for step in ("compute_input", "compute_infer", "compute_output"):
        assert inference[step]["count"] == inference["success"]["count"], (step, inference)
        assert inference[step]["ns"] > 0, (step, inference)
        assert all(b[step]["ns"] > 0 for b in stats["batch_stats"]), (step, stats["batch_stats"])
    labels = '{model="add_sub_python",version="1"}'
    metrics = settled_scrape(server, {f"nv_inference_request_success{labels}": inference["success"]["count"]})
    for step in ("compute_input", "compute_infer", "compute_output", "queue"):
        assert metrics[f"nv_inference_{step}_duration_us{labels}"] == pytest.approx(inference[step]["ns"] / 1000)
    assert metrics[f"nv_inference_request_duration_us{labels}"] == pytest.approx(inference["success"]["ns"] / 1000)


def test_statistics_carry_every_field_triton_sends_as_numbers(server: Server) -> None:
    """Triton's model_stat (core's TRITONSERVER_ServerModelStatistics): name, version as a string, counts
    and durations as JSON numbers, and response_stats, an object keyed by response index that holds
    entries only for a backend that reports per-response statistics (neither the ONNX Runtime nor the
    Python backend does: it is {} for theirs). Clients index it: it must be there."""
    assert httpx.post(f"{server.url}/v2/models/m/infer", content=v2("x", 2, 256)).status_code == 200
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    stats = client.get_inference_statistics("m")["model_stats"][0]
    client.close()
    assert set(stats) == {"name", "version", "last_inference", "inference_count", "execution_count",
                          "inference_stats", "response_stats", "batch_stats", "memory_usage"}
    assert (stats["name"], stats["version"], stats["response_stats"]) == ("m", "1", {})
    assert set(stats["inference_stats"]) == {"success", "fail", "queue", "compute_input", "compute_infer",
                                             "compute_output", "cache_hit", "cache_miss"}
    durations = [*stats["inference_stats"].values(),
                 *(b[k] for b in stats["batch_stats"] for k in ("compute_input", "compute_infer", "compute_output"))]
    assert all(set(d) == {"count", "ns"} and type(d["count"]) is int and type(d["ns"]) is int for d in durations)
    assert all(type(stats[k]) is int for k in ("last_inference", "inference_count", "execution_count"))
    assert all(type(b["batch_size"]) is int for b in stats["batch_stats"])
    assert abs(stats["last_inference"] - time.time() * 1000) < 60_000  # milliseconds since the epoch


def test_a_requests_latency_is_at_least_its_queue_and_compute(server: Server) -> None:
    """Triton's request latency runs until its response is sent, after compute_output: perf_analyzer
    reports what it leaves over queue and compute as the server's overhead, and printed 0 for Despina's,
    whose latency stopped before its outputs were split."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    before = client.get_inference_statistics("m")["model_stats"][0]["inference_stats"]
    for _ in range(20):
        assert httpx.post(f"{server.url}/v2/models/m/infer", content=v2("x", 1, 256)).status_code == 200
    deadline = time.monotonic() + 10
    while (after := client.get_inference_statistics("m")["model_stats"][0]["inference_stats"])[
            "success"]["count"] < before["success"]["count"] + 20:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    client.close()
    spent = {k: after[k]["ns"] - before[k]["ns"]
             for k in ("success", "queue", "compute_input", "compute_infer", "compute_output")}
    assert spent["compute_output"] > 0, spent
    assert spent["success"] >= sum(v for k, v in spent.items() if k != "success"), spent


def test_an_execution_whose_every_request_failed_counts_no_inference(server: Server) -> None:
    """Triton's backends report a batch's statistics (inference and execution counts, batch_stats,
    last_inference) only when one of its requests succeeded: a model that fails counts failures alone."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    before = client.get_inference_statistics("fails")["model_stats"][0]
    for _ in range(2):
        assert httpx.post(f"{server.url}/v2/models/fails/infer", content=v2("in", 1, 5)).status_code == 500
    failed = 'nv_inference_request_failure{model="fails",version="1",reason="BACKEND"}'
    metrics = settled_scrape(server, {failed: before["inference_stats"]["fail"]["count"] + 2})
    after = client.get_inference_statistics("fails")["model_stats"][0]
    client.close()
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 2
    assert (after["inference_count"], after["execution_count"], after["batch_stats"], after["last_inference"]) \
        == (before["inference_count"], before["execution_count"], before["batch_stats"], before["last_inference"])
    labels = '{model="fails",version="1"}'
    assert metrics[f"nv_inference_count{labels}"] == before["inference_count"]
    assert metrics[f"nv_inference_exec_count{labels}"] == before["execution_count"]


def test_metric_names_are_tritons(server: Server) -> None:
    text = httpx.get(server.metrics_url).text
    for name in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                 "nv_inference_exec_count", "nv_inference_pending_request_count",
                 "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                 "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                 "nv_inference_compute_output_duration_us"):
        assert re.search(rf"^# TYPE {name} (counter|gauge)$", text, re.M), name


# Triton 2.51's HELP lines, as its /metrics wrote them (tritonserver of the peers kit, CPU only)
TRITON_HELP = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (does not include cached requests)",
    "nv_inference_exec_count": "Number of model executions performed (does not include cached requests)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds (includes "
                                        "cached requests)",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds (includes cached "
                                      "requests)",
    "nv_inference_compute_input_duration_us": "Cumulative compute input duration in microseconds (does not "
                                              "include cached requests)",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds (does "
                                              "not include cached requests)",
    "nv_inference_compute_output_duration_us": "Cumulative inference compute output duration in microseconds "
                                               "(does not include cached requests)",
    "nv_inference_pending_request_count": "Instantaneous number of pending requests awaiting execution "
                                          "per-model.",
    "nv_cpu_utilization": "CPU utilization rate [0.0 - 1.0]",
    "nv_cpu_memory_total_bytes": "CPU total memory (RAM), in bytes",
    "nv_cpu_memory_used_bytes": "CPU used memory (RAM), in bytes",
}


def test_help_lines_are_tritons_word_for_word(server: Server) -> None:
    """Dashboards and tools that show a metric's HELP show Triton's; and no per-model cache family for
    models whose config does not enable the response cache (none of this server's), as Triton 2.51."""
    text = httpx.get(server.metrics_url).text
    helps = dict(line[len("# HELP "):].split(" ", 1) for line in text.splitlines() if line.startswith("# HELP "))
    assert {name: helps.get(name) for name in TRITON_HELP} == TRITON_HELP
    assert "nv_cache_num_hits_per_model" not in helps


def test_request_id_is_echoed_and_reaches_the_worker_log(tmp_path_factory: pytest.TempPathFactory,
                                                         redis_url: str, example_repository: Path) -> None:
    servers = module_server(example_repository, tmp_path_factory, redis_url, ("mlp",),
                            env={"DESPINA_LOG_LEVEL": "debug", "DESPINA_LOG_FORMAT": "json"})
    server = next(servers)
    try:
        r = httpx.post(f"{server.url}/fn/mlp", content=orjson.dumps([0.5] * 256),
                       headers={"X-Request-Id": "trace-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-123"
        r = httpx.post(f"{server.url}/fn/mlp", content=b"[1]", headers={"X-Request-Id": "bad-7"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "bad-7"
    finally:
        next(servers, None)
    lines = [orjson.loads(line) for line in server.logs().splitlines() if line.startswith("{")]
    batches = [x for x in lines if x["message"] == "batch formed"]
    assert any("trace-123" in x["request_ids"] and x["model"] == "mlp" and x["rows"] == 1 for x in batches)
    # each request's time since the gateway queued it, and the part of it before the worker read it
    assert all(0 <= t <= q for x in batches for q, t in zip(x["queue_us"], x["transit_us"], strict=True))
    assert any(x.get("request_id") == "bad-7" and x["role"] == "gateway" for x in lines)


def test_status_page_shows_models_rates_batches_and_workers(server: Server) -> None:
    base = server.metrics_url.removesuffix("/metrics")
    page = httpx.get(f"{base}/status")
    assert page.status_code == 200 and "<title>Despina status</title>" in page.text
    for _ in range(8):
        assert httpx.post(f"{server.url}/v2/models/m/infer", content=v2("x", 2, 256)).status_code == 200
    deadline = time.monotonic() + 15
    while True:  # the control plane samples every 2 s (until its first sample, the page lists no model)
        status = httpx.get(f"{base}/status.json").json()
        row = next((m for m in status["models"] if m["name"] == "m"), None)
        if row is not None and row["batch_sizes"].get("2", 0) >= 1 and row["requests_per_s"] > 0 \
                or time.monotonic() > deadline:
            break
        # a request each turn: the rate is over the last 10 s of samples, and on a loaded host the samples
        # that count the first 8 may come later than that
        assert httpx.post(f"{server.url}/v2/models/m/infer", content=v2("x", 2, 256)).status_code == 200
        time.sleep(0.5)
    assert row is not None, status
    assert row["state"] == "READY" and row["workers"] and row["queue"] in (0, 1)  # sampled at rest or mid-request
    assert row["requests_per_s"] > 0 and row["p50_ms"] is not None and row["p99_ms"] >= row["p50_ms"]
    assert row["batch_sizes"]["2"] >= 1     # the 2-row requests, each its own batch
    assert status["workers"] and status["workers"][0]["models"]["m"]["1"] == "READY"
    assert status["workers"][0]["state"] == "serving"  # not told to stop (test_worker_handover: "leaving")
    assert 'class="state leaving"' in page.text  # the page marks a leaving worker so
    broken = {m["name"]: m for m in status["models"]}
    assert set(broken) >= {"m", "q", "fails"}


async def test_the_status_tracker_keeps_no_sample_it_would_not_read(redis_url: str, key_prefix: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sample holds every model version's counters: those older than the longest look back
    (status.RECENT_S) are dropped, however long the control plane runs."""
    clock = [1e9]
    monkeypatch.setattr(status, "time", SimpleNamespace(time=lambda: clock[0]))
    client = aioredis.Redis.from_url(redis_url)
    tracker = status.StatusTracker(client, Keys(key_prefix))
    try:
        for _ in range(int(2 * status.RECENT_S / status.PERIOD_S)):
            await tracker.sample()
            clock[0] += status.PERIOD_S
    finally:
        await client.aclose()
    newest = tracker.samples[-1][0]
    assert tracker._since(status.RECENT_S) == tracker.samples[0]
    assert newest - tracker.samples[0][0] <= status.RECENT_S
    assert len(tracker.samples) <= status.RECENT_S / status.PERIOD_S + 1


async def mlp_runner(tmp_path: Path, redis_url: str, key_prefix: str
                     ) -> tuple[aioredis.Redis, Deferred, ModelRunner]:
    """A loaded runner of W1's MLP as model "m" (batches of up to 8, 1 ms queue delay), with the worker's
    deferred counters, on the test's Redis."""
    folder = tmp_path / "m"
    build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n'
                                         'dynamic_batching { max_queue_delay_microseconds: 1000 }\n')
    client = aioredis.Redis.from_url(redis_url)
    deferred = Deferred(client)
    runner = ModelRunner(client, Keys(key_prefix), ModelSpec.from_config(load_model(folder).config), 1, folder,
                         "w", deferred=deferred)
    await runner.load()
    return client, deferred, runner


async def test_counters_go_with_a_lone_reply_and_a_bursts_within_defer_s(tmp_path: Path, redis_url: str,
                                                                          key_prefix: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's statistics for a request that came alone go out with its reply (the client may read
    them next); while a gateway still has requests out, the batch's counters wait to go out with a
    later batch's, at most DEFER_S, and its replies do not wait for them."""
    # DEFER_S made long enough that a busy CI host's stall between the reply and the look at the
    # counters (20 ms is DEFER_S itself) cannot send them meanwhile
    monkeypatch.setattr(counters, "DEFER_S", 0.25)
    client, deferred, runner = await mlp_runner(tmp_path, redis_url, key_prefix)
    keys = Keys(key_prefix)
    batching = asyncio.create_task(runner.batcher.run())
    replies, stats_key = f"{key_prefix}:replies", keys.stats("m", 1)
    row = np.ones((1, 256), np.float32).tobytes()

    async def send(ids: list[str], in_flight: int) -> None:
        reqs = [InferRequest(i, replies, time.time() + 60, (Tensor("x", "FP32", (1, 256), row),),
                             enqueued=time.time()) for i in ids]
        entry = {FIELD: records.encode(reqs), IN_FLIGHT: str(in_flight).encode()}
        await runner._accept([("stream", f"{ids[0]}-0".encode(), entry)])
        while runner._in_flight or runner._background:  # run, replied
            await asyncio.sleep(0.0005)

    async def answered() -> int:
        return sum(len(records.decode_replies(f[FIELD]))
                   for _, f in await client.xrange(replies))

    async def count() -> int:
        return int(await client.hget(stats_key, "inference_count") or 0)

    try:
        await send(["a"], in_flight=1)   # alone: nothing else out
        assert await answered() == 1 and await count() == 1
        await send(["b", "c"], in_flight=4)   # the gateway has two more out: more batches follow
        assert await answered() == 3 and await count() == 1
        started = time.monotonic()
        while await count() != 3:
            assert time.monotonic() - started < 10 * counters.DEFER_S, "the deferred counters never went out"
            await asyncio.sleep(0.002)
        assert int(await client.hget(stats_key, "success_count")) == 3
    finally:
        await runner.stop()
        await batching
        await deferred.close()
        await client.aclose()


async def test_requests_made_in_a_worker_count_as_enqueued(tmp_path: Path, redis_url: str, key_prefix: str
                                                            ) -> None:
    """An ensemble's steps and a Python model's BLS calls reach their model through ModelRunner.submit, not
    through a gateway, which counts what it enqueues. They are counted as enqueued there: the pending
    gauge is enqueued minus answered, and each of them would otherwise take one off it for good (a
    colocated serve that had answered one ensemble request showed 19 of 20 requests waiting)."""
    client, deferred, runner = await mlp_runner(tmp_path, redis_url, key_prefix)
    batching = asyncio.create_task(runner.batcher.run())
    stats_key = Keys(key_prefix).stats("m", 1)
    row = np.ones((1, 256), np.float32).tobytes()
    answers: list[InferReply] = []
    try:
        for _ in range(3):
            runner.submit([Tensor("x", "FP32", (1, 256), row)], (), time.time() + 60, answers.append)
        deadline = time.monotonic() + 10
        while len(answers) < 3 or int(await client.hget(stats_key, "success_count") or 0) < 3:
            assert time.monotonic() < deadline, (answers, await client.hgetall(stats_key))
            await asyncio.sleep(0.005)
        assert [a.error for a in answers] == [None] * 3
        assert int(await client.hget(stats_key, "enqueued") or 0) == 3  # pending: 3 - 3
    finally:
        await runner.stop()
        await batching
        await deferred.close()
        await client.aclose()


def test_a_batchs_counters_field_by_field() -> None:
    """One batch of three requests: two answered (in latency buckets 1 and 4, queue buckets 1 and 3 of
    100/250/500/1000/2500 µs), one failed by its backend; its execution took 1 / 20 / 3 µs of input,
    infer and output, and each answer's latency counts the 3 µs of output after its compute_us. Every
    field as the statistics API and the metrics read it."""
    replies = [InferReply("a", (), None, 120, 40), InferReply("b", (), (Code.BACKEND, "boom"), 50, 10),
               InferReply("c", (), None, 600, 500)]
    assert tally(replies, 3, 2.5, (1000, 20000, 3000)) == {
        "inference_count": 3, "execution_count": 1,
        "batch:3": 1, "batch_ns:3": 20000, "batch_in_ns:3": 1000, "batch_out_ns:3": 3000,
        "compute_input_count": 2, "compute_infer_count": 2, "compute_output_count": 2,
        "compute_input_ns": 2000, "compute_infer_ns": 40000, "compute_output_ns": 6000,
        "success_count": 2, "queue_count": 2, "success_ns": 1_266_000, "queue_ns": 720_000,
        "lat:1": 1, "lat:4": 1, "qlat:1": 1, "qlat:3": 1,
        "fail_count": 1, "fail_ns": 60_000, "fail:BACKEND": 1, "last_inference": 2500}
    assert tally(replies[:1], 7, 2.5) == {  # no input or output time: no field for it
        "inference_count": 7, "execution_count": 1, "batch:7": 1, "batch_ns:7": 0,
        "compute_input_count": 1, "compute_infer_count": 1, "compute_output_count": 1,
        "compute_input_ns": 0, "compute_infer_ns": 0, "compute_output_ns": 0,
        "success_count": 1, "queue_count": 1, "success_ns": 160_000, "queue_ns": 120_000,
        "lat:1": 1, "qlat:1": 1, "last_inference": 2500}


@pytest.mark.parametrize("us", [0, 99, 100, 2_600, 12_000_000])
def test_an_ensemble_requests_counters_are_a_requests_as_a_model_counts_it(us: int) -> None:
    """ensemble_counts adds its few fields itself (it runs per request): the same as `tally` of one reply
    queued for its own wait (none, or 40 µs of its latency), with one execution of its rows, its steps'
    compute as its infer time (7 µs, or its whole latency when that is less), when it succeeded; added into
    what is given."""
    compute_us = min(us, 7)
    ok = tally([InferReply("", (), None, 0, us)], 3, 0.0, (0, compute_us * 1000, 0))
    del ok["last_inference"]  # the caller's, which knows the time

    def nonzero(counts: dict[str, int]) -> dict[str, int]:
        return {k: v for k, v in counts.items() if v or k.endswith("_count")}

    assert nonzero(ensemble_counts(None, us, 3, compute_ns=(0, compute_us * 1000, 0))) == nonzero(ok)
    if us >= 40:
        queued = tally([InferReply("", (), None, 40, us - 40)], 3, 0.0, (0, 7000, 0))
        del queued["last_inference"]
        assert nonzero(ensemble_counts(None, us, 3, compute_ns=(0, 7000, 0), queue_us=40)) == nonzero(queued)
    # its steps' compute input, infer and output, each summed (as Triton's), as a batch's are counted
    split = (1500, 7000, 2500)
    def compute(counts: dict[str, int]) -> dict[str, int]:
        return {k: v for k, v in counts.items() if k.startswith(("compute_", "batch"))}

    assert compute(ensemble_counts(None, us, 3, compute_ns=split)) == compute(tally(
        [InferReply("", (), None, 0, us)], 3, 0.0, split))
    failed = DespinaError("late", Code.DEADLINE_EXCEEDED)
    as_a_model = tally([InferReply("", (), (failed.code, "late"), 0, us)], 0, 0.0)
    as_a_model["fail:OTHER"] = as_a_model.pop("fail:REJECTED")  # an ensemble's failure is OTHER
    assert ensemble_counts(failed, us, 0) == as_a_model
    into = ensemble_counts(None, us, 3)
    assert ensemble_counts(failed, us, 0, ensemble_counts(None, us, 3, into)) is into
    assert into["success_count"] == 2 and into["inference_count"] == 6 and into["fail_count"] == 1


def test_an_ensembles_successes_counted_together_are_each_counted_alone() -> None:
    """A worker that runs an ensemble counts the requests it answers in a tick together
    (ensemble_successes): the same counters as ensemble_counts of each, added into what is given, across
    latency buckets, queue times (none included) and rows (none counting as one)."""
    successes = [(us, queued, rows, 10 * us, 20 * us + 1, 3 * rows)
                 for us in (0, 99, 100, 2_600, 12_000_000) for queued in (0, 40, 300) for rows in (0, 1, 3)]
    alone = {"fail_count": 1, "success_count": 2}
    for us, queued, rows, *compute in successes:
        ensemble_counts(None, us, rows, alone, compute, queued)
    together = ensemble_successes(successes, {"fail_count": 1, "success_count": 2})
    assert together == alone and together["success_count"] == len(successes) + 2


@pytest.mark.parametrize(("code", "reason"), [
    (Code.BACKEND, "OTHER"), (Code.DEADLINE_EXCEEDED, "OTHER"), (Code.RESOURCE_EXHAUSTED, "OTHER"),
    (Code.INTERNAL, "OTHER"), (Code.CANCELLED, "CANCELED")])
def test_an_ensembles_failure_is_other_whatever_failed_its_step(code: Code, reason: str) -> None:
    """Triton 2.51 counts an ensemble's failure with reason OTHER, whatever failed its step (seen: a step's
    backend failure, a step's request timed out in its queue, both REJECTED / BACKEND at the step); a
    cancelled one stays CANCELED."""
    counts = ensemble_counts(DespinaError("no", code), 10, 0)
    assert {k: v for k, v in counts.items() if k.startswith("fail:")} == {f"fail:{reason}": 1}


def test_gpu_metrics_cover_every_workers_gpus_each_family_together(serve, tmp_path: Path) -> None:
    """Workers publish NVML's readings of their machine's GPUs with each heartbeat; the control plane's
    /metrics shows them beside its own machine's, one family's samples together however many GPUs.
    NVML is tests/fake_nvml (no GPU here): two GPUs per process, named after its role."""
    repo = tmp_path / "repo"
    build_mlp(repo / "m" / "1" / "model.onnx")
    fake = Path(__file__).parent / "fake_nvml"
    server = serve(repo, wait_models=("m",),
                   env={"PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    text = wait_until(lambda: next((t for t in [httpx.get(server.metrics_url).text]
                                    if 'gpu_uuid="GPU-worker-1"' in t), None), 10, what="the worker's GPUs")
    metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    for role in ("worker", "control"):  # the worker's machine, and the control plane's own
        assert metrics[f'nv_gpu_utilization{{gpu_uuid="GPU-{role}-0"}}'] == 0.25
        assert metrics[f'nv_gpu_utilization{{gpu_uuid="GPU-{role}-1"}}'] == 0.5
        assert metrics[f'nv_gpu_memory_used_bytes{{gpu_uuid="GPU-{role}-1"}}'] == 2 * 2**30
        assert metrics[f'nv_gpu_power_usage{{gpu_uuid="GPU-{role}-0"}}'] == 150.0
        assert metrics[f'nv_energy_consumption{{gpu_uuid="GPU-{role}-1"}}'] == 2000.0
        # a reading the GPU does not support is left out, not made up
        assert f'nv_gpu_power_usage{{gpu_uuid="GPU-{role}-1"}}' not in metrics
    # the text format: each family's samples in one run, after its one TYPE line
    families = [line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
                if line and not line.startswith("#")]
    runs = [name for i, name in enumerate(families) if i == 0 or families[i - 1] != name]
    assert len(runs) == len(set(runs)), [n for n in runs if runs.count(n) > 1]


def test_gpu_readings_count_a_gpu_once_whoever_reported_it() -> None:
    reading = {"uuid": "GPU-a", "utilization": 0.5}
    samples = gpu_samples([reading, dict(reading), {"uuid": "GPU-b", "memory_used": 3.0}, {"no": "uuid"}])
    assert [(name, labels["gpu_uuid"], value) for name, _, _, labels, value in samples] == \
        [("nv_gpu_utilization", "GPU-a", 0.5), ("nv_gpu_memory_used_bytes", "GPU-b", 3.0)]


SLOW_MODEL = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.05)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
'''


def test_an_unload_answers_what_was_read_once_and_the_counts_agree_with_the_clients(
        serve, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """What a worker had read when its model was unloaded runs, and its callers get those answers, not
    an error for a request that then ran anyway: the metrics count what the clients got."""
    repo = tmp_path / "repo"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    (repo / "slow" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 1\ninput [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]\n'
        'dynamic_batching { default_queue_policy { max_queue_size: 100 } }\n')
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "slow", wait_models=("slow",))
    body = orjson.dumps({"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "FP32", "data": [1]}]})

    async def read_or_answered(calls: list[asyncio.Task[httpx.Response]], stream: str) -> None:
        """Until every call is answered (50 ms each) or read by the worker (pending in its group)."""
        async with aioredis.Redis.from_url(redis_url) as redis:
            for _ in range(400):
                pending = (await redis.xpending(stream, GROUP))["pending"]
                if sum(c.done() for c in calls) + pending >= len(calls):
                    return
                await asyncio.sleep(0.05)
        raise AssertionError("the worker did not read the requests in 20 s")

    async def traffic() -> list[int]:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
            calls = [asyncio.create_task(client.post(f"{server.url}/v2/models/slow/infer", content=body))
                     for _ in range(40)]
            await read_or_answered(calls, Keys(key_prefix).request_stream("slow", 1))
            assert (await client.post(f"{server.url}/v2/repository/models/slow/unload")).status_code == 200
            return [r.status_code for r in await asyncio.gather(*calls)]

    statuses = asyncio.run(traffic())
    assert set(statuses) <= {200, 503}
    labels = '{model="slow",version="1"}'
    answered = {f"nv_inference_request_success{labels}": statuses.count(200),
                'nv_inference_request_failure{model="slow",version="1",reason="OTHER"}': statuses.count(503),
                f"nv_inference_pending_request_count{labels}": 0}
    metrics = settled_scrape(server, answered)
    assert {k: metrics[k] for k in answered} == answered
    assert statuses.count(200) == 40  # every request was read (the worker reads ahead 64) and ran

    async def queued() -> bytes | None:
        async with aioredis.Redis.from_url(redis_url) as redis:
            return await redis.get(Keys(key_prefix).queued("slow", 1))

    assert asyncio.run(queued()) in (None, b"0")  # a reload's max_queue_size holds none of them


def test_statistics_answer_loaded_versions_and_400_for_others_as_triton(serve, tmp_path: Path) -> None:
    """Triton's statistics cover the READY versions: an unknown model or version, or one not loaded,
    answers 400 ("requested model ... is not available"), and the list of all leaves it out."""
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        build_mlp(repo / name / "1" / "model.onnx")
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "a", "--load-model", "b",
                   wait_models=("a", "b"))

    def listed() -> list[tuple[str, str]]:
        stats = httpx.get(f"{server.url}/v2/models/stats").json()["model_stats"]
        return sorted((s["name"], s["version"]) for s in stats)

    def answer(path: str) -> tuple[int, str]:
        r = httpx.get(f"{server.url}/v2/models/{path}/stats")
        return r.status_code, r.json().get("error", "")

    assert listed() == [("a", "1"), ("b", "1")]
    assert answer("a/versions/1")[0] == 200
    assert answer("nope") == (400, "requested model 'nope' is not available")
    assert answer("c") == (400, "requested model 'c' is not available")   # in the repository, not loaded
    assert answer("a/versions/2") == (400, "requested model version is not available for model 'a'")
    assert httpx.post(f"{server.url}/v2/repository/models/b/unload").status_code == 200
    assert listed() == [("a", "1")]
    assert answer("b") == (400, "requested model 'b' is not available")


def test_model_load_duration_is_tritons_gauge(server: Server) -> None:
    """nv_model_load_duration_secs: Triton's gauge of the time a model version took to load."""
    text = httpx.get(server.metrics_url).text
    assert re.search(r"^# TYPE nv_model_load_duration_secs gauge$", text, re.M)
    for model in ("m", "fails", "q"):
        assert 0 < scrape(server)[f'nv_model_load_duration_secs{{model="{model}",version="1"}}'] < 60


CUSTOM_METRICS_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        model = args["model_name"]
        self.requests = pb_utils.MetricFamily("model_requests_total", "Requests the model ran",
                                              pb_utils.MetricFamily.COUNTER
                                              ).Metric(labels={"model": model, "note": 'a "quoted"\\\\ value'})
        self.last = pb_utils.MetricFamily("model_last_input", "The input\\nit saw last", pb_utils.MetricFamily.GAUGE
                                          ).Metric(labels={"model": model})
        self.inputs = pb_utils.MetricFamily("model_input", "Inputs seen", pb_utils.MetricFamily.HISTOGRAM
                                            ).Metric(labels={"model": model}, buckets=[1, 2.5, 10])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            self.requests.increment(1)
            self.last.set(float(x[0]))
            self.inputs.observe(float(x[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
'''


def test_a_python_models_custom_metrics_are_on_metrics_until_it_unloads(serve, tmp_path: Path) -> None:
    """Triton's custom metrics (pb_utils.MetricFamily), made in initialize and updated in execute, are on
    the control plane's /metrics as Triton shows them: HELP, TYPE, the labels as given (escaped), a
    histogram's buckets; the counter and histogram summed over the model's two processes, the gauge the
    value set last (they stayed in the model's process: /metrics never showed them); gone after the
    model's unload."""
    repo = tmp_path / "repo"
    (repo / "cm" / "1").mkdir(parents=True)
    (repo / "cm" / "1" / "model.py").write_text(CUSTOM_METRICS_MODEL)
    (repo / "cm" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'instance_group [ { count: 2, kind: KIND_CPU } ]\n')
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "cm", wait_models=("cm",))
    for value in range(1, 7):  # one at a time: the gauge's last value is the last request's
        r = httpx.post(f"{server.url}/v2/models/cm/infer", json={"inputs": [
            {"name": "X", "shape": [1], "datatype": "FP32", "data": [value]}]})
        assert r.status_code == 200, r.text
    counter = 'model_requests_total{model="cm",note="a \\"quoted\\"\\\\ value"}'
    histogram = {'model_input_bucket{model="cm",le="1"}': 1, 'model_input_bucket{model="cm",le="2.5"}': 2,
                 'model_input_bucket{model="cm",le="10"}': 6, 'model_input_bucket{model="cm",le="+Inf"}': 6,
                 'model_input_sum{model="cm"}': 21, 'model_input_count{model="cm"}': 6}
    expected = {counter: 6, 'model_last_input{model="cm"}': 6, **histogram}
    wait_until(lambda: all(scrape(server).get(k) == v for k, v in expected.items()), 60,
               what=f"the custom metrics on /metrics:\n{httpx.get(server.metrics_url).text}")
    text = httpx.get(server.metrics_url).text
    for help_and_type in ("# HELP model_requests_total Requests the model ran\n# TYPE model_requests_total counter",
                          "# HELP model_last_input The input\\nit saw last\n# TYPE model_last_input gauge",
                          "# HELP model_input Inputs seen\n# TYPE model_input histogram"):
        assert help_and_type in text

    assert httpx.post(f"{server.url}/v2/repository/models/cm/unload", timeout=60).status_code == 200
    wait_until(lambda: not any(k.startswith(("model_requests", "model_last", "model_input"))
                               for k in scrape(server)), 60,
               what="the custom metrics to leave /metrics after the unload")
    assert "# HELP model_input " not in httpx.get(server.metrics_url).text


def test_custom_metrics_merge_over_processes_as_one_series_each() -> None:
    """Two workers' reports of the same families: counters and histograms summed, a gauge the value set
    last; a family reported with another type, a histogram with other buckets, and a family named as one
    of Despina's are left out; NaN and infinities are written as Prometheus spells them."""
    def gauge(value: float, at: float) -> dict[str, Any]:
        return {"name": "temperature", "help": "h", "type": "gauge",
                "metrics": [{"labels": {"room": "a"}, "value": value, "at": at}]}

    counter = {"name": "served", "help": "Served", "type": "counter",
               "metrics": [{"labels": {"k": "v"}, "value": 3.0, "at": 0.0}]}
    histogram = {"name": "size", "help": "s", "type": "histogram",
                 "metrics": [{"labels": {}, "buckets": [1.0, 2.0], "counts": [1, 0, 2], "sum": 9.5}]}
    odd = {"name": "size", "help": "s", "type": "histogram",
           "metrics": [{"labels": {}, "buckets": [5.0], "counts": [7, 7], "sum": 1.0}]}
    other_kind = {"name": "served", "help": "Served", "type": "gauge",
                  "metrics": [{"labels": {"k": "v"}, "value": 100.0, "at": 9e9}]}
    despinas = {"name": "despina_workers_alive", "help": "mine", "type": "gauge",
                "metrics": [{"labels": {}, "value": 42.0, "at": 1.0}]}
    infinite = {"name": "odd_values", "help": "o", "type": "gauge",
                "metrics": [{"labels": {"v": "nan"}, "value": math.nan, "at": 1.0},
                            {"labels": {"v": "inf"}, "value": -math.inf, "at": 1.0}]}
    first = {"m": {"1": [counter, gauge(20.0, 200.0), histogram, despinas, infinite]}}
    second = {"m": {"1": [counter, gauge(25.0, 100.0), histogram, odd]}, "n": {"2": [other_kind]}}
    text = render({"models": [], "workers_alive": 1, "custom": [first, second]}).decode()
    lines = text.splitlines()
    assert 'served{k="v"} 6' in lines and "# TYPE served counter" in lines
    assert 'temperature{room="a"} 20' in lines   # set later than the 25 of the other worker
    assert ['size_bucket{le="1"} 2', 'size_bucket{le="2"} 2', 'size_bucket{le="+Inf"} 6', "size_sum 19",
            "size_count 6"] == [line for line in lines if line.startswith("size_")]
    assert "despina_workers_alive 1" in lines and "despina_workers_alive 42" not in lines
    assert text.count("# TYPE despina_workers_alive") == 1
    assert 'odd_values{v="nan"} NaN' in lines and 'odd_values{v="inf"} -Inf' in lines


HELD_MODEL = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        deadline = time.monotonic() + 30
        while not os.path.exists(RELEASE) and time.monotonic() < deadline:  # held until the test lets go
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
'''


def test_pending_count_leaves_out_the_requests_being_executed(serve, tmp_path: Path) -> None:
    """Triton's nv_inference_pending_request_count is the requests awaiting execution: with one request
    executing and two queued behind it (one instance, one request a batch), Triton 2.51 shows 2 (Despina
    showed 3: every request enqueued and not yet answered); once all are answered, 0."""
    repo, release = tmp_path / "repo", tmp_path / "release"
    (repo / "held" / "1").mkdir(parents=True)
    (repo / "held" / "1" / "model.py").write_text(f"RELEASE = {str(release)!r}\n" + HELD_MODEL)
    (repo / "held" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 1\ndynamic_batching { }\n'
        'input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]\n'
        'instance_group [{ count: 1, kind: KIND_CPU }]\n')
    server = serve(repo, wait_models=("held",))
    pending = 'nv_inference_pending_request_count{model="held",version="1"}'

    async def traffic() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            posts = [asyncio.create_task(client.post(f"{server.url}/v2/models/held/infer", content=v2("X", 1, 1)))
                     for _ in range(3)]
            seen = await asyncio.to_thread(settled_scrape_within, server, {pending: 2}, 10)
            release.touch()
            answers = [r.status_code for r in await asyncio.gather(*posts)]
            assert seen.get(pending) == 2, seen.get(pending)
            return answers

    assert asyncio.run(traffic()) == [200, 200, 200]
    assert settled_scrape_within(server, {pending: 0}, 10)[pending] == 0


def settled_scrape_within(server: Server, expected: dict[str, float], seconds: float) -> dict[str, float]:
    """The metrics once they show `expected`, or as they are after `seconds` (a heartbeat may be a beat
    late)."""
    deadline = time.monotonic() + seconds
    while True:
        metrics = scrape(server)
        if all(metrics.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


RAISES_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        if x[0] < 0:
            raise pb_utils.TritonModelException("negative")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]) for _ in requests]
'''


def raised_once(serve: Any, tmp_path: Path) -> Server:
    """A server of RAISES_MODEL, once answered and once raised."""
    repo = tmp_path / "repo"
    (repo / "raises" / "1").mkdir(parents=True)
    (repo / "raises" / "1" / "model.py").write_text(RAISES_MODEL)
    (repo / "raises" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]\n')
    server: Server = serve(repo, wait_models=("raises",))
    for value, status_code in ((1.0, 200), (-1.0, 500)):
        body = orjson.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [value]}]})
        assert httpx.post(f"{server.url}/v2/models/raises/infer", content=body).status_code == status_code
    return server


def test_a_python_execution_that_raised_counts_as_an_execution_of_no_inference(serve, tmp_path: Path) -> None:
    """Triton 2.51's Python backend reports an execution whose every request failed (execute raised):
    one request answered and one raised leave exec_count 2, inference_count 1, one BACKEND failure.
    (Its onnxruntime backend reports no such execution: test_an_execution_whose_every_request_failed_...)"""
    server = raised_once(serve, tmp_path)
    labels = '{model="raises",version="1"}'
    failed = 'nv_inference_request_failure{model="raises",version="1",reason="BACKEND"}'
    metrics = settled_scrape(server, {failed: 1, f"nv_inference_exec_count{labels}": 2})
    assert (metrics[f"nv_inference_request_success{labels}"], metrics[failed]) == (1, 1)
    assert (metrics[f"nv_inference_exec_count{labels}"], metrics[f"nv_inference_count{labels}"]) == (2, 1)


DECOUPLED_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            for k in (1, 2):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * k)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_a_decoupled_requests_final_flag_alone_still_counts_its_time(serve, tmp_path: Path) -> None:
    """A decoupled model that sends its responses and then the final flag alone (no response in it):
    Triton 2.51 counts each request's success and queue time (success.ns 56 ms, queue.ns 24 ms for two
    such requests); Despina counted them but with 0 ns, and 0 in nv_inference_request_duration_us and
    nv_inference_queue_duration_us."""
    repo = tmp_path / "repo"
    (repo / "dec" / "1").mkdir(parents=True)
    (repo / "dec" / "1" / "model.py").write_text(DECOUPLED_MODEL)
    (repo / "dec" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
        'input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]\n')
    server = serve(repo, wait_models=("dec",))
    for _ in range(2):
        r = httpx.post(f"{server.url}/v2/models/dec/generate_stream", json={"X": [1.0]})
        assert (r.status_code, r.text.count("data:")) == (200, 2), r.text
    stats = settled_stats(server.url, "dec")
    inference = stats["inference_stats"]
    assert (inference["success"]["count"], inference["queue"]["count"], inference["fail"]["count"]) == (2, 2, 0)
    assert inference["success"]["ns"] > inference["queue"]["ns"] > 0, inference
    labels = '{model="dec",version="1"}'
    metrics = scrape(server)
    assert metrics[f"nv_inference_request_duration_us{labels}"] == inference["success"]["ns"] // 1000
    assert metrics[f"nv_inference_queue_duration_us{labels}"] == inference["queue"]["ns"] // 1000


def test_a_python_execution_that_raised_counts_in_batch_stats(serve, tmp_path: Path) -> None:
    """Triton 2.51's Python backend reports an execution whose every request failed in batch_stats too:
    one execution answered and one that raised leave batch_stats[batch_size 1] with 2 executions (and the
    failed one's compute time), inference_stats' compute with 1. Despina counted 1 in batch_stats."""
    server = raised_once(serve, tmp_path)
    stats = settled_stats(server.url, "raises")
    assert (stats["execution_count"], stats["inference_count"]) == (2, 1)
    inference = stats["inference_stats"]
    assert [b["batch_size"] for b in stats["batch_stats"]] == [1]
    batch = stats["batch_stats"][0]
    assert (batch["compute_input"]["count"], batch["compute_infer"]["count"], batch["compute_output"]["count"]) \
        == (2, 2, 2)
    assert inference["compute_infer"]["count"] == 1
    assert batch["compute_infer"]["ns"] > inference["compute_infer"]["ns"] > 0


@pytest.mark.parametrize("host_ensembles", ["true", "false"])
def test_an_ensemble_failed_by_its_steps_backend_counts_other(serve, tmp_path: Path, host_ensembles: str) -> None:
    """Triton 2.51: an ensemble whose Python step raised counts the ensemble's failure with reason OTHER
    (its step's with BACKEND): the ensemble has no backend of its own. Despina counted BACKEND at both.
    (Triton counts that one failed ensemble request twice, fail.count 2: a Triton bug, not followed.)
    Both ways: the ensemble run by a worker, and by the gateway."""
    repo = tmp_path / "repo"
    (repo / "raises" / "1").mkdir(parents=True)
    (repo / "raises" / "1" / "model.py").write_text(RAISES_MODEL)
    io = ('input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]\n'
          'output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]\n')
    (repo / "raises" / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n' + io)
    (repo / "chain" / "1").mkdir(parents=True)
    (repo / "chain" / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 0\n' + io + 'ensemble_scheduling { step [{ model_name: "raises" '
        'model_version: -1 input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } }] }\n')
    server = serve(repo, wait_models=("raises", "chain"), env={"DESPINA_HOST_ENSEMBLES": host_ensembles})
    for value, status_code in ((1.0, 200), (-1.0, 500)):
        body = orjson.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [value]}]})
        assert httpx.post(f"{server.url}/v2/models/chain/infer", content=body).status_code == status_code
    failed = 'nv_inference_request_failure{{model="{}",version="1",reason="{}"}}'
    metrics = settled_scrape(server, {failed.format("chain", "OTHER"): 1, failed.format("raises", "BACKEND"): 1})
    assert (metrics[failed.format("chain", "OTHER")], metrics[failed.format("chain", "BACKEND")]) == (1, 0)
    assert (metrics[failed.format("raises", "BACKEND")], metrics[failed.format("raises", "OTHER")]) == (1, 0)
    stats = settled_stats(server.url, "chain")["inference_stats"]
    assert (stats["success"]["count"], stats["fail"]["count"]) == (1, 1)


DECOUPLED_RAISES_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
            if x[0] < 0:
                raise pb_utils.TritonModelException("negative")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_a_decoupled_execution_that_raised_counts_no_inference(serve, tmp_path: Path) -> None:
    """Triton 2.51: a decoupled Python model's execution that raised (after a first response) counts as an
    execution (execution_count, batch_stats) but its request as no inference and no compute, as a
    non-decoupled one's: one request answered and one raised leave execution_count 2, batch_stats[1] 2,
    inference_count 1, compute counts 1, success 1, fail 1. Despina counted inference_count 2, compute 2."""
    repo = tmp_path / "repo"
    (repo / "decr" / "1").mkdir(parents=True)
    (repo / "decr" / "1" / "model.py").write_text(DECOUPLED_RAISES_MODEL)
    (repo / "decr" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
        'input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]\n')
    server = serve(repo, wait_models=("decr",))
    for value in (1.0, -1.0):
        r = httpx.post(f"{server.url}/v2/models/decr/generate_stream", json={"X": [value]})
        assert r.status_code == 200 and r.text.count("data:") == (1 if value > 0 else 2), r.text
    stats = settled_stats(server.url, "decr")
    inference = stats["inference_stats"]
    assert (inference["success"]["count"], inference["fail"]["count"]) == (1, 1), inference
    assert (stats["execution_count"], stats["inference_count"]) == (2, 1)
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(1, 2)]
    assert [inference[k]["count"] for k in ("compute_input", "compute_infer", "compute_output")] == [1, 1, 1]
