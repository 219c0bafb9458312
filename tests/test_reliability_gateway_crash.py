"""Two gateways on one Redis, one killed with SIGKILL under load: the other serves on without an error,
the workers go on answering, and the dead gateway's reply stream expires."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import redis

from despina.contract.keys import Keys
from despina.examples import mlp_numpy

from .conftest import Server
from .control_support import mlp_folder
from .reliability_support import (
    KEEP_ALIVE,
    Answer,
    mlp_body,
    mlp_output,
    percentiles,
    post_all,
    report,
    role_pids,
    start_gateway,
)

REPLY_TTL_S = 2.0
ENV = {"DESPINA_REPLY_TTL_S": str(REPLY_TTL_S), **KEEP_ALIVE}


async def test_a_killed_gateway_leaves_the_other_serving_and_its_replies_expire(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    mlp_folder(tmp_path / "repo", delay_us=1_000)
    survivor = serve(tmp_path / "repo", wait_models=("mlp",), env=ENV)
    victim, victim_url = start_gateway(redis_url, key_prefix, tmp_path / "gateway.log", ENV)
    client = redis.Redis.from_url(redis_url)
    pattern = f"{Keys(key_prefix).reply_stream(str(victim.pid))}-*"  # its id is "<pid>-<random>"
    try:
        x = np.random.default_rng(3).standard_normal((100_000, 256)).astype(np.float32)
        bodies = [mlp_body(row) for row in x[:3_000]]
        kept: list[Answer] = []
        cut: list[Answer] = []
        stop, stop_victim = asyncio.Event(), asyncio.Event()
        load = [asyncio.create_task(post_all(lambda i: f"{survivor.url}/v2/models/mlp/infer", bodies, 16,
                                             kept, timeout=30, stop=stop)),
                asyncio.create_task(post_all(lambda i: f"{victim_url}/v2/models/mlp/infer", bodies, 16, cut,
                                             timeout=30, stop=stop_victim))]
        while len(cut) < 100 or len(kept) < 100:
            await asyncio.sleep(0.01)
        (replies,) = client.scan_iter(pattern, count=10_000)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        stop_victim.set()
        await asyncio.wait_for(load[1], 30)  # the requests in flight there see their connections fail
        expired = None
        while time.monotonic() - killed < REPLY_TTL_S + 10:
            if not client.exists(replies):
                expired = time.monotonic() - killed
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(load[0], 30)
    finally:
        client.close()
        if victim.poll() is None:
            victim.kill()
        victim.wait()

    failed = [(a.index, a.status, a.body[:200]) for a in kept if a.status != 200]
    assert not failed, failed[:5]
    for a in kept:
        np.testing.assert_allclose(mlp_output(a), mlp_numpy(x[a.index:a.index + 1])[0], rtol=1e-4, atol=1e-5)
    after = [a for a in kept if a.sent > killed]
    assert len(after) > 50, "the surviving gateway stopped serving"
    assert expired is not None, "the dead gateway's reply stream did not expire"
    cut_off = [a for a in cut if a.status != 200]
    assert all(a.status == 0 for a in cut_off)  # connection errors, never a wrong or error answer
    assert all(a.status == 200 for a in cut if a.done < killed)
    report("gateway crash", survivor_sent=len(kept), survivor_answered=sum(a.status == 200 for a in kept),
           survivor_lost=0, survivor_errors=len(failed), survivor_answered_after_kill=len(after),
           survivor_latency_before=percentiles([a.latency for a in kept if a.done < killed]),
           survivor_latency_after=percentiles([a.latency for a in after]),
           victim_answered=sum(a.status == 200 for a in cut), victim_connections_cut=len(cut_off),
           reply_stream_expired_after_s=round(expired, 2), reply_ttl_s=REPLY_TTL_S)


async def test_a_killed_gateways_requests_answered_by_an_unload_leave_no_reply_stream_behind(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A dead gateway's requests still queued when their model is unloaded are answered on its reply
    stream, which nobody reads: that answer must expire as a worker's does. It was written without a
    TTL, and the stream it made stayed in Redis for good."""
    mlp_folder(tmp_path / "repo")
    survivor = serve(tmp_path / "repo", "--model-control-mode", "explicit", "--load-model", "mlp",
                     wait_models=("mlp",), env={**ENV, "DESPINA_WORKER_TTL_S": "2"})
    victim, victim_url = start_gateway(redis_url, key_prefix, tmp_path / "gateway.log", ENV)
    client = redis.Redis.from_url(redis_url)
    pattern = f"{Keys(key_prefix).reply_stream(str(victim.pid))}-*"
    (worker,) = role_pids(survivor, "worker")
    os.kill(worker, signal.SIGSTOP)  # what the gateway sends stays queued
    try:
        x = np.random.default_rng(4).standard_normal((5, 256)).astype(np.float32)
        answers: list[Answer] = []
        load = asyncio.create_task(post_all(lambda i: f"{victim_url}/v2/models/mlp/infer",
                                            [mlp_body(row) for row in x], 5, answers, timeout=30))
        stream = Keys(key_prefix).request_stream("mlp", 1)
        while not client.xlen(stream):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # (they may share entries)
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.wait_for(load, 30)
        async with httpx.AsyncClient(timeout=30) as http:  # done when the stopped worker is taken for dead
            unloaded = await http.post(f"{survivor.url}/v2/repository/models/mlp/unload")
        assert unloaded.status_code == 200, unloaded.text
        assert client.xlen(stream) == 0
        replies = list(client.scan_iter(pattern, count=10_000))
        ttls = [client.pttl(r) for r in replies]
    finally:
        os.kill(worker, signal.SIGCONT)
        client.close()
        if victim.poll() is None:
            victim.kill()
        victim.wait()
    assert replies, "the unload answered nothing"
    assert all(0 < ttl <= REPLY_TTL_S * 1000 for ttl in ttls), ttls
