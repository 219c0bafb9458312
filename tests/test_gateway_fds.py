"""A gateway and its file descriptors (despina/fds.py): it raises its open-files limit at start, and past its
connection limit it answers new connections 503 at once, keeping descriptors for Redis, instead of the
clients being reset and the requests on the connections it holds failing to reach Redis."""
from __future__ import annotations

import contextlib
import errno
import http.client
import os
import resource
import select
import shutil
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
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from despina import fds
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


def limited_serve(tmp_path: Path, repository: Path, redis_url: str, key_prefix: str, nofile: int,
                  env: dict[str, str]) -> Server:
    """`despina serve` whose soft and hard open-files limits are `nofile` (serve's, and each role's), ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "despina", "serve", "--model-repository", str(repository),
           "--http-port", str(port), "--metrics-port", "0", "--key-prefix", key_prefix, "--redis-url", redis_url]

    def limited() -> None:
        die_with_parent()
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    log = tmp_path / "serve.log"
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
    environ["DESPINA_KEEP_ALIVE_TIMEOUT_S"] = "60"  # the connections held stay for the test's length
    environ.update(env)
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
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    except BaseException:
        stop_server(server)
        raise


@pytest.fixture
def tight_server(tmp_path: Path, example_repository: Path, redis_url: str, key_prefix: str
                 ) -> Iterator[Server]:
    """`despina serve` whose soft and hard open-files limits are 256: a gateway connection limit of 128."""
    server = limited_serve(tmp_path, example_repository, redis_url, key_prefix, 256, {})
    yield server
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


GATE = """
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

GATE = Path({gate!r})


class TritonPythonModel:
    def execute(self, requests):
        GATE.with_suffix(".entered").touch()
        while not GATE.exists():
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
"""


def socket_ports(pid: int) -> set[int]:
    """The local ports of the TCP sockets the process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if (target := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def close_request_writer(redis_url: str, pid: int) -> int:
    """Close (CLIENT KILL) the gateway's connection that writes requests, if it has one open, and wait
    until the gateway has let its descriptor go; how many it closed. It is one of the gateway's own connections (Resp's, on
    RESP2; redis-py's speak RESP3) and not the reply reader's (blocked in XREAD)."""
    client = redis.Redis.from_url(redis_url)
    try:
        ports, killed = socket_ports(pid), set()
        for line in client.execute_command("CLIENT", "LIST").decode().splitlines():
            info = dict(kv.split("=", 1) for kv in line.split(" ") if "=" in kv)
            port = int(info["addr"].rsplit(":", 1)[1])
            if port in ports and info["resp"] == "2" and info["cmd"] != "xread":
                client.execute_command("CLIENT", "KILL", "ADDR", info["addr"])
                killed.add(port)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while killed & socket_ports(pid):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return len(killed)


def test_a_gateway_out_of_descriptors_says_so_not_that_redis_is_unavailable(
        tmp_path: Path, example_repository: Path, redis_url: str, key_prefix: str) -> None:
    """A connection limit set above what the open-files limit allows: once the clients' connections take
    every descriptor, a request that needs a new connection to Redis (the request queue's, closed: another
    request waits for its answer, the model `gate` holding it, so it cannot go with the reply reader's read)
    cannot have one. Its 503, and the log, say that the
    gateway is out of file descriptors and which limits to change, not that Redis is unavailable."""
    repository, gate = tmp_path / "repo", tmp_path / "gate"
    shutil.copytree(example_repository / "add_sub", repository / "add_sub")
    (repository / "gate" / "1").mkdir(parents=True)
    (repository / "gate" / "1" / "model.py").write_text(GATE.format(gate=str(gate)))
    (repository / "gate" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')
    server = limited_serve(tmp_path, repository, redis_url, key_prefix, 128, {"DESPINA_MAX_CONNECTIONS": "100000"})
    try:
        port = int(server.url.rsplit(":", 1)[1])
        held, waiting = (http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(2))
        held.connect()
        waiting.request("POST", "/v2/models/gate/infer",
                        orjson.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}))
        deadline = time.monotonic() + 30
        while not gate.with_suffix(".entered").exists():  # the model holds it: the gateway reads replies
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
        # a request while the reply reader waits in XREAD goes out on the request queue's own connection (the
        # first went with the reader's read), which it opens; closed then, the next request must open it again
        assert httpx.post(f"{server.url}/v2/models/add_sub/infer", content=ADD_SUB, timeout=10).status_code == 200
        pid = gateway_pid(server)
        assert close_request_writer(redis_url, pid) == 1
        socks = flood(server, 256)
        try:
            deadline = time.monotonic() + 10  # the gateway accepts until it has no descriptor left
            while len(os.listdir(f"/proc/{pid}/fd")) < 128:
                assert time.monotonic() < deadline, len(os.listdir(f"/proc/{pid}/fd"))
                time.sleep(0.1)
            held.request("POST", "/v2/models/add_sub/infer", ADD_SUB)
            answer = held.getresponse()
            body = answer.read()
        finally:
            for sock in socks:
                sock.close()
            gate.touch()
        assert answer.status == 503, body
        error = orjson.loads(body)["error"]
        assert "the gateway is out of file descriptors" in error and "(128)" in error, error
        assert "LimitNOFILE" in error and "DESPINA_MAX_CONNECTIONS" in error, error
        assert "the gateway is out of file descriptors" in server.logs()
        assert waiting.getresponse().status == 200
        for conn in (held, waiting):
            conn.close()
        deadline = time.monotonic() + 10  # the flood's connections close: requests are served again
        while httpx.post(f"{server.url}/v2/models/add_sub/infer", content=ADD_SUB, timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stop_server(server)


def test_a_shortage_of_descriptors_is_found_under_the_errors_raised_from_it() -> None:
    """redis-py's and Resp's connection errors are raised from the OSError that has the errno."""
    def raised(errno_: int) -> BaseException:
        try:
            try:
                raise OSError(errno_, os.strerror(errno_))
            except OSError as exc:
                raise RedisConnectionError("Error connecting to 127.0.0.1:6379.") from exc
        except RedisConnectionError as exc:
            return exc

    assert "open-files limit" in (fds.shortage(raised(errno.EMFILE)) or "")
    assert "fs.file-max" in (fds.shortage(raised(errno.ENFILE)) or "")
    assert fds.shortage(raised(errno.ECONNREFUSED)) is None
