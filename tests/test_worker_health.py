"""A worker's health port (DESPINA_WORKER_HEALTH_PORT), which Kubernetes' probes ask: ready once the control plane
has placed it and every load placed on it has ended, loaded or failed. Without it a rolling update took a new
worker for ready at its start and stopped an old one while the new one still loaded."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from despina.embedded import free_port
from despina.redis_client import connect_worker
from despina.settings import Settings
from despina.workers import worker as worker_module
from despina.workers.health import readiness
from despina.workers.worker import Worker

from .conftest import Server
from .control_support import index, mlp_folder, wait_until

HELD = """
import os
import time
import triton_python_backend_utils as pb_utils

HOLD = {hold!r}


class TritonPythonModel:
    def initialize(self, args):
        while os.path.exists(HOLD):  # a load as slow as the test wants
            time.sleep(0.05)
        if {fail!r}:
            raise RuntimeError("this model cannot load")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
"""


def held_model(repo: Path, name: str, hold: Path, fail: bool = False) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(HELD.format(hold=str(hold), fail=fail))
    (repo / name / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n')


@contextmanager
def worker_process(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[str]:
    """`despina worker` with its health port; yields the port's URL."""
    port = free_port()
    log = (tmp_path / f"worker-{port}.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "despina", "worker", "--redis-url", redis_url,
                                "--key-prefix", key_prefix, "--worker-health-port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: live(url), 30, what="the worker's health port")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def live(url: str) -> bool:
    try:
        return httpx.get(f"{url}/livez", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def ready(url: str) -> tuple[int, dict[str, Any]]:
    r = httpx.get(f"{url}/readyz", timeout=5)
    return r.status_code, r.json()


def ready_once(url: str, check: Callable[[int, dict[str, Any]], bool], what: str) -> tuple[int, dict[str, Any]]:
    """The first /readyz answer that passes `check`."""
    def answer() -> tuple[int, dict[str, Any]] | None:
        status, body = ready(url)
        return (status, body) if check(status, body) else None
    found = wait_until(answer, 30, what=what)
    assert found is not None
    return found


def test_a_worker_is_ready_only_once_its_slow_load_ends(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo, hold = tmp_path / "repo", tmp_path / "hold"
    held_model(repo, "slow", hold)
    hold.touch()
    serve(repo, "--workers", "0", health="live")
    with worker_process(tmp_path, redis_url, key_prefix) as url:
        seen: list[int] = []  # every answer until the load shows: none ready before it was placed

        def loading(status: int, body: dict[str, Any]) -> bool:
            seen.append(status)
            return body["reason"] == "loading slow/1"  # (placed: the mark comes after the catalog)

        status, body = ready_once(url, loading, "the worker to load slow")
        assert set(seen) == {503} and body["loading"] == ["slow/1"] and not body["ready"], (seen, body)
        hold.unlink()
        status, body = ready_once(url, lambda s, _: s == 200, "ready")
        assert body == {"ready": True, "reason": "", "loading": [], "waiting_for_registry": {}, "failed": {}}


def test_a_worker_the_control_plane_gives_nothing_is_ready_after_its_placement(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp")
    serve(repo, wait_models=("mlp",))  # its own worker has mlp (replicas 1): the new one gets nothing
    with worker_process(tmp_path, redis_url, key_prefix) as url:
        status, body = ready_once(url, lambda s, _: s == 200, "ready")
        assert body["loading"] == [] and body["failed"] == {}, body


def test_a_failed_load_ends_as_ready_and_the_failure_shows(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo, hold = tmp_path / "repo", tmp_path / "hold"
    held_model(repo, "broken", hold, fail=True)
    hold.touch()  # not ready while it loads, before it fails
    server = serve(repo, "--workers", "0", health="live")
    with worker_process(tmp_path, redis_url, key_prefix) as url:
        wait_until(lambda: ready(url)[1]["loading"] == ["broken/1"], 30, what="the worker to load broken")
        assert ready(url)[0] == 503
        hold.unlink()
        wait_until(lambda: ready(url)[0] == 200, 30, what="ready after the failed load")
        [entry] = wait_until(lambda: [e for e in index(server.url) if e.get("reason")], 30,
                             what="the failure in the index")
        assert entry["state"] == "UNAVAILABLE" and "this model cannot load" in entry["reason"], entry


async def test_a_worker_no_control_plane_places_is_not_ready_and_says_why(
        redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(worker_module, "UNPLACED_WARN_S", 0.0)
    redis = connect_worker(redis_url)
    worker = Worker(Settings(redis_url=redis_url, key_prefix=key_prefix), redis)
    try:
        with caplog.at_level(logging.WARNING, logger="despina.worker"):
            await worker.sync()
        state = readiness(worker)
        assert not state["ready"] and state["reason"] == "no control plane leads", state
        assert f"worker {worker.id} is not ready: no control plane leads" in caplog.text
    finally:
        await redis.aclose()
