"""The embedded Valkey: a Unix socket only its user can open, TCP where the socket's path is too long."""
from __future__ import annotations

import stat
import tempfile
from pathlib import Path

import pytest
import redis

from despina.embedded import UNIX_PATH_MAX, EmbeddedValkey


def test_listens_on_a_private_unix_socket_and_no_tcp_port() -> None:
    server = EmbeddedValkey()
    server.start()
    try:
        assert server.url.startswith("unix://") and server.url.endswith("?db=0")
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("port") == {"port": "0"}
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
