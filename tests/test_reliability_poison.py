"""A poison request: one that kills whichever worker runs it. After max_attempts deliveries it is
dead-lettered and answered with an error saying so; it does not loop, and the requests around it are
answered, each with its own result."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import orjson
import redis

from despina.contract import records
from despina.contract.keys import ATTEMPTS, Keys

from .conftest import Server
from .reliability_support import KEEP_ALIVE, Answer, percentiles, post_all, report

# The stub's parent is its worker: a request holding -1 kills it, every time, whoever runs it.
POISON = """
import os
import signal
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        values = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        if any((v == -1).any() for v in values):
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(5)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", v * 2)]) for v in values]
"""
POISON_CONFIG = """
name: "poison"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""
ATTEMPTS_ALLOWED = 3


async def until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.05)


def body(value: float) -> bytes:
    return orjson.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}]})


async def test_a_request_that_kills_its_worker_is_dead_lettered_and_others_are_served(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo = tmp_path / "repo"
    (repo / "poison" / "1").mkdir(parents=True)
    (repo / "poison" / "1" / "model.py").write_text(POISON)
    (repo / "poison" / "config.pbtxt").write_text(POISON_CONFIG)
    server = serve(repo, "--workers", "2", "--model-replicas", "0", wait_models=("poison",),
                   env={"DESPINA_WORKER_TTL_S": "1.5", "DESPINA_MAX_ATTEMPTS": str(ATTEMPTS_ALLOWED),
                        **KEEP_ALIVE})
    url = f"{server.url}/v2/models/poison/infer"

    answers: list[Answer] = []
    stop = asyncio.Event()
    values = [float(i) for i in range(1, 100_000)]
    traffic = asyncio.create_task(post_all(lambda i: url, [body(v) for v in values], 8, answers, stop=stop))
    await until(lambda: len(answers) >= 8, "the traffic to flow")
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        poisoned = await client.post(url, content=body(-1.0), headers={"content-type": "application/json"})
    answered_in = time.monotonic() - started
    # the stream goes on after it: a request sent after its answer is answered too (a fixed second was
    # too short on a loaded machine, where a worker's restart holds the requests in flight for seconds)
    await until(lambda: any(a.sent > started + answered_in for a in answers), "a request sent after the poison")
    stop.set()
    await asyncio.wait_for(traffic, 60)
    await until(lambda: server.logs().count("exited with -9; restarting it") >= ATTEMPTS_ALLOWED,
                "every death the poison caused")
    await asyncio.sleep(3.0)  # long enough for another round of deaths, were it to loop
    restarts = server.logs().count("exited with -9; restarting it")

    assert poisoned.status_code == 500, poisoned.text
    assert f"dead-lettered after {ATTEMPTS_ALLOWED} attempts" in poisoned.json()["error"]
    assert restarts == ATTEMPTS_ALLOWED, server.logs()[-3000:]
    failed = [(a.index, a.status, a.body[:200]) for a in answers if a.status != 200]
    assert not failed, failed[:5]
    for a in answers:
        np.testing.assert_array_equal(orjson.loads(a.body)["outputs"][0]["data"], [values[a.index] * 2] * 2)
    after = [a for a in answers if a.sent > started + answered_in]
    assert after, "no request was answered after the poison"
    client = redis.Redis.from_url(redis_url)
    try:
        dead = client.xrange(Keys(key_prefix).dead_letters("poison", 1))
    finally:
        client.close()
    assert len(dead) == 1 and dead[0][1][ATTEMPTS] == str(ATTEMPTS_ALLOWED).encode()
    assert records.decode_requests(dead[0][1][b"m"])[0].inputs[0].numpy().tolist() == [[-1.0, -1.0]]
    report("poison request", max_attempts=ATTEMPTS_ALLOWED, worker_deaths=restarts,
           poison_status=poisoned.status_code, poison_answered_in_s=round(answered_in, 2),
           dead_letters=len(dead), others_sent=len(answers), others_answered=len(answers),
           others_lost=0, others_errors=len(failed), others_latency=percentiles([a.latency for a in answers]),
           others_during=sum(1 for a in answers if started <= a.sent <= started + answered_in))
