"""The `despina` command as README.md has a newcomer run it: its lines and its errors."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from despina import serve as serve_module
from despina.embedded import START_FAILED, free_port
from despina.settings import Settings

from .conftest import Server, stop_server


def test_json_logs_are_json_lines_from_every_role(serve: Callable[..., Server], tmp_path: Path) -> None:
    """With --log-format json every line is a JSON object: the gateway's HTTP server (uvicorn) wrote its
    start and stop lines in its own text format among them, lines a log shipper could not parse."""
    repo = tmp_path / "repo"
    repo.mkdir()
    server = serve(repo, "--log-format", "json")
    assert stop_server(server) == 0
    lines = server.logs().splitlines()
    assert lines and [line for line in lines if not line.startswith("{")] == [], server.logs()
    records = [orjson.loads(line) for line in lines]
    assert any(r["role"] == "gateway" and r["message"].startswith("Started server process") for r in records)


def despina(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "despina", *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=60)


def test_a_gateway_that_cannot_start_stops_serve_however_long_its_start_took(
        tmp_path: Path, redis_url: str, key_prefix: str, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """A gateway that could not read its API key file was taken for one that crashed once up when its
    start (Python's imports on a busy machine) took 5 s or more: restarted, its line said twice, and serve
    stopped only at the second failure. It is judged by whether it said it was up now (despina/started.py)."""
    settings = Settings.from_sources({"model_repository": str(tmp_path), "http_port": free_port(),
                                      "metrics_port": 0, "redis_url": redis_url, "key_prefix": key_prefix,
                                      "api_keys_file": str(tmp_path / "nonexistent")}, {})
    assert serve_module.Supervisor(settings).run() == START_FAILED  # it said why it could not start
    said = capfd.readouterr().err
    assert said.count("gateway: cannot read the API keys file") == 1, said
    assert "restarting" not in caplog.text and "gateway exited with 3 at its start" in caplog.text, caplog.text


@pytest.mark.parametrize(("args", "said"), [
    (["serve", "--http-port", "abc"], "despina serve: argument --http-port: invalid int value: 'abc'"),
    (["serve", "--http_port", "8000"], "despina serve: unrecognized arguments: --http_port 8000"),
    (["ls"], "despina ls: the following arguments are required: registry"),
    (["serve", "--log-level", "loud"], "despina serve: argument --log-level: invalid choice: 'loud'"),
    (["sreve"], "despina: argument command: invalid choice: 'sreve'"),
])
def test_a_bad_command_line_is_one_line_that_names_it(args: list[str], said: str) -> None:
    """argparse printed the command's whole usage first (thirty lines for serve) and named an unknown
    option after `despina`'s, not the command's, usage."""
    r = despina(*args)
    assert r.returncode == 2 and r.stderr.startswith(said) and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.rstrip().endswith("--help)"), r.stderr


def test_a_models_own_folder_given_as_the_repository_is_refused_in_one_line(tmp_path: Path) -> None:
    """`--model-repository model_repository/mlp` served a model '1' that failed to load, "no config.pbtxt,
    and no model file Despina recognizes", and nothing else: Triton's layout wants the folder above."""
    model = tmp_path / "model_repository" / "mlp"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    for command in ("serve", "control"):
        r = despina(command, "--model-repository", str(model), "--redis-url", "redis://127.0.0.1:1/0")
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"despina {command}: DESPINA_MODEL_REPOSITORY (or --model-repository): "
                                   f"{model} is a model's own folder"), r.stderr
        assert f"give the folder that holds it, {model.parent}" in r.stderr, r.stderr


@pytest.mark.parametrize("layout", ["config and version", "version only"])
def test_ls_of_a_models_own_folder_is_refused_as_serve_refuses_it(tmp_path: Path, layout: str) -> None:
    """`despina ls model_repository/mlp` said "no models in model_repository/mlp" (or listed its version
    folders as models named 1, 2) and succeeded, where serve refuses that folder and names the one above."""
    model = tmp_path / "model_repository" / "mlp"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.onnx").write_bytes(b"onnx")
    if layout == "config and version":
        (model / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    r = despina("ls", str(model))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and not r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"despina ls: {model} is a model's own folder"), r.stderr
    assert f"give the folder that holds it, {model.parent}" in r.stderr, r.stderr
    r = despina("ls", str(model.parent))  # the repository itself lists the model
    assert r.returncode == 0 and r.stdout.startswith("mlp  versions 1"), (r.stdout, r.stderr)
