"""A gateway and its file descriptors (despina/fds.py): it raises its open-files limit at start, and past its
connection limit it answers new connections 503 at once, keeping descriptors for Redis, instead of the
clients being reset and the requests on the connections it holds failing to reach Redis."""
from __future__ import annotations

import http.client
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from despina.embedded import die_with_parent, free_port

from .conftest import Server, descendants, stop_server

ADD_SUB = orjson.dumps({"inputs": [{"name": "a", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4},
                                   {"name": "b", "shape": [1, 4], "datatype": "FP32", "data": [2.0] * 4}]})


def gateway_pid(server: Server) -> int:
    for pid in descendants(server.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().split(b"\0")[1:4] == [b"-m", b"despina", b"gateway"]:
                return pid
    raise AssertionError("no gateway process under serve")


def flood(server: Server, n: int) -> list[socket.socket]:
    port = int(server.url.rsplit(":", 1)[1])
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def said(sock: socket.socket) -> bytes | None:
    """What the gateway sent on a connection that sent nothing (b"" for a close), None for nothing yet;
    raises ConnectionResetError for a reset."""
    if not select.select([sock], [], [], 0)[0]:
        return None
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_the_open_files_limit_is_raised_at_start(serve: Callable[..., Server], tmp_path: Path) -> None:
    """Started with a soft limit of 256 (the hard one above), the gateway serves 300 connections at once:
    the open-files limit did not reset them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open-files limit ({hard}) leaves no room to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # what serve and its children inherit
    try:
        server = serve(tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    socks = flood(server, 300)
    try:
        for sock in socks:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\n\r\n")
        for sock in socks:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in socks:
            sock.close()
    assert resource.prlimit(gateway_pid(server), resource.RLIMIT_NOFILE)[0] > 256


@pytest.fixture
def tight_server(tmp_path: Path, example_repository: Path, redis_url: str, key_prefix: str
                 ) -> Iterator[Server]:
    """`despina serve` whose soft and hard open-files limits are 256: a gateway connection limit of 128."""
    port = free_port()
    cmd = [sys.executable, "-m", "despina", "serve", "--model-repository", str(example_repository),
           "--http-port", str(port), "--metrics-port", "0", "--key-prefix", key_prefix, "--redis-url", redis_url]

    def limited() -> None:
        die_with_parent()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    log = tmp_path / "serve.log"
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
    environ["DESPINA_KEEP_ALIVE_TIMEOUT_S"] = "60"  # the connections held stay for the test's length
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ,
                                   start_new_session=True, preexec_fn=limited)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, server.logs()
            assert time.monotonic() < deadline, server.logs()
            try:
                if httpx.get(f"{server.url}/v2/models/add_sub/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield server
    finally:
        stop_server(server)


def test_connections_past_the_limit_get_503_and_those_held_still_reach_redis(tight_server: Server) -> None:
    server = tight_server
    port = int(server.url.rsplit(":", 1)[1])
    held = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(8)]

    def infer(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
        conn.request("POST", "/v2/models/add_sub/infer", ADD_SUB)
        answer = conn.getresponse()
        return answer.status, answer.read()

    for conn in held:
        assert infer(conn)[0] == 200
    socks = flood(server, 300)  # more than the 256 descriptors the gateway may have
    try:
        # each either held (nothing said) or refused at once: 503, then closed; none reset. A socket is read
        # once: read again, one answered and closed says b"" (on a loaded machine the answers come over several
        # passes, and counting each pass afresh counted none)
        answers: list[bytes | None] = [None] * len(socks)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            answers = [said(sock) if answer is None else answer for sock, answer in zip(socks, answers)]
            if sum(1 for a in answers if a is not None) >= 300 - 128:
                break
            time.sleep(0.1)
        assert sum(1 for a in answers if a is not None) >= 300 - 128, answers
        for answer in answers:
            if answer is not None:  # (b"": closed without a word, which the limit never does)
                assert answer.startswith(b"HTTP/1.1 503 "), answer
                assert b"retry-after: 1\r\n" in answer and b"connection: close\r\n" in answer
        # requests at once on the connections held: each needs a connection to Redis of its own
        with ThreadPoolExecutor(len(held)) as pool:
            for status, body in pool.map(infer, held):
                assert status == 200, body
    finally:
        for sock in socks:
            sock.close()
    for conn in held:
        conn.close()
    deadline = time.monotonic() + 10  # the flood's connections close: new ones are served again
    while httpx.post(f"{server.url}/v2/models/add_sub/infer", content=ADD_SUB, timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "client connection(s) refused with 503" in server.logs()


def gateway_figures(text: str) -> dict[str, float]:
    """The gateway families of a /metrics text, by name (one gateway)."""
    return {line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("despina_gateway_") and 'process="gateway:' in line}


def test_the_metrics_count_the_connections_refused_past_the_limit(serve: Callable[..., Server],
                                                                  example_repository: Path) -> None:
    """An operator sees on /metrics how many connections a gateway holds, its limit, and how many it
    refused past it."""
    server = serve(example_repository, env={"DESPINA_MAX_CONNECTIONS": "4", "DESPINA_KEEP_ALIVE_TIMEOUT_S": "60"})
    socks = flood(server, 12)  # 4 held, 8 refused
    try:
        answers: list[bytes | None] = [None] * len(socks)
        deadline = time.monotonic() + 10
        while sum(1 for a in answers if a is not None) < 8 and time.monotonic() < deadline:
            answers = [said(sock) if answer is None else answer for sock, answer in zip(socks, answers)]
            time.sleep(0.1)
        refused = sum(1 for a in answers if a is not None and a.startswith(b"HTTP/1.1 503 "))
        assert refused == 8, answers
        deadline = time.monotonic() + 20  # (a gateway reports its figures every few seconds)
        while True:
            text = httpx.get(server.metrics_url, timeout=10).text
            figures = gateway_figures(text)
            if figures.get("despina_gateway_connections_refused_total") == refused \
                    and figures.get("despina_gateway_connections") == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for sock in socks:
            sock.close()
    assert figures == {"despina_gateway_connections": 4, "despina_gateway_connection_limit": 4,
                       "despina_gateway_connections_refused_total": refused}, text
    assert "# TYPE despina_gateway_connections_refused_total counter" in text
    assert "# TYPE despina_gateway_connections gauge" in text
    assert "# HELP despina_gateway_connection_limit " in text
