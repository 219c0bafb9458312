"""While no control plane runs (SIGKILLed; its Deployment restarts it in seconds to a minute): gateways and
workers serve on, a model scaled to zero is woken once one is back within the request's time (else 503,
Retry-After), and the repository commands sent meanwhile are run once, in order, the stale ones skipped."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from despina.contract.commands import LOAD, UNLOAD, Answer, Command
from despina.contract.keys import FIELD, Keys
from despina.embedded import die_with_parent, free_port

from .control_support import catalog_entry, infer, mlp_folder, wait_until

ROOT = Path(__file__).resolve().parents[1]


class Roles:
    """`despina control`, `worker` and `gateway` as processes of their own on one Redis and repository."""

    def __init__(self, tmp_path: Path, redis_url: str, prefix: str) -> None:
        self.tmp, self.redis_url, self.prefix = tmp_path, redis_url, prefix
        self.keys = Keys(prefix)
        self.repo = tmp_path / "repo"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def start(self, role: str, *extra: str, log: str = "") -> subprocess.Popen[bytes]:
        environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
        with (self.tmp / f"{log or role}.log").open("ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "despina", role, "--redis-url", self.redis_url, "--key-prefix", self.prefix,
                 *extra], stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=ROOT, preexec_fn=die_with_parent)
        self.processes.append(process)
        return process

    def control(self, *extra: str, log: str = "control") -> subprocess.Popen[bytes]:
        process = self.start("control", "--model-repository", str(self.repo), *extra, log=log)
        wait_until(lambda: b"leads (" in self.log(log), 30, what=f"{log} to lead")
        return process

    def gateway(self, *extra: str) -> None:
        port = free_port()
        self.start("gateway", "--http-port", str(port), *extra)
        self.url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 30, what="the gateway")

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL: it leaves its lease behind, which runs out LEASE_MS after its last renewal; here it runs
        out at once (the test would wait it out, and learn nothing more)."""
        process.kill()
        process.wait(10)
        client = redis.Redis.from_url(self.redis_url)
        try:
            client.delete(self.keys.control_leader)
        finally:
            client.close()

    def log(self, name: str) -> bytes:
        path = self.tmp / f"{name}.log"
        return path.read_bytes() if path.exists() else b""

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def roles(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[Roles]:
    started = Roles(tmp_path, redis_url, key_prefix)
    try:
        yield started
    finally:
        started.stop()


def test_commands_sent_while_no_control_plane_runs_run_once_in_order_and_stale_ones_not_at_all(
        roles: Roles, redis_url: str, key_prefix: str) -> None:
    """A load and the unload after it, queued while no control plane ran, ran in the wrong order when it came
    back: the unload found the model not yet in the catalog (the load was still reading the registry) and
    answered at once, without waiting its turn, so the model ended loaded."""
    mlp_folder(roles.repo)
    mlp_folder(roles.repo, "late")
    explicit = ("--model-control-mode", "explicit")
    first = roles.control(*explicit)
    roles.start("worker")
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: client.scard(keys.workers), 30, what="the worker")
        roles.kill(first)
        answers = keys.control_answers("test")
        now = time.time()
        stale = Command(uuid.uuid4().hex, LOAD, "late", {}, now + 0.5, answers)  # its caller gave up
        fresh = [Command(uuid.uuid4().hex, op, "mlp", {}, now + 60, answers)
                 for op in (LOAD, UNLOAD, LOAD, UNLOAD)]
        for command in (stale, *fresh):
            client.xadd(keys.control_commands, {FIELD: command.dumps()})
        wait_until(lambda: time.time() > stale.deadline, 5, what="the stale command's deadline")
        roles.control(*explicit, log="back")
        got: list[Answer] = []
        deadline = time.monotonic() + 30
        while len(got) < len(fresh) and time.monotonic() < deadline:
            if (popped := client.blpop([answers], 1)) is not None:
                got.append(Answer.loads(popped[1]))
        assert sorted(a.id for a in got) == sorted(c.id for c in fresh), got
        assert all(a.result() is None for a in got)  # (result() raises an answer's error)
        entry = wait_until(lambda: catalog_entry(redis_url, key_prefix, "mlp"), 10, what="mlp's entry")
        assert entry.target == "unloaded", entry  # the last one sent was an unload
        said = [line.split("model mlp: ")[1] for line in roles.log("back").decode().splitlines()
                if "model mlp: " in line]
        assert [s.split()[0] for s in said] == ["loading", "unloading", "loading", "unloading"], said
        assert catalog_entry(redis_url, key_prefix, "late") is None  # the stale load was not run
        assert client.xlen(keys.control_commands) == 0 and client.llen(answers) == 0  # each answered once
    finally:
        client.close()


def test_a_model_scaled_to_zero_is_woken_by_a_control_plane_back_within_the_request_s_time(
        roles: Roles, redis_url: str, key_prefix: str) -> None:
    """A request for a model scaled to zero while no control plane runs waits for one: answered once it is
    back within the request's time, else 503 with Retry-After (not a 500, not a hang)."""
    timeout = 5.0
    mlp_folder(roles.repo, extra='parameters { key: "idle_timeout_s" value: { string_value: "0.5" } }')
    control = roles.control()
    roles.start("worker")
    roles.gateway("--request-timeout", str(timeout))
    assert infer(roles.url).status_code == 200

    def scaled_to_zero() -> bool:
        entry = catalog_entry(redis_url, key_prefix, "mlp")
        return entry is not None and entry.target == "idle"

    with ThreadPoolExecutor(1) as pool:
        wait_until(scaled_to_zero, 15, what="mlp to scale to zero")
        roles.kill(control)
        waiting = pool.submit(infer, roles.url, timeout=3 * timeout)
        time.sleep(0.5)  # (not a bet: the request may reach the gateway before the control plane or after)
        assert not waiting.done(), waiting.result().text
        control = roles.control(log="back")
        r = waiting.result()
        assert r.status_code == 200, r.text

        wait_until(scaled_to_zero, 15, what="mlp to scale to zero again")
        roles.kill(control)
        sent = time.monotonic()
        # a client that waits as long as the server does gets the 503, not its own timeout: it came a second
        # late (the gateway waited that long past the request's time for the control plane's answer)
        r = infer(roles.url, timeout=timeout)
        took = time.monotonic() - sent
    assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.headers, r.text)
    assert "the control plane did not answer 'wake'" in r.text and "despina control" in r.text, r.text
    assert timeout - 0.5 < took < timeout, took
