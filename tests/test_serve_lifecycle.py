"""`despina serve`'s judgement of its roles' exits: a start that failed stops everything, however long it
took; a crash once up is restarted, however soon after its start, with a backoff and a cap."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from despina.contract.keys import Keys
from despina.embedded import START_FAILED, die_with_parent, free_port

from .conftest import Server, descendants, stop_server

# serve with a change to its module first (a constant patched), then as `despina serve` would run
LAUNCH = "import sys; from despina import cli, serve; {}; sys.exit(cli.main())"


def launch(tmp_path: Path, redis_url: str, key_prefix: str, *args: str, patch: str = "pass") -> Server:
    """serve (no workers, an empty repository unless `args` say otherwise) against the test Redis."""
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    port = free_port()
    log = tmp_path / f"serve-{uuid.uuid4().hex[:6]}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", LAUNCH.format(patch), "serve", "--model-repository", str(repo), "--workers", "0",
             "--redis-url", redis_url, "--key-prefix", key_prefix, "--http-port", str(port), "--metrics-port", "0",
             *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
    return Server(f"http://127.0.0.1:{port}", process, log)


def ended(server: Server, timeout: float = 60) -> tuple[int | None, str, set[int]]:
    """serve's exit status once it stopped on its own (None: still running after `timeout`, then stopped
    with every process below it), its output, and the processes seen below it meanwhile."""
    family: set[int] = set()
    deadline = time.monotonic() + timeout
    while server.process.poll() is None and time.monotonic() < deadline:
        family |= descendants(server.process.pid)
        time.sleep(0.05)
    code = server.process.poll()
    if code is None:
        stop_server(server, signal.SIGKILL, timeout=10)  # (its roles too: each has a process group of its own)
    return code, server.logs(), family


def running(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def up(server: Server, role: str, count: int = 1, timeout: float = 60) -> int:
    """The pid of the `count`-th start of `role` (its name in serve's log) that serve heard was up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = re.findall(rf"serve\[\d+\] INFO {role} is up \(pid (\d+)\)", server.logs())
        if len(pids) >= count:
            return int(pids[count - 1])
        assert server.process.poll() is None, server.logs()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"{role} not up {count} time(s) within {timeout} s:\n{server.logs()[-3000:]}")


def test_a_control_plane_that_meets_another_programs_catalog_stops_serve_in_one_line(
        tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Its first read of the catalog, once it leads, was refused (WRONGTYPE): a traceback and exit 1, and
    serve, judging by the time since the spawn, stopped only when that took under 5 s; on a loaded machine
    it restarted the control plane at once, for ever. Now: one line, START_FAILED, nothing restarted."""
    with redis.Redis.from_url(redis_url) as r:
        r.set(Keys(key_prefix).catalog, "another program's")
    code, out, family = ended(launch(tmp_path, redis_url, key_prefix))
    said = re.findall(r"control: cannot start: (.*)", out)
    assert said == ["Redis refused a command (WRONGTYPE Operation against a key holding the wrong kind of value): "
                    "another program's key under this key prefix? (--key-prefix)"], out
    assert code == START_FAILED and "Traceback" not in out and "restarting" not in out, out
    assert "control exited with 3 at its start; stopping everything" in out, out
    assert not running(family)


def test_a_role_that_fails_before_it_is_up_stops_serve_however_long_its_start_took(
        tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cause serve has no words for (here the control plane's interpreter exiting 1 as it starts, as one
    whose import failed would) fails the start too: it stops everything with START_FAILED, once, whether
    the start took a second or a minute. (A catalog entry that is not JSON was the cause here until the
    control plane learnt to skip one.)"""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, sys\nif 'control' in sys.argv:\n    os._exit(1)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    code, out, family = ended(launch(tmp_path, redis_url, key_prefix))
    assert code == START_FAILED, out
    assert out.count("control exited with 1 at its start; stopping everything") == 1, out
    assert "restarting" not in out, out
    assert not running(family)


def test_a_gateway_that_crashes_once_up_is_restarted_however_soon(
        tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A gateway killed within 5 s of its spawn was taken for one that could not start, and serve stopped
    everything: a machine that starts it fast made every early crash fatal."""
    server = launch(tmp_path, redis_url, key_prefix)
    try:
        first = up(server, "gateway")
        os.kill(first, signal.SIGKILL)
        second = up(server, "gateway", 2)
        assert second != first and server.process.poll() is None
        assert "gateway exited with -9; restarting it\n" in server.logs(), server.logs()[-3000:]
        assert stop_server(server) == 0
    finally:
        stop_server(server)


def test_a_gateway_that_crashes_again_and_again_is_restarted_later_each_time_then_given_up_on(
        tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Restarted at once for ever, a role that crashes once up (a model that kills it, a host short of
    memory) spun serve and the log; now it waits longer after each crash, and the fifth within a minute
    stops everything. (The window is made an hour here: on a loaded machine five starts may take a minute.)"""
    server = launch(tmp_path, redis_url, key_prefix, patch="serve.CRASH_WINDOW_S = 3600.0")
    try:
        for count in range(1, 6):
            os.kill(up(server, "gateway", count), signal.SIGKILL)
        code, out, family = ended(server)
    finally:
        stop_server(server)
    waits = re.findall(r"gateway exited with -9; restarting it(?: in (\S+) s)?\n", out)
    assert waits == ["", "1", "2", "4"], out
    assert code == 1 and "gateway exited with -9, its 5th exit within 3600 s; stopping everything" in out, out
    assert not running(family)
