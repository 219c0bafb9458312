"""Redis that stays up but loses its data (FLUSHALL, a failover to a replica that had none), or that drops
the roles' connections (CLIENT KILL, a proxy restarted): requests the data loss took are answered 503 at
once, not at their deadline, and requests Redis still holds are answered as usual."""
from __future__ import annotations

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
        client.close()
        stop_server(server)
    assert [r.status_code for r in lost] == [503, 503], [r.text for r in lost]
    assert all("lost its data" in r.json()["error"] and r.headers["retry-after"] == "1" for r in lost), lost[0].text
    assert answered_after < 10, answered_after  # not at the request's deadline (60 s)
    assert server.logs().count("Redis lost its data") == 1, server.logs()[-3000:]


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
