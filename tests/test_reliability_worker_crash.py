"""A worker killed with SIGKILL mid-batch while 2,000 requests are in flight: every request is answered
exactly once, with its own correct result. What the dead worker had read comes back through the
control plane (its heartbeat expired) or, with no help from there, through the other worker's
visibility timeout."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import redis

from despina.contract import records
from despina.contract.keys import GROUP, Keys

from .conftest import Server, stop_server
from .control_support import wait_until, worker_hashes
from .reliability_support import KEEP_ALIVE, Answer, children, percentiles, post_all, report

CONCURRENCY = 200
MODES = {
    # the control plane sees the heartbeat stop after 2 s and requeues at once
    "heartbeat": (2_000, {"DESPINA_WORKER_TTL_S": "2"}),
    # the control plane would wait a minute: the surviving worker redelivers after its visibility timeout
    "visibility": (600, {"DESPINA_WORKER_TTL_S": "60", "DESPINA_VISIBILITY_TIMEOUT_S": "2"}),
}

# A model that takes its time (50 ms a batch of up to 8): the workers always hold requests they have
# read, so the one killed dies holding some. Y = 2X + 1, checked against numpy for every request.
SLOW = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.05)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2 + 1)]) for r in requests]
"""
SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 5000 }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def slow_model(repo: Path) -> None:
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)


def body(x: np.ndarray) -> bytes:
    return orjson.dumps({"inputs": [{"name": "X", "shape": [1, x.size], "datatype": "FP32",
                                     "data": x.tolist()}]})


def output(answer: Answer) -> np.ndarray:
    return np.array(orjson.loads(answer.body)["outputs"][0]["data"], dtype=np.float32)


def check_each_answered_once(answers: list[Answer], expected: np.ndarray, server: Server
                             ) -> tuple[dict[int, list[Answer]], list[tuple[int, int, bytes]]]:
    """None lost, none answered twice, none failed, each its own right answer; the answers by request,
    and the failures (none)."""
    by_index: dict[int, list[Answer]] = {}
    for a in answers:
        by_index.setdefault(a.index, []).append(a)
    assert sorted(by_index) == list(range(len(expected)))               # none lost
    assert all(len(v) == 1 for v in by_index.values())                   # none answered twice
    failed = [(a.index, a.status, a.body[:200]) for a in answers if a.status != 200]
    # (a connection error once, not reproduced: what the server logged amiss, as well as its last words)
    amiss = [line for line in server.logs().splitlines() if "ERROR" in line or "Exception" in line]
    assert not failed, (failed[:5], amiss[:20], server.logs()[-3000:])
    for a in answers:                                                    # each its own right answer
        np.testing.assert_array_equal(output(a), expected[a.index])
    return by_index, failed


def pending_of(client: redis.Redis, stream: str) -> dict[str, int]:
    """Consumer -> entries it read and has not acknowledged."""
    return {c["name"].decode(): c["pending"] for c in client.xpending(stream, GROUP)["consumers"]}


def requests_held(client: redis.Redis, stream: str, consumer: str) -> tuple[int, set[int]]:
    """The entries pending for `consumer`, and the X-Request-Ids of the requests in them."""
    rows = client.xpending_range(stream, GROUP, "-", "+", 10_000, consumername=consumer)
    held: set[int] = set()
    for row in rows:
        for _, fields in client.xrange(stream, row["message_id"], row["message_id"]):
            held |= {int(r.trace) for r in records.decode_requests(fields[b"m"])}
    return len(rows), held


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_worker_killed_mid_batch_loses_and_duplicates_nothing(
        mode: str, serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    requests, env = MODES[mode]
    slow_model(tmp_path / "repo")
    server = serve(tmp_path / "repo", "--workers", "2", "--model-replicas", "0", wait_models=("slow",),
                   env={**env, **KEEP_ALIVE})
    client = redis.Redis.from_url(redis_url)
    stream = Keys(key_prefix).request_stream("slow", 1)
    wait_until(lambda: len(worker_hashes(redis_url, key_prefix)) == 2, what="two workers")
    pids = {wid: orjson.loads(h[b"info"])["pid"] for wid, h in worker_hashes(redis_url, key_prefix).items()}

    x = np.random.default_rng(7).standard_normal((requests, 16)).astype(np.float32)
    expected = x * 2 + 1
    answers: list[Answer] = []
    load = asyncio.create_task(post_all(lambda i: f"{server.url}/v2/models/slow/infer",
                                        [body(row) for row in x], CONCURRENCY, answers))
    while len(answers) < requests // 5 and not load.done():
        await asyncio.sleep(0.005)
    entries, held = 0, set[int]()
    while not entries and not load.done():
        holding = pending_of(client, stream)
        victim = max(pids, key=lambda wid: holding.get(wid, 0))  # the one holding the most: mid-batch
        # stopped first, so that what it holds can be read before it dies: the same as a SIGKILL now
        os.kill(pids[victim], signal.SIGSTOP)
        killed = time.monotonic()
        await asyncio.sleep(0.05)  # what it had sent before reaches Redis
        entries, held = requests_held(client, stream, victim)
        if not entries:
            os.kill(pids[victim], signal.SIGCONT)
            await asyncio.sleep(0.01)
    os.kill(pids[victim], signal.SIGKILL)
    await asyncio.wait_for(load, 120)
    stop_server(server)  # the gateway logs the duplicate replies it dropped as it stops
    client.close()

    by_index, failed = check_each_answered_once(answers, expected, server)
    assert entries and held, "no worker ever held a request it had read"
    assert {a.headers.get("keep-alive") for a in answers} == {"timeout=60"}  # KEEP_ALIVE is in effect

    dropped = re.search(r"dropped (\d+) replies nobody waited for", server.logs())
    # held, but answered by the victim before it stopped (the rest of their entry was not): not reclaimed
    reclaimed = [a for a in answers if a.index in held and a.done - killed > 0.5]
    others = [a for a in answers if a.index not in held]
    assert reclaimed, "no request waited for redelivery"
    assert "requeued" in server.logs()
    report(f"worker crash ({mode})", sent=requests, answered=len(answers), lost=requests - len(by_index),
           duplicated=sum(len(v) - 1 for v in by_index.values()), errors=len(failed),
           victim_entries=entries, victim_requests=len(held), reclaimed=len(reclaimed),
           duplicate_replies_dropped=int(dropped.group(1)) if dropped else 0,
           reclaimed_wait_after_kill=percentiles([a.done - killed for a in reclaimed]),
           reclaimed_latency=percentiles([a.latency for a in reclaimed]),
           others_latency=percentiles([a.latency for a in others]), env=env)


TWICE_CONFIG = """
name: "slow_twice"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "Y2", data_type: TYPE_FP32, dims: [ 16 ] } ]
ensemble_scheduling { step [
  { model_name: "slow" model_version: -1 input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y1" } },
  { model_name: "slow" model_version: -1 input_map { key: "X" value: "Y1" } output_map { key: "Y" value: "Y2" } }
] }
"""


async def test_a_worker_killed_while_running_ensembles_loses_and_duplicates_nothing(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Both workers run the ensemble (each has its model); one is killed with requests read from the
    ensemble's stream and steps in its batcher. Those steps die with it, the ensemble entries it had
    read come back (its heartbeat expired) and the other worker runs them whole: every request is
    answered once, with its own result."""
    slow_model(tmp_path / "repo")
    (tmp_path / "repo" / "slow_twice").mkdir()
    (tmp_path / "repo" / "slow_twice" / "config.pbtxt").write_text(TWICE_CONFIG)
    server = serve(tmp_path / "repo", "--workers", "2", "--model-replicas", "0", wait_models=("slow",),
                   env={"DESPINA_WORKER_TTL_S": "2", **KEEP_ALIVE})
    wait_until(lambda: server.logs().count("ensemble slow_twice version 1: run in this worker") == 2, 30,
               what="both workers to run the ensemble")
    client = redis.Redis.from_url(redis_url)
    stream = Keys(key_prefix).request_stream("slow_twice", 1)
    pids = {wid: orjson.loads(h[b"info"])["pid"] for wid, h in worker_hashes(redis_url, key_prefix).items()}

    requests = 600
    x = np.random.default_rng(11).standard_normal((requests, 16)).astype(np.float32)
    expected = (x * 2 + 1) * 2 + 1
    answers: list[Answer] = []
    load = asyncio.create_task(post_all(lambda i: f"{server.url}/v2/models/slow_twice/infer",
                                        [body(row) for row in x], CONCURRENCY, answers))
    while len(answers) < requests // 5 and not load.done():
        await asyncio.sleep(0.005)
    held = 0
    while not held and not load.done():
        holding = pending_of(client, stream)
        victim = max(pids, key=lambda wid: holding.get(wid, 0))
        # stopped before what it holds is read: a worker still running could answer and acknowledge all
        # of it before the SIGKILL, leaving nothing to requeue
        os.kill(pids[victim], signal.SIGSTOP)
        await asyncio.sleep(0.05)  # what it had sent before reaches Redis
        held = pending_of(client, stream).get(victim, 0)
        if not held:
            os.kill(pids[victim], signal.SIGCONT)
            await asyncio.sleep(0.01)
    if held:
        os.kill(pids[victim], signal.SIGKILL)
    await asyncio.wait_for(load, 120)
    stop_server(server)
    client.close()

    check_each_answered_once(answers, expected, server)
    assert held, "the killed worker held no ensemble request"
    assert "requeued" in server.logs()


SLOWER = SLOW.replace("time.sleep(0.05)", "time.sleep(3)")


def test_what_a_worker_leaves_unanswered_as_its_drain_times_out_is_requeued_at_once(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A worker stopped (SIGTERM) while its model runs longer than DESPINA_DRAIN_TIMEOUT_S leaves what it
    read to the others: the control plane requeues it at once, and another worker answers it. The worker
    took itself off the workers' set on its way out, so the control plane never took it for dead, and
    the request waited for a runner's visibility timeout (a minute): past its deadline, a 504."""
    slow_model(tmp_path / "repo")
    (tmp_path / "repo" / "slow" / "1" / "model.py").write_text(SLOWER)
    server = serve(tmp_path / "repo", "--workers", "0", health="live",
                   env={"DESPINA_REQUEST_TIMEOUT_S": "20"})
    env = {**os.environ, "DESPINA_DRAIN_TIMEOUT_S": "1"}
    started: list[subprocess.Popen[bytes]] = []

    def worker(name: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"{name}.log").open("wb") as log:
            started.append(subprocess.Popen([sys.executable, "-m", "despina", "worker", "--redis-url", redis_url,
                                             "--key-prefix", key_prefix], stdout=log, stderr=subprocess.STDOUT,
                                            env=env))
        return started[-1]

    client = redis.Redis.from_url(redis_url)
    stream = Keys(key_prefix).request_stream("slow", 1)
    try:
        first = worker("first")
        wait_until(lambda: worker_hashes(redis_url, key_prefix), 30, what="the first worker")
        (first_id,) = worker_hashes(redis_url, key_prefix)
        wait_until(lambda: httpx.get(f"{server.url}/v2/models/slow/ready").status_code == 200, 30,
                   what="the model to be ready")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{server.url}/v2/models/slow/infer",
                                 content=body(np.ones(16, np.float32)), timeout=60,
                                 headers={"content-type": "application/json"})
            wait_until(lambda: pending_of(client, stream).get(first_id), 10, what="the request to be read")
            time.sleep(0.5)  # in the model's execute
            first.send_signal(signal.SIGTERM)
            first.wait(15)
            worker("second")
            sent = time.monotonic()
            response = answer.result()
            took = time.monotonic() - sent
    finally:
        client.close()
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert response.status_code == 200, (response.status_code, response.text, round(took, 1),
                                          server.logs()[-2000:])
    np.testing.assert_array_equal(output_of(response), np.full(16, 3.0, np.float32))


def output_of(response: httpx.Response) -> np.ndarray:
    return np.array(orjson.loads(response.content)["outputs"][0]["data"], dtype=np.float32)


def model_process(worker: int) -> int:
    """The pid of the worker's (one) Python model process."""
    (pid,) = [pid for pid, cmd in children(worker) if "python_stub/stub.py" in cmd]
    return pid


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_model_process_whose_worker_was_killed_ends_without_a_traceback(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A worker SIGKILLed while its Python model executes: the model's process, finding no one to send its
    answer to, ends quietly. It wrote two BrokenPipeError tracebacks into the log after every worker crash
    (sending the answer, then sending the error about sending it)."""
    slow_model(tmp_path / "repo")
    executing = tmp_path / "executing"  # the model says when it is in execute
    (tmp_path / "repo" / "slow" / "1" / "model.py").write_text(SLOW.replace(
        "time.sleep(0.05)", f"open({str(executing)!r}, 'w').close()\n        time.sleep(0.4)"))
    server = serve(tmp_path / "repo", wait_models=("slow",))
    wait_until(lambda: len(worker_hashes(redis_url, key_prefix)) == 1, what="the worker")
    (info,) = [orjson.loads(h[b"info"]) for h in worker_hashes(redis_url, key_prefix).values()]
    model = model_process(info["pid"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(httpx.post, f"{server.url}/v2/models/slow/infer", content=body(np.ones(16, np.float32)),
                    timeout=30)
        wait_until(executing.exists, 30, 0.01, what="the model to execute the request")
        os.kill(info["pid"], signal.SIGKILL)  # while the model sleeps: its answer's send fails at 0.4 s
        wait_until(lambda: ended(model), 30, what="the model's process to end")
    assert "BrokenPipeError" not in server.logs()


# A decoupled model that streams from a thread of its own, a response every 50 ms.
TICKER = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.tick, args=(request.get_response_sender(),)).start()
        return None

    def tick(self, sender):
        for i in range(200):
            time.sleep(0.05)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([i], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
TICKER_CONFIG = """
name: "ticker"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""


def test_a_decoupled_models_sender_thread_ends_quietly_when_its_worker_is_killed(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A worker SIGKILLed while its decoupled model streams from a thread: the thread's next send finds no
    one to send to, and it ends quietly, as the process's loop does (a BrokenPipeError traceback from the
    thread was in the log after every such crash)."""
    (tmp_path / "repo" / "ticker" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "ticker" / "1" / "model.py").write_text(TICKER)
    (tmp_path / "repo" / "ticker" / "config.pbtxt").write_text(TICKER_CONFIG)
    server = serve(tmp_path / "repo", wait_models=("ticker",))
    wait_until(lambda: len(worker_hashes(redis_url, key_prefix)) == 1, what="the worker")
    (info,) = [orjson.loads(h[b"info"]) for h in worker_hashes(redis_url, key_prefix).values()]
    request = {"X": [1]}
    model = model_process(info["pid"])
    with httpx.stream("POST", f"{server.url}/v2/models/ticker/generate_stream", json=request, timeout=30) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data:"):  # the model streams
            pass
        os.kill(info["pid"], signal.SIGKILL)
    wait_until(lambda: ended(model), 30, what="the model's process to end")  # its next send fails within 50 ms
    assert "BrokenPipeError" not in server.logs() and "Exception in thread" not in server.logs(), server.logs()
