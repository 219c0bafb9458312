"""Hosts whose clocks differ (despina/clock.py): a worker or a control plane whose wall clock is off by
seconds, faked with libfaketime on that process alone (its monotonic clock left true), works on Redis's
time, and says that its clock is off. Skipped where libfaketime is not installed (Debian: faketime)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import redis

from despina.contract.keys import Keys
from despina.embedded import die_with_parent, free_port

from .conftest import ROOT, Server
from .control_support import ROW, expected, mlp_folder, wait_until

LIBFAKETIME = next((p for p in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                                "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                                "/usr/lib/faketime/libfaketime.so.1", "/usr/local/lib/faketime/libfaketime.so.1")
                    if Path(p).exists()), None)
pytestmark = pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime is not installed (apt-get install faketime)")


def faked(offset: str) -> dict[str, str]:
    """The environment of a process whose wall clock is `offset` ("+5s", "-30s") off; time.monotonic true."""
    assert LIBFAKETIME is not None
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1"}


@pytest.fixture
def role(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[Callable[..., Path]]:
    """Start `despina <role>` on the test's Redis and key prefix; its log's path. Stopped after the test."""
    started: list[subprocess.Popen[bytes]] = []
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> Path:
        log = tmp_path / f"{name}-{len(started)}.log"
        with log.open("wb") as out:
            started.append(subprocess.Popen(
                [sys.executable, "-m", "despina", name, "--redis-url", redis_url, "--key-prefix", key_prefix,
                 *args], stdout=out, stderr=subprocess.STDOUT, env={**environ, **(env or {})}, cwd=ROOT,
                preexec_fn=die_with_parent))
        return log

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
    for process in started:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def ready(url: str, model: str = "mlp") -> bool:
    try:
        return httpx.get(f"{url}/v2/models/{model}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def infer(url: str) -> httpx.Response:
    return httpx.post(f"{url}/fn/mlp", json=ROW, timeout=30)


def test_a_worker_whose_clock_is_ahead_runs_requests_within_their_deadline(
        serve: Callable[..., Server], role: Callable[..., Path], tmp_path: Path, redis_url: str,
        key_prefix: str) -> None:
    """A worker 5 s ahead of the gateway compared each request's deadline (the gateway's clock + 3 s) with
    its own clock: every request was answered 504 "past its deadline" unrun. On Redis's time they run, and
    the worker's log and its status on the control plane's page say that its clock is off."""
    repo = tmp_path / "repo"
    mlp_folder(repo)
    server = serve(repo, "--workers", "0", "--request-timeout", "3", health="live")
    log = role("worker", env=faked("+5s"))
    wait_until(lambda: ready(server.url), 60, what="the faked worker to load mlp")
    for _ in range(5):
        r = infer(server.url)
        assert r.status_code == 200, r.text
        assert np.allclose(r.json()["y"], expected(0), atol=1e-4)
    assert "s ahead of Redis's" in log.read_text()
    # the page samples Redis every 2 s (control/status.py PERIOD_S): its first sample may predate the worker
    page = server.metrics_url.replace("/metrics", "/status.json")
    wait_until(lambda: len(httpx.get(page, timeout=10).json()["workers"]) == 1, 10, what="the status page's worker")
    workers = httpx.get(page, timeout=10).json()["workers"]
    assert len(workers) == 1 and "ahead of Redis's" in workers[0]["clock_warning"], workers
    assert -5.5 < workers[0]["clock_offset_s"] < -4.5


def cluster(role: Callable[..., Path], repo: Path, control_env: dict[str, str], *control: str) -> tuple[str, Path]:
    """A control plane (its environment `control_env`), a worker and a gateway, each a process of its own:
    the gateway's URL and the control plane's log."""
    log = role("control", "--model-repository", str(repo), "--metrics-port", "0", *control, env=control_env)
    role("worker")
    url = f"http://127.0.0.1:{free_port()}"
    role("gateway", "--http-port", url.rsplit(":", 1)[1])
    wait_until(lambda: ready(url), 60, what="mlp to serve")
    return url, log


def loaded(redis_url: str, prefix: str) -> bool:
    """Whether a worker's model table holds mlp."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = Keys(prefix)
        ids = [m.decode() for m in client.smembers(keys.workers)]
        return any("mlp" in orjson.loads(client.hget(keys.worker(w), "models") or b"{}") for w in ids)
    finally:
        client.close()


def test_a_control_plane_whose_clock_is_behind_scales_an_idle_model_to_zero_on_time(
        role: Callable[..., Path], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A control plane 30 s behind the worker read the model's last inference (the worker's clock) as 30 s
    in its future: a model with a 2 s idle timeout stayed loaded 32 s after its last request. On Redis's
    time it goes about 2 s after, and the control plane's log says that its clock is off."""
    repo = tmp_path / "repo"
    mlp_folder(repo)
    url, log = cluster(role, repo, faked("-30s"), "--idle-timeout", "2")
    assert infer(url).status_code == 200
    wait_until(lambda: not loaded(redis_url, key_prefix), 15, what="mlp to be scaled to zero")
    assert "s behind Redis's" in log.read_text()


def test_a_control_plane_whose_clock_is_ahead_answers_the_gateways_commands(
        role: Callable[..., Path], tmp_path: Path) -> None:
    """A control plane 40 s ahead took every command a gateway sent with less than 40 s to go for expired,
    and answered none: the repository index (30 s), and a cold start's wake (the request's timeout), failed.
    On Redis's time they are answered; a model scaled to zero comes back for its request."""
    repo = tmp_path / "repo"
    mlp_folder(repo)
    url, _ = cluster(role, repo, faked("+40s"), "--idle-timeout", "1")
    r = httpx.post(f"{url}/v2/repository/index", json={}, timeout=40)
    assert r.status_code == 200 and [m["name"] for m in r.json()] == ["mlp"], r.text
    wait_until(lambda: not ready(url), 30, what="mlp to be scaled to zero")
    r = infer(url)
    assert r.status_code == 200, r.text
    assert np.allclose(r.json()["y"], expected(0), atol=1e-4)
