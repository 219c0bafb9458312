"""The session's guard against leftovers (tests/leftovers.py): a control plane that outlives its test's
cleanup writes the catalog's marker and its command stream again, which a full run once left in Redis with
nothing to say which test had."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from despina.contract.keys import Keys
from despina.embedded import die_with_parent

from . import leftovers
from .conftest import LATE_WRITE_S, ROOT, Server, delete_prefix, descendants, new_prefix, started, stop_server
from .control_support import wait_until


def test_a_control_plane_left_running_past_its_cleanup_is_named_with_what_it_wrote(tmp_path: Path,
                                                                                    redis_url: str) -> None:
    prefix = new_prefix()
    keys = Keys(prefix)
    client = redis.Redis.from_url(redis_url)
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
    plane = subprocess.Popen([sys.executable, "-m", "despina", "control", "--redis-url", redis_url, "--key-prefix",
                              prefix, "--model-repository", str(tmp_path), "--metrics-port", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=environ, cwd=ROOT,
                             preexec_fn=die_with_parent)
    try:
        wait_until(lambda: client.exists(keys.catalog_published), 60, what="the catalog published")
        delete_prefix(redis_url, prefix)  # the test's cleanup, with its control plane still running
        leftovers.deleted(prefix, "this test")
        wait_until(lambda: client.exists(keys.catalog_published, keys.control_commands) == 2, 30,
                   what="the catalog published again")
        assert leftovers.stop_roles({plane.pid}) == [f"{plane.pid}: {' '.join(plane.args)}"]  # type: ignore[arg-type]
        plane.wait(30)
        found = leftovers.left_keys(redis_url)
        for key in (keys.catalog_published, keys.control_commands):
            assert any(f": {key} (left by this test)" in line for line in found), found
        assert not client.exists(keys.catalog_published, keys.control_commands)  # deleted as found
        assert leftovers.live_roles({plane.pid}) == {}
    finally:
        plane.kill()
        plane.wait()
        delete_prefix(redis_url, prefix)
        leftovers.DELETED.pop(prefix, None)
        client.close()


def test_a_test_database_other_than_0_is_watched_with_database_0() -> None:
    """What took the machine's REDIS_URL (no database: 0) instead of the test's writes there."""
    dbs = [c.connection_pool.connection_kwargs.get("db", 0) for c in leftovers.clients("redis://127.0.0.1:1/12")]
    assert dbs == [12, 0]
    assert [c.connection_pool.connection_kwargs.get("db", 0)
            for c in leftovers.clients("redis://127.0.0.1:1/0")] == [0]


def test_a_serve_killed_at_its_stop_timeout_leaves_none_of_its_roles_running(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """stop_server killed a serve that outlasted its timeout (its drain may take 30 s, the timeout's length),
    and returned while the roles, each in a process group of its own, still ran: the test's keys were
    deleted under a control plane that went on."""
    (tmp_path / "repo").mkdir()
    server = serve(tmp_path / "repo", health="live")
    roles = descendants(server.process.pid)
    assert len(leftovers.live_roles(roles)) >= 3  # control, worker, gateway
    stop_server(server, timeout=0)  # killed at once, as at a timeout
    assert leftovers.live_roles(roles) == {}
    delete_prefix(redis_url, key_prefix)
    time.sleep(LATE_WRITE_S)
    client = redis.Redis.from_url(redis_url)
    try:
        assert not client.exists(Keys(key_prefix).catalog_published)
    finally:
        client.close()


def test_a_gateway_that_a_test_starts_beside_serve_dies_with_the_test_run(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """reliability_support.start_gateway started its gateway in a session of its own with nothing tying it
    to pytest: a pytest killed (a CI job's timeout) before its cleanup left it serving, and writing to Redis,
    for ever. Here the process that started it exits at once, as a killed pytest does."""
    (tmp_path / "repo").mkdir()
    serve(tmp_path / "repo", "--workers", "0")  # (its gateway is ready once a control plane published the catalog)
    script = ("import os, sys; from pathlib import Path; from tests.reliability_support import start_gateway; "
              "process, url = start_gateway(sys.argv[1], sys.argv[2], Path(sys.argv[3]), {}); "
              "print(process.pid, flush=True); os._exit(1)")
    r = subprocess.run([sys.executable, "-c", script, redis_url, key_prefix, str(tmp_path / "gateway.log")],
                       capture_output=True, text=True, cwd=ROOT, timeout=90, preexec_fn=die_with_parent)
    gateway = int(r.stdout.split()[-1])
    try:
        deadline = time.monotonic() + 15  # (it drains first: SIGTERM)
        while started(gateway) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started(gateway) is None, (tmp_path / "gateway.log").read_text()[-2000:]
    finally:
        if started(gateway) is not None:
            os.kill(gateway, signal.SIGKILL)
