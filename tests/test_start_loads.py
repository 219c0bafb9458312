"""What `--load-model` names at start must load, as Triton's --exit-on-error says (README, "Model control
modes"): real serve processes, their exit status and their one line."""
from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from despina.embedded import START_FAILED, free_port

from .conftest import Server
from .control_support import index, wait_until

ROW = orjson.dumps([0.25] * 256)


def broken_copy(example_repository: Path, repo: Path) -> None:
    """The example MLP, and a copy of it whose model file is no ONNX model: it fails on the worker."""
    shutil.copytree(example_repository / "mlp", repo / "mlp")
    shutil.copytree(example_repository / "mlp", repo / "broken")
    config = repo / "broken" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "mlp"', 'name: "broken"'))
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not a model")


def serve_to_its_end(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "despina", "serve", "--model-repository", str(repo),
                           "--http-port", str(free_port()), "--metrics-port", "0",
                           "--model-control-mode", "explicit", *args],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=120)


@pytest.mark.parametrize(("model", "said"), [
    ("nosuch", "--load-model nosuch: no model 'nosuch' in the repository"),
    ("broken", "--load-model broken: failed to load 'broken' version 1: "),
])
def test_a_load_model_that_cannot_load_stops_the_start_as_tritons(
        example_repository: Path, tmp_path: Path, model: str, said: str) -> None:
    """Triton exits at start ("failed to load all models") when a --load-model model is missing or fails to
    load; serve served on without it, ready, and a deployment that misspelt its model looked healthy."""
    broken_copy(example_repository, tmp_path / "repo")
    r = serve_to_its_end(tmp_path / "repo", "--load-model", "mlp", "--load-model", model)
    assert r.returncode == START_FAILED, r.stderr
    reason = [line for line in r.stderr.splitlines() if line.startswith("control: failed to load all models")]
    assert len(reason) == 1 and said in reason[0], r.stderr
    assert "Traceback" not in r.stderr and "restarting" not in r.stderr, r.stderr


def test_exit_on_error_false_serves_on_without_the_model(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path) -> None:
    """Triton's --exit-on-error=false: the start goes on, the other models serve, the index says why."""
    repo = tmp_path / "repo"
    broken_copy(example_repository, repo)
    server = serve(repo, "--model-control-mode", "explicit", "--exit-on-error=false", "--load-model", "mlp",
                   "--load-model", "broken", "--load-model", "nosuch", health="live", wait_models=("mlp",))
    broken = wait_until(lambda: {r["name"]: r for r in index(server.url)}["broken"].get("state") == "UNAVAILABLE",
                        60, what="broken to fail on the worker")
    assert broken
    assert server.process.poll() is None, server.logs()[-3000:]
    assert httpx.post(f"{server.url}/fn/mlp", content=ROW).status_code == 200
    assert "failed to load all models" not in server.logs()


def test_exit_on_error_takes_tritons_spelling_and_its_variable() -> None:
    from despina.cli import parser, settings_of

    for argv, env, expected in ((["--exit-on-error=false"], {}, False), (["--exit-on-error"], {}, True),
                                ([], {"DESPINA_EXIT_ON_ERROR": "false"}, False), ([], {}, True),
                                (["--exit-on-error=true"], {"DESPINA_EXIT_ON_ERROR": "0"}, True)):
        args = parser().parse_args(["serve", *argv])
        assert settings_of(args, env).exit_on_error is expected, (argv, env)
    r = subprocess.run([sys.executable, "-m", "despina", "serve", "--exit-on-error=maybe"], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "argument --exit-on-error: expected true or false, got 'maybe'" in r.stderr, r.stderr
