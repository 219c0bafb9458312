"""A worker's replies that Redis refuses (at its maxmemory), against a Redis of the test's own: a decoupled
model's responses written again, in order, until it takes them, the later responses of the request waiting
behind them; an ensemble run in the worker, its reply written again as a model's runner's is."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from despina.contract import records
from despina.contract.keys import FIELD, GROUP, IN_FLIGHT, Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.control.repository import load_model
from despina.workers.runner import ModelRunner

from .conftest import Server
from .control_support import mlp_folder, wait_until
from .reliability_support import mlp_body, own_redis, worker_paused

# Sends OUT = 0, then (once the file "full" is in FLAGS: Redis refuses writes) 1, then (once "refused": the
# worker heard Redis refuse 1) 2, 3 and the final 4, and says so with the file "sent".
STEPS = '''
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FLAGS = {flags!r}


def wait(name):
    while not os.path.exists(os.path.join(FLAGS, name)):
        time.sleep(0.01)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.stream, args=(request.get_response_sender(),), daemon=True).start()
        return None

    def stream(self, sender):
        def send(i, flags=0):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]),
                        flags=flags)
        send(0)
        wait("full")
        send(1)
        wait("refused")
        send(2)
        send(3)
        send(4, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        open(os.path.join(FLAGS, "sent"), "w").close()
'''
STEPS_CONFIG = '''
name: "steps"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
'''


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def _replies_to_final(redis: aioredis.Redis, stream: str, last: str = "0-0",
                            timeout: float = 20.0) -> list[InferReply]:
    """A gateway's reply stream read from after `last` until a final reply."""
    got: list[InferReply] = []
    async with asyncio.timeout(timeout):
        while not got or not got[-1].final:
            for _, entries in await redis.xread({stream: last}, block=100) or ():
                for entry_id, fields in entries:
                    last = entry_id
                    got += records.decode_replies(fields[FIELD])
    return got


class Steps:
    """The model STEPS loaded in a runner on a Redis of the test's own, and a gateway's side of it."""

    def __init__(self, tmp_path: Path, key_prefix: str, url: str) -> None:
        self.flags = tmp_path / "flags"
        self.flags.mkdir()
        folder = tmp_path / "steps"
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text(STEPS.format(flags=str(self.flags)))
        (folder / "config.pbtxt").write_text(STEPS_CONFIG)
        self.reply_stream = f"{key_prefix}:replies"
        self.redis = aioredis.Redis.from_url(url)
        self.runner = ModelRunner(self.redis, Keys(key_prefix), ModelSpec.from_config(load_model(folder).config),
                                  1, folder, "w")

    async def first(self, deadline_s: float) -> tuple[bytes, InferReply]:
        """Load, send the request, and read its first response (with its entry's id)."""
        await self.runner.load()
        await self.runner.start()
        request = InferRequest("s", self.reply_stream, time.time() + deadline_s,
                               (Tensor("IN", "INT32", (1,), np.array([1], np.int32).tobytes()),),
                               enqueued=time.time())
        await self.redis.xadd(self.runner.streams.streams[0], {FIELD: records.encode([request]), IN_FLIGHT: b"1"})
        ((_, [(entry_id, fields)]),) = await self.redis.xread({self.reply_stream: "0-0"}, block=20_000)
        return entry_id, records.decode_replies(fields[FIELD])[0]

    async def full_from_the_second(self, caplog: pytest.LogCaptureFixture) -> None:
        """Redis refuses writes from the model's second response on; the rest come once it was refused."""
        await self.redis.config_set("maxmemory", 1)  # noeviction, the default: writes that grow refused
        (self.flags / "full").touch()
        await _until(lambda: "OOM command not allowed" in caplog.text)
        (self.flags / "refused").touch()
        await _until((self.flags / "sent").exists)

    async def close(self) -> None:
        await self.redis.config_set("maxmemory", 0)
        await self.runner.stop()
        await self.redis.aclose()


async def test_a_decoupled_models_responses_redis_refused_come_in_order_once_memory_frees(
        tmp_path: Path, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A response before the last went alone, and Redis refusing its XADD for lack of memory failed the
    whole pipeline: the response was lost for good (the gateway skips missing numbers), the client's stream
    silently short of it. Now it is written again until Redis takes it, and the request's later responses,
    its final one included, wait behind it: every response comes, once, in order."""
    with own_redis(tmp_path) as server, caplog.at_level(logging.ERROR, logger="despina.worker"):
        steps = Steps(tmp_path, key_prefix, server.url)
        try:
            first_id, first = await steps.first(60)
            await steps.full_from_the_second(caplog)
            await asyncio.sleep(0.3)  # the last responses reach the runner while Redis is still full
            await steps.redis.config_set("maxmemory", 0)
            replies = [first, *await _replies_to_final(steps.redis, steps.reply_stream, first_id)]
        finally:
            await steps.close()
    got = [(r.index, r.final, r.outputs[0].numpy().tolist()) for r in replies]
    assert got == [(i, i == 4, [i]) for i in range(5)], got


async def test_responses_redis_refuses_past_the_deadline_are_dropped_and_the_request_ends(
        tmp_path: Path, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Past the request's deadline (its gateway has answered 504) the held responses are given up, and the
    final reply's round trip still goes: it acknowledges the request (XACK, which Redis takes while full)."""
    with own_redis(tmp_path) as server, caplog.at_level(logging.ERROR, logger="despina.worker"):
        steps = Steps(tmp_path, key_prefix, server.url)
        try:
            await steps.first(4)
            await steps.full_from_the_second(caplog)
            await _until(lambda: "were not written by their request's deadline" in caplog.text)
            stream = steps.runner.streams.streams[0]
            await _until(lambda: not steps.runner._held)
            async with asyncio.timeout(10):  # the final reply's round trip, just behind
                while (await steps.redis.xpending(stream, GROUP))["pending"]:
                    await asyncio.sleep(0.02)
        finally:
            await steps.close()
    # responses 1 to 3, each dropped once: in one line, or in two where a slow machine's model sent the
    # last of them after the deadline had ended the first hold (it is held, and dropped, on its own)
    dropped = re.findall(r"model steps: (\d+) responses Redis refused were not written by their request's "
                         r"deadline", caplog.text)
    assert sum(map(int, dropped)) == 3, caplog.text


ENSEMBLE = """name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 10 ] } ]
ensemble_scheduling { step [ { model_name: "mlp" model_version: -1
  input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }
"""


def test_an_ensembles_reply_redis_refused_comes_once_memory_frees(
        serve: Callable[..., Server], tmp_path: Path, key_prefix: str) -> None:
    """An ensemble run in the worker replies through the writer a model's runner replies through
    (replies.ReplyWriter): a reply Redis refused for lack of memory, its acknowledgement taken in the same
    pipeline, is written again until Redis takes it, not left to the client's timeout."""
    repo = tmp_path / "repo"
    mlp_folder(repo)
    (repo / "pipe").mkdir()
    (repo / "pipe" / "config.pbtxt").write_text(ENSEMBLE)
    url = "/v2/models/pipe/infer"
    with own_redis(tmp_path) as redis_server:
        server = serve(repo, "--redis-url", redis_server.url, "--request-timeout", "40", use_redis=False,
                       wait_models=("mlp", "pipe"), env={"DESPINA_WORKER_TTL_S": "30"})
        client = redis.Redis.from_url(redis_server.url)
        stream = Keys(key_prefix).request_stream("pipe", 1)

        def run_by_the_worker() -> bool:  # the gateway queues it on the ensemble's own stream
            assert httpx.post(server.url + url, content=mlp_body(np.ones(256, np.float32))).status_code == 200
            return bool(client.exists(stream)) and client.xinfo_groups(stream)[0]["entries-read"] >= 1

        with ThreadPoolExecutor(1) as pool:
            try:
                wait_until(run_by_the_worker, 30, what="the worker to run the ensemble")
                with worker_paused(server):
                    answer = pool.submit(httpx.post, server.url + url,
                                         content=mlp_body(np.ones(256, np.float32)), timeout=60)
                    wait_until(lambda: client.xlen(stream), 10, what="the request to be queued")
                    client.config_set("maxmemory", 1)  # noeviction, the default: writes that grow refused
                wait_until(lambda: "> 'maxmemory'" in server.logs(), 10, what="the ensemble's reply refused")
                client.config_set("maxmemory", 0)
                response = answer.result(timeout=50)
            finally:
                client.config_set("maxmemory", 0)
                client.close()
    assert response.status_code == 200, response.text
    assert "ensemble pipe: Redis refused a command of 1 replies' writes" in server.logs()
    assert "writing the replies again" in server.logs()
