"""Backpressure: a request stream at max_stream_length refuses more at once (503 with Retry-After);
what it accepted is never trimmed away: every accepted request is answered once the worker goes on."""
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
from .reliability_support import Answer, mlp_body, mlp_output, report, role_pids

LIMIT = 10
SENT = 60


async def test_a_full_stream_refuses_at_once_and_loses_nothing_it_accepted(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    mlp_folder(tmp_path / "repo")
    # a stopped worker must not be taken for dead meanwhile
    server = serve(tmp_path / "repo", wait_models=("mlp",),
                   env={"DESPINA_MAX_STREAM_LENGTH": str(LIMIT), "DESPINA_WORKER_TTL_S": "60"})
    url = f"{server.url}/v2/models/mlp/infer"
    x = np.random.default_rng(11).standard_normal((SENT, 256)).astype(np.float32)
    client = redis.Redis.from_url(redis_url)
    stream, stats = Keys(key_prefix).request_stream("mlp", 1), Keys(key_prefix).stats("mlp", 1)
    (worker,) = role_pids(server, "worker")
    answers: list[Answer] = []
    longest = 0

    async def post(http: httpx.AsyncClient, i: int) -> None:
        sent = time.monotonic()
        r = await http.post(url, content=mlp_body(x[i]), headers={"content-type": "application/json"})
        answers.append(Answer(i, r.status_code, r.content, sent, time.monotonic(), dict(r.headers)))

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=SENT)) as http:
        await post(http, 0)
        os.kill(worker, signal.SIGSTOP)
        try:
            added = added_to(client, stream)
            tasks = []
            for i in range(1, SENT):  # one at a time: each request its own stream entry
                tasks.append(asyncio.create_task(post(http, i)))
                await asyncio.sleep(0.02)
                longest = max(longest, client.xlen(stream))
            # every request is either queued or refused while the worker is stopped (a late 503 is waited for)
            deadline = time.monotonic() + 30
            while (len(answers) - 1 + added_to(client, stream) - added < SENT - 1
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.05)
            refused_while_stopped = [a for a in answers if a.status == 503]
        finally:
            os.kill(worker, signal.SIGCONT)
        await asyncio.gather(*tasks)
    rejected = int(client.hget(stats, "fail:REJECTED") or 0)
    client.close()

    accepted = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 503]
    assert len(answers) == SENT and {a.status for a in answers} == {200, 503}
    assert refused and len(refused) == len(refused_while_stopped)  # answered at once, not after the wait
    assert all(a.headers.get("retry-after") == "1" and b"max_stream_length" in a.body for a in refused)
    assert len(accepted) >= LIMIT + 1                      # the limit counts entries; the first was answered
    assert longest <= len(accepted)                        # nothing was trimmed: all accepted are answered
    for a in accepted:
        np.testing.assert_allclose(mlp_output(a), mlp_numpy(x[a.index:a.index + 1])[0], rtol=1e-4, atol=1e-5)
    assert rejected == len(refused)                        # Triton's REJECTED failures
    report("backpressure", max_stream_length=LIMIT, sent=SENT, accepted=len(accepted), refused_503=len(refused),
           accepted_answered=len(accepted), lost=0, longest_stream=longest,
           refused_latency_max_ms=round(max(a.latency for a in refused) * 1000, 1))


def added_to(client: redis.Redis, stream: str) -> int:
    """Entries ever added to `stream` (XDEL and trimming do not lower it, as they lower XLEN)."""
    return int(client.xinfo_stream(stream)["entries-added"])
