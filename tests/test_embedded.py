"""The embedded Valkey: a Unix socket only its user can open, TCP where the socket's path is too long,
and what a killed `despina serve` left behind cleaned up by the next one."""
from __future__ import annotations

import os
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from despina.embedded import STALE_AFTER_S, UNIX_PATH_MAX, EmbeddedValkey, remove_stale_dirs


def test_listens_on_a_private_unix_socket_and_no_tcp_port() -> None:
    server = EmbeddedValkey()
    server.start()
    try:
        assert server.url.startswith("unix://") and server.url.endswith("?db=0")
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("port") == {"port": "0"}
        # a statistics hash of hundreds of fields is a hash table (cheaper to add to), a small one a listpack
        client.hset("small", mapping={f"f{i}": i for i in range(32)})
        client.hset("stats", mapping={f"batch:{i}": i for i in range(33)})
        assert (client.object("encoding", "small"), client.object("encoding", "stats")) == (b"listpack",
                                                                                             b"hashtable")
        assert stat.S_IMODE(server.socket.stat().st_mode) == 0o700
        assert stat.S_IMODE(server.socket.parent.stat().st_mode) == 0o700
        client.close()
    finally:
        server.stop()
    assert not server.socket.parent.exists()


def test_a_path_too_long_for_a_socket_falls_back_to_loopback_tcp(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * (UNIX_PATH_MAX - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    server = EmbeddedValkey()
    server.start()
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()


def test_what_a_killed_serve_left_behind_is_removed_and_nothing_else(tmp_path: Path) -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid names no process now
    old = time.time() - 2 * STALE_AFTER_S

    def folder(name: str, pid: int | None, mtime: float | None) -> Path:
        path = tmp_path / f"despina-valkey-{name}"
        path.mkdir()
        (path / "valkey.log").write_text("...")
        if pid is not None:
            (path / "valkey.pid").write_text(str(pid))
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        return path

    dead, no_pid = folder("dead", ended.pid, old), folder("nopid", None, old)
    running, starting = folder("running", os.getpid(), old), folder("starting", None, None)
    other = tmp_path / "unrelated"
    other.mkdir()
    assert sorted(remove_stale_dirs(tmp_path)) == sorted([dead, no_pid])
    assert running.exists() and starting.exists() and other.exists() and not dead.exists()


def test_a_started_valkey_names_its_process() -> None:
    server = EmbeddedValkey()
    server.start()
    try:
        assert server.process is not None
        assert (server.socket.parent / "valkey.pid").read_text() == str(server.process.pid)
    finally:
        server.stop()
