"""IPv6: `--host ::` (an IPv6-only or dual-stack Kubernetes cluster) and `::1`, Redis URLs with an IPv6
literal (redis://[::1]:6379, rediss:// too), an S3 endpoint at http://[::1]:PORT. Skipped where the
machine has no IPv6 loopback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import redis

from despina.embedded import bound_socket
from despina.redis_check import Unusable, check

from .conftest import Server, ipv6_loopback
from .control_support import mlp_folder
from .seaweed import start_weed
from .test_resp import all_three_connect, tls_redis  # noqa: F401  (tls_redis: a Redis that speaks TLS only, on ::1 too)

pytestmark = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
ADD_SUB = b'{"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]}'


def on_ipv6(url: str) -> str | None:
    """The test Redis's URL with its loopback address as IPv6's (redis://[::1]:PORT/DB), where that server
    listens on ::1 too; None where it does not (a unix socket, a remote host, IPv4 only)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss") or parsed.hostname not in ("127.0.0.1", "localhost"):
        return None
    netloc = parsed.netloc.rpartition("@")
    host = f"[::1]:{parsed.port or 6379}"
    ipv6 = parsed._replace(netloc=f"{netloc[0]}{netloc[1]}{host}").geturl()
    try:
        redis.Redis.from_url(ipv6, socket_connect_timeout=1).ping()
    except redis.RedisError:
        return None
    return ipv6


@pytest.fixture
def redis_on_ipv6(redis_url: str) -> str:
    ipv6 = on_ipv6(redis_url)
    if ipv6 is None:
        pytest.skip("the test Redis does not listen on ::1")
    return ipv6


def test_serve_on_the_ipv6_any_address_answers_ipv6_and_ipv4(serve: Callable[..., Server], redis_url: str,
                                                              example_repository: Path) -> None:
    """`--host ::` served IPv6 alone on the HTTP port (uvicorn's bind, through asyncio, sets IPV6_V6ONLY):
    127.0.0.1 was refused, a container's health check with it too, while the metrics port took both. Every
    role reaches Redis through an IPv6 literal (redis://[::1]:6379) where the test Redis listens there."""
    url = on_ipv6(redis_url)
    server = serve(example_repository, "--host", "::", *(("--redis-url", url) if url else ()),
                   use_redis=url is None, wait_models=("add_sub",))  # ready on 127.0.0.1 (start_server)
    port, metrics_port = urlparse(server.url).port, urlparse(server.metrics_url).port
    for host in ("[::1]", "127.0.0.1"):
        r = httpx.post(f"http://{host}:{port}/fn/add_sub", content=ADD_SUB, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(f"http://{host}:{metrics_port}/metrics", timeout=30).status_code == 200
    logs = server.logs()
    assert f"on http://[::]:{port} with 1 worker(s)" in logs, logs  # was http://:::PORT
    assert f"listening on http://[::]:{port}" in logs, logs


def test_a_taken_ipv6_port_is_named_in_brackets() -> None:
    with socket.socket(socket.AF_INET6) as holder:
        holder.bind(("::1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"^gateway: cannot bind \[::1\]:{port}: address already in use$"):
            bound_socket("::1", port, "gateway")


def test_the_ipv6_any_address_is_bound_dual_stack() -> None:
    """Whatever net.ipv6.bindv6only says, `::` takes IPv4 connections too."""
    with bound_socket("::", 0, "gateway") as sock:
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=5):
            pass


def test_the_start_check_names_an_ipv6_redis_in_brackets(redis_on_ipv6: str) -> None:
    """It said "::1:6379 answers without TLS", an address nobody can use."""
    port = urlparse(redis_on_ipv6).port
    assert check(redis_on_ipv6, "despina-check").warnings == []
    with pytest.raises(Unusable, match=rf"^\[::1\]:{port} answers without TLS: use a redis:// URL"):
        check(redis_on_ipv6.replace("redis://", "rediss://"), "despina-check")


async def test_tls_to_an_ipv6_literal(tls_redis: tuple[int, Path]) -> None:  # noqa: F811
    """rediss://[::1]:PORT: the certificate's IP address is checked against ::1 (the host without its
    brackets), by redis-py's connections and by Despina's own; a plain URL to it is told to use TLS."""
    port, d = tls_redis
    files = f"ssl_ca_certs={d / 'ca.crt'}&ssl_certfile={d / 'client.crt'}&ssl_keyfile={d / 'client.key'}"
    url = f"rediss://[::1]:{port}/0?{files}"
    await all_three_connect(url)
    with pytest.raises(Unusable, match=rf"^\[::1\]:{port} speaks TLS: use a rediss:// URL$"):
        check(f"redis://[::1]:{port}/0", "despina-check")


def test_an_s3_registry_at_an_ipv6_endpoint(tmp_path: Path) -> None:
    """AWS_ENDPOINT_URL_S3=http://[::1]:PORT: push and ls through boto3 to a SeaweedFS on ::1 alone."""
    weed = start_weed(tmp_path / "weed", host="::1")
    try:
        assert weed.endpoint.startswith("http://[::1]:")
        url, env = weed.url(), {**os.environ, **weed.env}
        r = subprocess.run([sys.executable, "-m", "despina", "push", str(mlp_folder(tmp_path / "src")), url],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and "verified" in r.stderr, r.stderr
        r = subprocess.run([sys.executable, "-m", "despina", "ls", url], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0 and r.stdout.split()[:3] == ["mlp", "versions", "1"], r.stderr
    finally:
        weed.stop()
