"""An idle `despina serve` sleeps until there is something to do. A platform that scales its models to
zero still runs the supervisor, the gateway and the control plane: each wake-up of theirs costs CPU on
a shared core, and they used to wake several times a second for nothing (the supervisor's poll of its
children, five times a second; uvicorn's tick, ten times a second in the gateway and in the control
plane). What they still wake for is their own work: the gateway's model view, the control plane's
lifecycle tick, status samples and blocking reads."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from .conftest import Server
from .control_support import mlp_folder
from .reliability_support import role_pids

WINDOW_S = 5.0
SETTLE_S = 60.0  # how long a loaded machine may take to finish the start's and the request's own work
# wake-ups a second, at most. Against the machine's Redis, before: 5.0, 14-16 and 20-21 a second; now
# 0.2, 4-6 and 7-9 (the control plane's are its lifecycle tick's round trips, three a second, its status
# sample's, three every two seconds, and its blocking reads). bench/profile.py idle gives the figures.
BOUNDS = {"serve": 1.0, "gateway": 10.0, "control": 16.0}


def wakeups(pid: int) -> int:
    """How often a process's main thread (its event loop) went to sleep and was woken: its voluntary context
    switches. (bench/profile.py idle counts every thread's.)"""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:", 1)[1].split()[0])


def per_second(pids: dict[str, list[int]]) -> dict[str, float]:
    """Each role's wake-ups a second over one window (its length as it came: a sleep may overrun)."""
    before = {role: sum(wakeups(p) for p in ps) for role, ps in pids.items()}
    start = time.monotonic()
    time.sleep(WINDOW_S)
    elapsed = time.monotonic() - start
    return {role: (sum(wakeups(p) for p in ps) - before[role]) / elapsed for role, ps in pids.items()}


def test_an_idle_serve_wakes_for_its_work_alone(serve: Callable[..., Server], tmp_path: Path) -> None:
    mlp_folder(tmp_path / "repo")
    server = serve(tmp_path / "repo", wait_models=("mlp",))
    assert httpx.post(f"{server.url}/v2/models/mlp/infer", json={"inputs": [
        {"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]}).status_code == 200
    pids = {"serve": [server.process.pid], "gateway": role_pids(server, "gateway"),
            "control": role_pids(server, "control")}
    # the first quiet window passes: the start's and the request's own work may take a loaded machine
    # longer than one window, but a wake-up that comes for nothing comes in every window
    deadline = time.monotonic() + SETTLE_S
    per_s = per_second(pids)
    while any(per_s[role] >= bound for role, bound in BOUNDS.items()):
        assert time.monotonic() < deadline, per_s
        per_s = per_second(pids)
    # and each still stops at once when told to
    server.process.terminate()
    assert server.process.wait(30) == 0
