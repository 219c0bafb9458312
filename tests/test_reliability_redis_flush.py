"""Redis that stays up but loses its data (FLUSHALL, a failover to a replica that had none), or that drops
the roles' connections (CLIENT KILL, a proxy restarted): requests the data loss took are answered 503 at
once, not at their deadline, and requests Redis still holds are answered as usual."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import redis

from despina.contract.keys import Keys

from .conftest import Server, stop_server
from .control_support import mlp_folder, wait_until
from .reliability_support import mlp_body, own_redis, worker_paused

REQUEST_TIMEOUT_S = 60
# Runs until the file RELEASE exists (the test says when), having written STARTED: a model slower than the
# gateway's grace after Redis lost its data (reply_reader.GRACE_S), as long as the test needs.
SLOW_MODEL = """
import os
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        open({started!r}, "a").close()
        deadline = time.monotonic() + 30
        while not os.path.exists({release!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
"""
SLOW_BODY = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.5]}]}'


def role_lines(logs: str, text: str) -> dict[str, int]:
    """How many log lines of each role ("gateway <id>: ...", "worker <id>: ...") say `text`."""
    counts: dict[str, int] = {}
    for role in re.findall(rf"\b(gateway|worker) \S+: {re.escape(text)}", logs):
        counts[role] = counts.get(role, 0) + 1
    return counts


def slow_folder(root: Path, tmp: Path) -> tuple[Path, Path]:
    """A repository of one Python model, "slow" (SLOW_MODEL); (its STARTED file, its RELEASE file)."""
    started, release = tmp / "started", tmp / "release"
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "1" / "model.py").write_text(SLOW_MODEL.format(started=str(started), release=str(release)))
    (root / "slow" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n')
    return started, release


def post(server: Server) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/mlp/infer", content=mlp_body(np.ones(256, np.float32)),
                      timeout=REQUEST_TIMEOUT_S / 2)


def test_requests_queued_when_redis_is_flushed_are_answered_503_at_once(
        serve: Callable[..., Server], tmp_path: Path, key_prefix: str) -> None:
    """A FLUSHALL (or a failover to a replica without the data) took the requests queued in Redis, and the
    gateway, whose connections stayed up, waited for their answers until their deadline: each client had a
    504 a minute later. The gateway notices its own key gone and answers them 503 (retry) within a second or
two (those a worker had in hand may still be answered meanwhile)."""
    mlp_folder(tmp_path / "repo")
    with own_redis(tmp_path) as redis_server:
        server = serve(tmp_path / "repo", "--redis-url", redis_server.url, "--request-timeout",
                       str(REQUEST_TIMEOUT_S), use_redis=False, wait_models=("mlp",))
        client = redis.Redis.from_url(redis_server.url)
        stream = Keys(key_prefix).request_stream("mlp", 1)
        with ThreadPoolExecutor(2) as pool:
            with worker_paused(server):
                answers = [pool.submit(post, server) for _ in range(2)]
                wait_until(lambda: client.xlen(stream), 10, what="the requests to be queued")
                time.sleep(0.2)  # (the second one too)
                client.flushall()
                flushed = time.monotonic()
                lost = [answer.result() for answer in answers]
                answered_after = time.monotonic() - flushed
            wait_until(lambda: post(server).status_code == 200, 30, what="a request to be answered again")
            wait_until(lambda: role_lines(server.logs(), "Redis lost its data").get("worker"), 10,
                       what="the worker, stopped meanwhile, to see the loss")
        client.close()
        stop_server(server)
    assert [r.status_code for r in lost] == [503, 503], [r.text for r in lost]
    assert all("lost its data" in r.json()["error"] and r.headers["retry-after"] == "1" for r in lost), lost[0].text
    assert answered_after < 10, answered_after  # not at the request's deadline (60 s)
    assert role_lines(server.logs(), "Redis lost its data") == {"gateway": 1, "worker": 1}, server.logs()[-3000:]


def test_requests_waiting_when_redis_drops_every_connection_are_answered(
        serve: Callable[..., Server], tmp_path: Path, key_prefix: str) -> None:
    """CLIENT KILL (a proxy restarted, a network blip) broke the gateway's reading of its reply stream, and
    it answered every request waiting 503 ("lost the connection to Redis") though Redis kept them and their
    answers came a moment later: a client that retried ran its request twice. The gateway reconnects, finds
    its data still in Redis, and keeps waiting."""
    mlp_folder(tmp_path / "repo")
    with own_redis(tmp_path) as redis_server:
        server = serve(tmp_path / "repo", "--redis-url", redis_server.url, "--request-timeout",
                       str(REQUEST_TIMEOUT_S), use_redis=False, wait_models=("mlp",))
        client = redis.Redis.from_url(redis_server.url)
        with ThreadPoolExecutor(1) as pool:
            with worker_paused(server):
                answer = pool.submit(post, server)
                wait_until(lambda: client.xlen(Keys(key_prefix).request_stream("mlp", 1)), 10,
                           what="the request to be queued")
                killed = client.client_kill_filter(_type="normal", skipme=True)
                time.sleep(1.0)  # the roles see their connections broken, and connect again
            kept = answer.result()
        again = post(server)
        client.close()
        stop_server(server)
    assert killed >= 3
    assert kept.status_code == 200, kept.text
    assert again.status_code == 200, again.text
    assert "Redis lost its data" not in server.logs()


def test_a_request_a_worker_is_running_when_redis_loses_its_data_gets_its_answer(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """Redis lost its data (here FLUSHDB) while a slow model ran a request: the gateway, finding its mark gone,
    answered 503 to every request waiting that no answer reached within its 1 s grace, this one too, and
    dropped the model's answer when it came: a client that retried ran the request twice. The worker, finding
    its own mark gone, tells the gateway which of its requests it still holds, and the gateway keeps them
    waiting. Each role logs the loss, and then, once the control plane has published the catalog again, that
    Redis has its data again: once each."""
    started, release = slow_folder(tmp_path / "repo", tmp_path)
    with own_redis(tmp_path) as redis_server:
        server = serve(tmp_path / "repo", "--redis-url", redis_server.url, "--request-timeout",
                       str(REQUEST_TIMEOUT_S), use_redis=False, wait_models=("slow",))
        client = redis.Redis.from_url(redis_server.url)
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, f"{server.url}/v2/models/slow/infer", content=SLOW_BODY,
                                  timeout=REQUEST_TIMEOUT_S)
            wait_until(started.exists, 20, what="the model to run the request")
            queued = pool.submit(httpx.post, f"{server.url}/v2/models/slow/infer", content=SLOW_BODY,
                                 timeout=REQUEST_TIMEOUT_S)  # read by the worker: in its batcher's queue
            time.sleep(0.5)
            client.flushdb()  # (this test's own Redis: the server is its alone)
            wait_until(lambda: "Redis lost its data" in server.logs(), 10, what="the gateway to see the loss")
            time.sleep(3.0)  # past the gateway's grace (1 s) after it saw the loss: once, both got 503 here
            gave_up_early = running.done() or queued.done()
            release.touch()
            answers = [running.result(), queued.result()]
        assert not gave_up_early, [a.text for a in answers]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        try:
            wait_until(lambda: role_lines(server.logs(), "Redis has its data again") == {"gateway": 1, "worker": 1},
                       20, what="both roles to log that Redis has its data again")
        except AssertionError:
            raise AssertionError(server.logs()[-6000:]) from None
        client.close()
        stop_server(server)
    assert all(a.json()["outputs"][0]["data"] == [1.5] for a in answers)
    assert role_lines(server.logs(), "Redis lost its data") == {"gateway": 1, "worker": 1}, server.logs()[-3000:]
    assert "told 1 gateway(s) it still holds 2 of their request(s)" in server.logs(), server.logs()[-3000:]


def test_redis_restarted_without_its_data_is_logged_as_pairs(serve: Callable[..., Server], tmp_path: Path) -> None:
    """After an outage no line said Redis was back: operators saw "reading replies failed" and "lost its data"
    and could not tell whether, or when, it ended. Each role now logs, once per outage, that Redis is
    reachable again and that it has its data again."""
    mlp_folder(tmp_path / "repo")
    with own_redis(tmp_path) as redis_server:
        server = serve(tmp_path / "repo", "--redis-url", redis_server.url, "--request-timeout",
                       str(REQUEST_TIMEOUT_S), use_redis=False, wait_models=("mlp",))
        redis_server.kill()
        wait_until(lambda: role_lines(server.logs(), "Redis is unreachable"), 10,
                   what="the gateway to see Redis gone")
        time.sleep(1.5)  # the worker's next sync fails too
        redis_server.start()  # on the same port, without the data
        wait_until(lambda: post(server).status_code == 200, 60, what="a request to be answered again")
        wait_until(lambda: role_lines(server.logs(), "Redis has its data again") == {"gateway": 1, "worker": 1},
                   20, what="both roles to log that Redis has its data again")
        time.sleep(2.0)  # (no second line comes)
        stop_server(server)
    logs = server.logs()
    assert role_lines(logs, "Redis is unreachable") == {"gateway": 1}, logs[-4000:]
    assert role_lines(logs, "Redis is reachable again") == {"gateway": 1, "worker": 1}, logs[-4000:]
    assert role_lines(logs, "Redis lost its data") == {"gateway": 1, "worker": 1}, logs[-4000:]
    assert role_lines(logs, "Redis has its data again") == {"gateway": 1, "worker": 1}, logs[-4000:]
