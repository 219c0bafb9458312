"""/v2/health/ready as Triton's --strict-readiness says (default true): ready only while every model asked
to load serves; a model that failed to load keeps the server not ready. --strict-readiness=false: ready once
every model asked to load has settled, loaded or failed. (Triton 2.51, compared side by side: a repository of
a good and a broken model answers 400 for good, 200 with --strict-readiness=false; explicit mode with no
model loaded answers 200.)"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from .conftest import Server
from .control_support import mlp_folder, wait_until


def good_and_broken(repo: Path) -> Path:
    mlp_folder(repo, "mlp")
    broken = mlp_folder(repo, "broken")
    (broken / "1" / "model.onnx").write_bytes(b"not an onnx model")  # fails on the worker
    return repo


def ready(server: Server) -> int:
    return httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code


def settled(server: Server) -> None:
    """Wait until mlp serves and broken's load has failed (its index row says why)."""
    def failed() -> bool:
        rows = httpx.post(f"{server.url}/v2/repository/index", json={}, timeout=10).json()
        return any(r["name"] == "broken" and r.get("state") == "UNAVAILABLE" and r.get("reason") for r in rows)
    wait_until(failed, 60, what="broken's load to fail")
    wait_until(lambda: httpx.get(f"{server.url}/v2/models/mlp/ready").status_code == 200, 60, what="mlp")


def test_a_model_that_failed_to_load_keeps_the_server_not_ready(serve: Callable[..., Server],
                                                                 tmp_path: Path) -> None:
    server = serve(good_and_broken(tmp_path / "repo"), health="live")
    settled(server)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        assert ready(server) == 400, server.logs()[-2000:]
        time.sleep(0.2)
    assert httpx.get(f"{server.url}/readyz").status_code == 200  # the gateway itself takes requests


def test_a_config_that_cannot_be_used_keeps_the_server_not_ready(serve: Callable[..., Server],
                                                                  tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp")
    (mlp_folder(repo, "bad") / "config.pbtxt").write_text('backend: "onnxruntime"\nbatch_size: 3\n')
    server = serve(repo, health="live", wait_models=("mlp",))
    wait_until(lambda: "model 'bad'" in server.logs(), 30)
    assert ready(server) == 400


def test_not_strict_a_failed_load_is_let_be(serve: Callable[..., Server], tmp_path: Path) -> None:
    server = serve(good_and_broken(tmp_path / "repo"), "--strict-readiness=false", health="live")
    settled(server)
    wait_until(lambda: ready(server) == 200, 30, what="ready")


def test_explicit_mode_with_nothing_loaded_is_ready_and_a_failed_load_makes_it_not(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    server = serve(good_and_broken(tmp_path / "repo"), "--model-control-mode", "explicit", health="live")
    wait_until(lambda: ready(server) == 200, 30, what="ready")
    r = httpx.post(f"{server.url}/v2/repository/models/broken/load", timeout=60)
    assert r.status_code == 400, r.text
    assert ready(server) == 400
