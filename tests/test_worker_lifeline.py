"""A batch run on the worker's event loop that its model's cost did not foresee (execution.py) holds the
loop, and with it the worker's heartbeat (presence.py): past DESPINA_WORKER_TTL_S the control plane took
the worker for dead, moved its models and requeued what it had read, while it was only working. A thread
of the worker renews the heartbeat's expiry meanwhile (workers/lifeline.py); a worker that stopped
(SIGSTOP), or whose batch holds the loop past DESPINA_VISIBILITY_TIMEOUT_S, still expires."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import redis
import torch

from despina.contract.keys import Keys
from despina.settings import Settings
from despina.workers.execution import timed
from despina.workers.lifeline import Lifeline

from .conftest import Server, settled_stats
from .control_support import wait_until
from .reliability_support import role_pids

TTL = {"DESPINA_WORKER_TTL_S": "1.5"}
SHORT = 50
DEAD = "stopped sending heartbeats"  # the control plane's log line for a worker taken for dead
HELD = "held the worker's loop"  # the worker's line for a long batch run on its loop (execution.py)
ROUNDS = 1e9  # a batch's rounds: more than any test waits for (exact in FP32)
SPIN = '''
name: "spin"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 1 ] } ]
'''


class Spin(torch.nn.Module):
    """A data-dependent loop on the CPU: it goes round as many times as the batch's first value says, or
    until the first byte of the file `release` is set (the test says how long a batch holds the loop, not
    a rate measured beforehand on a host whose speed moves 2x within minutes)."""

    def __init__(self, release: str) -> None:
        super().__init__()
        self.release = release

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(x)
        for _ in range(int(x[0, 0].item())):
            if int(torch.from_file(self.release, size=1, dtype=torch.uint8)[0]) != 0:
                break
            y = y + 1.0
        return y - y + x


def spin_model(repo: Path, release: Path) -> None:
    """The spin model in `repo`, its batches let go by `let_go(release)`."""
    folder = repo / "spin"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(SPIN)
    release.write_bytes(b"\0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.script(Spin(str(release)))
    module.save(str(folder / "1" / "model.pt"))


def let_go(release: Path) -> None:
    """End the batch going round: set the byte in place (the model maps it, and must never find the file
    empty, as a rewrite leaves it for a moment)."""
    with release.open("r+b") as f:
        f.write(b"\1")


def infer(server: Server, value: float, timeout: float = 60) -> httpx.Response:
    body = {"inputs": [{"name": "INPUT__0", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    return httpx.post(f"{server.url}/v2/models/spin/infer", content=orjson.dumps(body), timeout=timeout,
                      headers={"content-type": "application/json"})


def short_batches(server: Server) -> None:
    """Batches of no rounds: the model's cost says its batches are short, and they run on the loop (the
    first runs of a TorchScript model are long, and a moving average forgets them over tens of batches)."""
    for _ in range(SHORT):
        response = infer(server, 0.0)
        assert response.status_code == 200, response.text
        assert orjson.loads(response.content)["outputs"][0]["data"] == [0.0]


def membership(redis_url: str, key_prefix: str) -> Callable[[], bool]:
    """Whether the one worker of the prefix is alive to the others: a member, its heartbeat hash there."""
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_url)

    def alive() -> bool:
        members = client.smembers(keys.workers)
        return len(members) == 1 and bool(client.exists(keys.worker(next(iter(members)).decode())))
    return alive


def test_a_batch_that_holds_the_loop_past_the_ttl_leaves_the_worker_alive(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Its heartbeat's expiry renewed from a thread while the batch runs: the worker stays a member all
    along, the request is answered once and runs once, and no other request is refused meanwhile."""
    release = tmp_path / "release"
    spin_model(tmp_path / "repo", release)
    server = serve(tmp_path / "repo", env=TTL, wait_models=("spin",))
    short_batches(server)
    alive = membership(redis_url, key_prefix)
    assert alive()
    hold_s = 2 * float(TTL["DESPINA_WORKER_TTL_S"]) + 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(infer, server, ROUNDS)
        try:
            started, gaps = time.monotonic(), []
            while time.monotonic() - started < hold_s and not held.done():
                if not alive():
                    gaps.append(round(time.monotonic() - started, 1))
                time.sleep(0.05)
        finally:
            let_go(release)
        response = held.result()
    assert response.status_code == 200, response.text
    assert orjson.loads(response.content)["outputs"][0]["data"] == [ROUNDS]
    held_ms = re.findall(HELD + r" for (\d+) ms", server.logs())
    assert held_ms, "the batch did not run on the worker's loop"
    assert int(held_ms[0]) > 2e3 * float(TTL["DESPINA_WORKER_TTL_S"]), held_ms  # past the TTL, twice
    assert not gaps, f"the worker was not alive to the others at {gaps} s of the {hold_s:.1f} s batch"
    assert DEAD not in server.logs()
    stats = settled_stats(server.url, "spin")
    assert stats["inference_count"] == SHORT + 1, stats  # none ran twice
    assert infer(server, 0.0).status_code == 200


def test_a_stopped_worker_and_one_held_past_the_visibility_timeout_expire(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """What the thread renews is work the worker is doing: a worker whose process stopped is taken for dead
    within its TTL, as is one whose batch holds its loop past DESPINA_VISIBILITY_TIMEOUT_S (its requests are
    taken for its consumer's dead then anyway)."""
    release = tmp_path / "release"
    spin_model(tmp_path / "repo", release)
    server = serve(tmp_path / "repo", env={**TTL, "DESPINA_VISIBILITY_TIMEOUT_S": "3"}, wait_models=("spin",))
    short_batches(server)
    alive = membership(redis_url, key_prefix)
    (worker,) = role_pids(server, "worker")
    os.kill(worker, signal.SIGSTOP)
    try:
        wait_until(lambda: not alive(), 10, what="the stopped worker to expire")
    finally:
        os.kill(worker, signal.SIGCONT)
    wait_until(alive, 30, what="the worker to come back")
    wait_until(lambda: infer(server, 0.0).status_code == 200, 30, what="the model to serve again")
    short_batches(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(infer, server, ROUNDS)
        try:
            started = time.monotonic()
            wait_until(lambda: not alive() or held.done(), 30, what="the held worker to expire")
            expired = time.monotonic() - started
            assert not held.done(), held.result().text
        finally:
            let_go(release)
        held.result()
    assert expired < 3 + 1.5 + 2, f"expired {expired:.1f} s into the batch"



async def test_only_a_batch_holding_the_loop_renews_what_is_there_and_only_until_stopped(
        redis_url: str, key_prefix: str) -> None:
    """The thread renews the heartbeat hash's and the mark's expiry while the loop is inside a batch's call,
    not while anything else holds it; it creates neither (a key gone stays gone), and renews nothing once
    stopped, its thread and connection gone."""
    keys, client = Keys(key_prefix), redis.Redis.from_url(redis_url)
    worker_hash, mark = keys.worker("w"), keys.worker_mark("w")

    def beat() -> None:  # what the loop's heartbeat would write, both keys expiring in 1 s
        client.hset(worker_hash, "seen", 1)
        client.pexpire(worker_hash, 1000)
        client.set(mark, 1, px=1000)
        lifeline.beaten = time.monotonic()

    def batch(seconds: float) -> None:  # a batch's call, on the loop
        timed(lambda inputs, names: time.sleep(seconds) or {}, {}, [])

    lifeline = Lifeline(Settings(redis_url=redis_url, key_prefix=key_prefix, worker_ttl_s=1.0), keys, "w", 0.25)
    watching = asyncio.create_task(lifeline.run())
    try:
        await asyncio.sleep(0.1)
        beat()
        time.sleep(2)  # the loop held, not by a batch
        assert not client.exists(worker_hash)
        beat()
        batch(2)
        assert client.pttl(worker_hash) > 0 and client.pttl(mark) > 1000  # the mark: the reply TTL's
        client.delete(worker_hash, mark)  # the worker left, or Redis lost its data
        batch(1)
        assert not client.exists(worker_hash, mark)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert not [t for t in threading.enumerate() if t.name == "despina-lifeline"]
    beat()
    batch(2)
    assert not client.exists(worker_hash, mark)
    client.close()


async def test_a_busy_loop_of_short_batches_is_not_a_held_loop(redis_url: str, key_prefix: str) -> None:
    """A loop busy with many short batches, looked at while its heartbeat is late: each look finds it in
    some batch's call, never the same one twice. Nothing is renewed (nor warned of): it renewed, and told
    the operator that a batch held the loop, whenever a heartbeat came a little late on a busy worker."""
    keys, client = Keys(key_prefix), redis.Redis.from_url(redis_url)
    worker_hash = keys.worker("w")
    lifeline = Lifeline(Settings(redis_url=redis_url, key_prefix=key_prefix, worker_ttl_s=1.0), keys, "w", 0.25)
    watching = asyncio.create_task(lifeline.run())

    def short(inputs: dict[str, object], names: list[str]) -> dict[str, object]:
        until = time.perf_counter() + 0.0002
        while time.perf_counter() < until:
            pass
        return {}

    try:
        client.hset(worker_hash, "seen", 1)
        client.pexpire(worker_hash, 1000)
        lifeline.beaten = time.monotonic() - 0.3  # the heartbeat late, and staying so
        end = time.monotonic() + 2
        while time.monotonic() < end:
            timed(short, {}, [])  # (most of the loop's time inside a batch's call, each a new one)
            await asyncio.sleep(0)
        assert not client.exists(worker_hash)  # left to expire: no batch held the loop
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        client.delete(worker_hash)
        client.close()
