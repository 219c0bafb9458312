"""The `despina` command as README.md has a newcomer run it: its lines and its errors."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

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
