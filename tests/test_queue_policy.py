"""Triton's queue policy across the streams: max_queue_size, priorities, queue timeouts."""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis

from despina.contract.errors import ConfigError
from despina.contract.keys import Keys
from despina.contract.modelconfig import normalize, parse_text, validate
from despina.examples import build_mlp

from .conftest import FULL_QUEUE_DELAY, Server, settled_stats, stop_server

HEAVY = (256, 1024, 1024, 1024, 10)  # a few ms per batch on one core


def repository(root: Path, name: str, dynamic_batching: str, max_batch_size: int = 4,
               layers: tuple[int, ...] = HEAVY) -> Path:
    build_mlp(root / name / "1" / "model.onnx", layers=layers, seed=1)
    (root / name / "config.pbtxt").write_text(
        f'backend: "onnxruntime"\nmax_batch_size: {max_batch_size}\n'
        f'input [{{ name: "x", data_type: TYPE_FP32, dims: [{layers[0]}] }}]\n'
        f'output [{{ name: "y", data_type: TYPE_FP32, dims: [{layers[-1]}] }}]\n'
        f"dynamic_batching {{ {dynamic_batching} }}\n")
    return root


# ten milliseconds a batch whatever the host: an ONNX model's time varies tenfold from one host to another
SLEEPER = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy()[:, :10].copy())]) for r in requests]
"""


def python_model(root: Path, name: str, source: str, config: str) -> Path:
    """A Python model `name` in the repository `root`: its model.py, and its config after the backend line."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    (root / name / "config.pbtxt").write_text('backend: "python"\n' + config)
    return root


def body(priority: int = 0, timeout_us: int = 0) -> bytes:
    params = {k: v for k, v in (("priority", priority), ("timeout", timeout_us)) if v}
    return orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                     "data": np.full(256, 0.1).tolist()}], "parameters": params})


async def post(client: httpx.AsyncClient, url: str, content: bytes) -> tuple[int, float, httpx.Response]:
    start = time.monotonic()
    r = await client.post(url, content=content)
    return r.status_code, time.monotonic() - start, r


def test_full_queue_refuses_at_once_and_loses_nothing_accepted(serve: Callable[..., Server],
                                                               tmp_path: Path) -> None:
    repo = repository(tmp_path, "q", "max_queue_delay_microseconds: 1500000 "
                                     "default_queue_policy { max_queue_size: 4 }", max_batch_size=64)
    server = serve(repo, wait_models=("q",), env=FULL_QUEUE_DELAY)
    url = f"{server.url}/v2/models/q/infer"

    async def scenario() -> list[tuple[int, float, httpx.Response]]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(post(client, url, body()) for _ in range(12)))

    results = asyncio.run(scenario())
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(accepted) + len(refused) == 12
    assert len(accepted) == 4
    for _, seconds, response in refused:
        assert seconds < 1.0                               # at once, not after the 1.5 s delay
        assert response.headers["retry-after"] == "1"
        assert "Exceeds maximum queue size" in response.json()["error"]  # Triton's words
    for _, seconds, response in accepted:
        assert seconds >= 1.0 and response.json()["outputs"][0]["shape"] == [1, 10]


# SLEEPER, whose first batch waits while the file HOLD is there
HELD_SLEEPER = """
import os
import time
import triton_python_backend_utils as pb_utils

HOLD = {hold!r}


class TritonPythonModel:
    def execute(self, requests):
        while os.path.exists(HOLD):
            time.sleep(0.01)
        time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy()[:, :10].copy())]) for r in requests]
"""


def test_priority_one_waits_less_under_saturation(serve: Callable[..., Server], tmp_path: Path,
                                                   redis_url: str, key_prefix: str) -> None:
    # one request per batch, 10 ms each. The model's first batch is held until every request is queued:
    # the priority-1 requests were sent once the backlog was 60 deep, and on a loaded machine the test took
    # long enough to send them that the default level had mostly drained meanwhile (seen once)
    hold = tmp_path / "hold"
    hold.touch()
    repo = python_model(tmp_path / "repo", "p", HELD_SLEEPER.format(hold=str(hold)), 'max_batch_size: 1\n'
                        'input [{ name: "x", data_type: TYPE_FP32, dims: [256] }]\n'
                        'output [{ name: "y", data_type: TYPE_FP32, dims: [10] }]\n'
                        "dynamic_batching { priority_levels: 2 default_priority_level: 2 }\n")
    server = serve(repo, wait_models=("p",), env=FULL_QUEUE_DELAY)
    url = f"{server.url}/v2/models/p/infer"
    stats = Keys(key_prefix).stats("p", 1)
    store = aioredis.Redis.from_url(redis_url)

    async def queued(n: int) -> None:
        """Until the gateway has queued `n` requests (none is answered while the model is held)."""
        deadline = time.monotonic() + 30
        while int(await store.hget(stats, "enqueued") or 0) < n:
            assert time.monotonic() < deadline, f"{n} requests not queued within 30 s"
            await asyncio.sleep(0.02)

    async def finished(client: httpx.AsyncClient, content: bytes) -> float:
        r = await client.post(url, content=content)
        assert r.status_code == 200, r.text
        return time.monotonic()

    async def scenario() -> tuple[list[float], list[float]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            low = [asyncio.create_task(finished(client, body())) for _ in range(80)]
            await queued(80)
            high = [asyncio.create_task(finished(client, body(priority=1))) for _ in range(10)]
            await queued(90)
            hold.unlink()
            result = list(await asyncio.gather(*low)), list(await asyncio.gather(*high))
        await store.aclose()
        return result

    lows, highs = asyncio.run(scenario())
    # in arrival order the priority-1 requests would finish last; they finish ahead of most of the
    # default backlog that was queued before them (the worker has read up to 64 ahead: each priority-1
    # request it reads after the hold may wait for one default-level batch that started meanwhile)
    assert max(highs) < float(np.percentile(lows, 75))


def test_with_no_delay_a_backlog_goes_at_its_preferred_sizes(serve: Callable[..., Server], tmp_path: Path,
                                                             redis_url: str, key_prefix: str) -> None:
    # Triton's GetDynamicBatch: a delay of 0 never runs out, so the three requests queued behind a busy
    # instance go as a preferred batch of 2, then the one left over (not as one batch of 3)
    hold = tmp_path / "hold"
    hold.touch()
    repo = python_model(tmp_path / "repo", "p", HELD_SLEEPER.format(hold=str(hold)), 'max_batch_size: 8\n'
                        'input [{ name: "x", data_type: TYPE_FP32, dims: [256] }]\n'
                        'output [{ name: "y", data_type: TYPE_FP32, dims: [10] }]\n'
                        "dynamic_batching { preferred_batch_size: [ 2, 4 ] }\n")
    server = serve(repo, wait_models=("p",))
    url = f"{server.url}/v2/models/p/infer"
    stats = Keys(key_prefix).stats("p", 1)
    store = aioredis.Redis.from_url(redis_url)

    async def queued(n: int) -> None:
        deadline = time.monotonic() + 30
        while int(await store.hget(stats, "enqueued") or 0) < n:
            assert time.monotonic() < deadline, f"{n} requests not queued within 30 s"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # and read by the worker, which holds them while its instance is busy

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.create_task(client.post(url, content=body()))
            await queued(1)
            rest = [asyncio.create_task(client.post(url, content=body())) for _ in range(3)]
            await queued(4)
            hold.unlink()
            replies = [await first, *[await r for r in rest]]
        await store.aclose()
        return [r.status_code for r in replies]

    assert asyncio.run(scenario()) == [200] * 4
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in settled_stats(server.url, "p")["batch_stats"]}
    assert sizes == {1: 2, 2: 1}


def test_queue_timeout_rejects_and_a_request_may_shorten_it(serve: Callable[..., Server],
                                                             tmp_path: Path) -> None:
    repo = repository(tmp_path, "t", "max_queue_delay_microseconds: 2000000 default_queue_policy { "
                                     "default_timeout_microseconds: 5000000 allow_timeout_override: true }",
                      max_batch_size=64)
    server = serve(repo, wait_models=("t",), env=FULL_QUEUE_DELAY)
    url = f"{server.url}/v2/models/t/infer"
    start = time.monotonic()
    r = httpx.post(url, content=body(timeout_us=200_000), timeout=30)   # shorter than the 2 s wait
    # Triton answers UNAVAILABLE "Request timeout expired" (dynamic_batch_scheduler.cc): HTTP 503
    assert r.status_code == 503 and "Request timeout expired" in r.json()["error"], r.text
    assert r.headers["retry-after"] == "1"
    assert time.monotonic() - start < 1.5
    r = httpx.post(url, content=body(timeout_us=60_000_000), timeout=30)  # may not lengthen: 5 s stays
    assert r.status_code == 200


def test_bad_schedule_parameters_are_refused(serve: Callable[..., Server], tmp_path: Path) -> None:
    repo = repository(tmp_path, "b", "", layers=(256, 8, 10))
    server = serve(repo, wait_models=("b",))
    for params in ({"priority": -1}, {"priority": "high"}, {"timeout": 1.5}):
        doc = orjson.loads(body())
        doc["parameters"] = params
        r = httpx.post(f"{server.url}/v2/models/b/infer", content=orjson.dumps(doc))
        assert r.status_code == 400 and "non-negative integer" in r.json()["error"]


def test_delay_action_runs_timed_out_requests_later(serve: Callable[..., Server], tmp_path: Path) -> None:
    repo = repository(tmp_path, "d", "max_queue_delay_microseconds: 400000 default_queue_policy { "
                                     "timeout_action: DELAY default_timeout_microseconds: 50000 }",
                      max_batch_size=64)
    server = serve(repo, wait_models=("d",), env=FULL_QUEUE_DELAY)
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v2/models/d/infer", content=body(), timeout=30)
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 10]
    assert time.monotonic() - start >= 0.3      # it timed out at 50 ms, was delayed, and still ran


def test_a_request_nothing_can_join_does_not_wait_out_the_delay(serve: Callable[..., Server],
                                                                tmp_path: Path) -> None:
    """One client, one request at a time: each batch holds every request in flight, so it goes at
    once; with DESPINA_FULL_QUEUE_DELAY (Triton's rule) it waits out the 1.5 s. The bounded model's
    requests go through the gateway's other enqueue (the max_queue_size script)."""
    layers = (256, 8, 10)
    repository(tmp_path, "plain", "max_queue_delay_microseconds: 1500000", layers=layers)
    repo = repository(tmp_path, "bounded", "max_queue_delay_microseconds: 1500000 "
                                           "default_queue_policy { max_queue_size: 4 }", layers=layers)

    def queue_s(server: Server, model: str) -> float:
        """Mean queue time of two requests in turn (the second server shares the first's statistics)."""
        def stats() -> tuple[int, int, int]:
            s = httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"][0]
            queue = s["inference_stats"]["queue"]
            return queue["count"], queue["ns"], s["execution_count"]

        before = stats()
        for _ in range(2):
            r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=body(), timeout=30)
            assert r.status_code == 200, r.text
        count, ns, runs = (b - a for a, b in zip(before, stats()))
        assert count == 2 and runs == 2
        return ns / count / 1e9

    server = serve(repo, wait_models=("plain", "bounded"))
    assert queue_s(server, "plain") < 0.5 and queue_s(server, "bounded") < 0.5
    stop_server(server)  # its worker would take the next requests
    server = serve(repo, wait_models=("plain",), env=FULL_QUEUE_DELAY)
    assert queue_s(server, "plain") >= 1.5


def test_a_lone_ensemble_request_does_not_wait_out_its_steps_delays(serve: Callable[..., Server],
                                                                     tmp_path: Path) -> None:
    """The worker that runs an ensemble knows when its one run is all its gateway has out: the steps'
    batches then go at once, though each step's model has a 1.5 s delay."""
    repository(tmp_path, "head", "max_queue_delay_microseconds: 1500000", layers=(256, 8, 10))
    repo = repository(tmp_path, "tail", "max_queue_delay_microseconds: 1500000", layers=(10, 8, 10))
    (repo / "pair" / "1").mkdir(parents=True)
    (repo / "pair" / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 4\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 256 ] } ]\n'
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 10 ] } ]\n'
        'ensemble_scheduling { step [\n'
        '  { model_name: "head" model_version: -1 input_map { key: "x" value: "x" } '
        'output_map { key: "y" value: "mid" } },\n'
        '  { model_name: "tail" model_version: -1 input_map { key: "x" value: "mid" } '
        'output_map { key: "y" value: "y" } } ] }\n')
    server = serve(repo, wait_models=("pair",))
    for _ in range(2):
        r = httpx.post(f"{server.url}/v2/models/pair/infer", content=body(), timeout=30)
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 10], r.text
    for step in ("head", "tail"):  # two requests that waited out the delay would have queued 3 s
        stats = httpx.get(f"{server.url}/v2/models/{step}/stats").json()["model_stats"][0]
        assert stats["inference_count"] == 2 and stats["inference_stats"]["queue"]["ns"] < 1e9, stats


# Sleeps for the request's parameter sleep_ms, on one of its two instances (processes): a request that came
# later but sleeps less finishes first.
SLEEPY = '''
import json
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            time.sleep(json.loads(request.parameters()).get("sleep_ms", 0) / 1000)
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x)]))
        return responses
'''


def sleepy(root: Path, name: str, preserve: bool) -> None:
    python_model(root, name, SLEEPY, 'max_batch_size: 1\n'
                 'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
                 'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n'
                 f'dynamic_batching {{ preserve_ordering: {str(preserve).lower()} }}\n'
                 'instance_group [{ count: 2, kind: KIND_CPU }]\n')


def test_preserve_ordering_answers_in_the_order_requests_came(serve: Callable[..., Server],
                                                               tmp_path: Path) -> None:
    """A slow request, then a quick one on the other instance: without preserve_ordering the quick one
    is answered first; with it, after the slow one, as Triton's dynamic batcher orders its responses."""
    sleepy(tmp_path, "ordered", True)
    sleepy(tmp_path, "unordered", False)
    server = serve(tmp_path, wait_models=("ordered", "unordered"))

    async def scenario(model: str) -> list[str]:
        finished: list[str] = []

        async def call(client: httpx.AsyncClient, name: str, sleep_ms: int, after_s: float) -> None:
            await asyncio.sleep(after_s)
            r = await client.post(f"{server.url}/v2/models/{model}/infer", json={
                "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}],
                "parameters": {"sleep_ms": sleep_ms}})
            assert r.status_code == 200, r.text
            finished.append(name)

        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(call(client, "slow", 1000, 0.0), call(client, "quick", 0, 0.3))
        return finished

    assert asyncio.run(scenario("unordered")) == ["quick", "slow"]  # the other instance was free
    assert asyncio.run(scenario("ordered")) == ["slow", "quick"]


@pytest.mark.parametrize(("extra", "message"), [
    ("dynamic_batching { preserve_ordering: true priority_levels: 2 default_priority_level: 1 }",
     "only one priority level is allowed when 'preserve_ordering' is true"),
    ("dynamic_batching { preserve_ordering: true default_queue_policy { timeout_action: DELAY "
     "default_timeout_microseconds: 1000 } }", "cannot have DELAY as its timeout action"),
    ("dynamic_batching { preserve_ordering: true } model_transaction_policy { decoupled: true }",
     "'preserve_ordering' for a decoupled model is not supported"),
])
def test_preserve_ordering_is_refused_where_triton_refuses_it(extra: str, message: str) -> None:
    base = ('backend: "python" max_batch_size: 4 input [{ name: "x" data_type: TYPE_FP32 dims: [1] }] '
            'output [{ name: "y" data_type: TYPE_FP32 dims: [1] }] ')
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(normalize("m", parse_text("m", base + extra)))


# SLEEPER that says when it runs (the file STARTED), and holds its batches while the file HOLD is there
TOLD_SLEEPER = """
import os
import time
import triton_python_backend_utils as pb_utils

HOLD, STARTED = {hold!r}, {started!r}


class TritonPythonModel:
    def execute(self, requests):
        open(STARTED, "a").close()
        while os.path.exists(HOLD):
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy()[:, :10].copy())]) for r in requests]
"""


@pytest.mark.parametrize("max_batch_size, batch", [(1, ""), (0, "1, ")])
def test_max_queue_size_leaves_out_the_batch_executing(serve: Callable[..., Server], tmp_path: Path,
                                                        redis_url: str, key_prefix: str, max_batch_size: int,
                                                        batch: str) -> None:
    """Triton's max_queue_size counts the scheduler's queue: the batch being executed is out of it. One
    request runs (held), then three come: two queue, the third is refused (Triton 2.51: 3 of 4 accepted).
    Once all are answered the level's counter is back to 0. A model with max_batch_size 0 and
    dynamic_batching is Triton's too (never batched, queued by its policy): Despina refused to load it
    ("field 'dynamic_batching' needs max_batch_size > 0"); Triton 2.51 answers it 3 of 4 as well."""
    hold, started = tmp_path / "hold", tmp_path / "started"
    hold.touch()
    repo = python_model(tmp_path / "repo", "b", TOLD_SLEEPER.format(hold=str(hold), started=str(started)),
                        f'max_batch_size: {max_batch_size}\n'
                        f'input [{{ name: "x", data_type: TYPE_FP32, dims: [{batch}256] }}]\n'
                        f'output [{{ name: "y", data_type: TYPE_FP32, dims: [{batch}10] }}]\n'
                        "dynamic_batching { default_queue_policy { max_queue_size: 2 } }\n")
    server = serve(repo, wait_models=("b",))
    url = f"{server.url}/v2/models/b/infer"
    counter = Keys(key_prefix).queued("b", 1)
    store = aioredis.Redis.from_url(redis_url)

    async def scenario() -> tuple[int, list[int], int]:
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.create_task(client.post(url, content=body()))
            deadline = time.monotonic() + 30
            while not started.exists():
                assert time.monotonic() < deadline, "the first request did not start within 30 s"
                await asyncio.sleep(0.01)
            settle = time.monotonic() + 2  # its batch leaves the queue (the worker says so in Redis)
            while int(await store.get(counter) or 0) and time.monotonic() < settle:
                await asyncio.sleep(0.01)
            rest = [asyncio.create_task(client.post(url, content=body())) for _ in range(3)]
            done, _ = await asyncio.wait(rest, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            hold.unlink()
            codes = [(await first).status_code, *[(await r).status_code for r in rest]]
        left = int(await store.get(counter) or 0)
        await store.aclose()
        return len(done), codes, left

    refused_at_once, codes, left = asyncio.run(scenario())
    assert sorted(codes) == [200, 200, 200, 503] and codes[0] == 200, codes
    assert refused_at_once == 1
    assert left == 0
