"""The gateway's HTTP/1.1 protocol on the wire: the infer routes are answered outside ASGI
(gateway/protocol.py), so what uvicorn's request cycle did for them is tested here over raw sockets:
pipelining order, 100-continue, chunked bodies, early 413, HTTP/1.0, keep-alive after errors, and a
client that goes away before its answer."""
from __future__ import annotations

import gzip
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from despina.examples import mlp_numpy

from .conftest import EMBEDDED, Server, module_server
from .reliability_support import role_pids

LIMIT = 200_000  # DESPINA_MAX_BODY_BYTES of this module's server
KEEP_ALIVE_S = 2.0  # and its DESPINA_KEEP_ALIVE_TIMEOUT_S (5 s by default: the tests that wait it out, shorter)
ROW = [0.25] * 256


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
           example_repository: Path) -> Iterator[Server]:
    yield from module_server(example_repository, tmp_path_factory, redis_url, ("mlp",),
                             env={"DESPINA_MAX_BODY_BYTES": str(LIMIT),
                                  "DESPINA_KEEP_ALIVE_TIMEOUT_S": str(KEEP_ALIVE_S)}, use_redis=not EMBEDDED)


def connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def infer_body(row: list[float] = ROW) -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": row}]})


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "host: test", f"content-length: {len(body)}",
            "content-type: application/json", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Reader:
    """Reads responses (status, headers, body) off a socket, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), f"connection closed mid-response: {self.buf!r}"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            assert self._fill(), "connection closed mid-body"
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed(self) -> bool:
        try:
            return not self.buf and not self._fill()
        except ConnectionResetError:
            return True


def output(body: bytes) -> np.ndarray:
    return np.array(orjson.loads(body)["outputs"][0]["data"], dtype=np.float32)


def test_pipelined_requests_answer_in_order(server: Server) -> None:
    """Hot and ASGI routes pipelined on one connection come back in the order they were sent."""
    rows = [[float(i) / 10] * 256 for i in range(5)]
    wire = b"".join([
        post("/v2/models/mlp/infer", infer_body(rows[0]), "x-request-id: a"),
        b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n",
        post("/v2/models/mlp/infer", infer_body(rows[1]), "x-request-id: b"),
        post("/v2/models/nope/infer", infer_body(), "x-request-id: c"),
        post("/fn/mlp", orjson.dumps(rows[2])),
        b"GET /v2/models/mlp/ready HTTP/1.1\r\nhost: test\r\n\r\n",
        post("/v2/models/mlp/infer", infer_body(rows[3]), "x-request-id: d"),
    ])
    with connect(server) as sock:
        sock.sendall(wire)
        r = Reader(sock)
        expected = mlp_numpy(np.array(rows, dtype=np.float32))
        status, headers, body = r.response()
        assert (status, headers["x-request-id"]) == (200, "a")
        np.testing.assert_allclose(output(body), expected[0], rtol=1e-4, atol=1e-5)
        assert r.response()[0] == 200  # live
        status, headers, body = r.response()
        assert (status, headers["x-request-id"]) == (200, "b")
        np.testing.assert_allclose(output(body), expected[1], rtol=1e-4, atol=1e-5)
        status, headers, body = r.response()
        assert (status, headers["x-request-id"]) == (404, "c") and b"unknown model" in body
        status, _, body = r.response()
        assert status == 200
        np.testing.assert_allclose(np.array(orjson.loads(body)["y"], dtype=np.float32), expected[2],
                                   rtol=1e-4, atol=1e-5)
        assert r.response()[0] == 200  # ready
        status, headers, body = r.response()
        assert (status, headers["x-request-id"]) == (200, "d")
        np.testing.assert_allclose(output(body), expected[3], rtol=1e-4, atol=1e-5)


def test_expect_100_continue(server: Server) -> None:
    """A client that waits for 100 Continue (curl does, past 1 KiB) gets it, then its answer."""
    body = infer_body()
    with connect(server) as sock:
        head = post("/v2/models/mlp/infer", b"", "expect: 100-continue").replace(
            b"content-length: 0", f"content-length: {len(body)}".encode())
        sock.sendall(head)
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        status, _, answer = Reader(sock).response()
        assert status == 200
        np.testing.assert_allclose(output(answer), mlp_numpy(np.array([ROW], dtype=np.float32))[0],
                                   rtol=1e-4, atol=1e-5)


def test_too_large_is_refused_before_the_body(server: Server) -> None:
    """A declared Content-Length over the limit: 413 at once, no 100 Continue, connection closed."""
    with connect(server) as sock:
        sock.sendall(f"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: t\r\ncontent-length: {LIMIT + 1}\r\n"
                     "expect: 100-continue\r\n\r\n".encode())
        r = Reader(sock)
        status, headers, body = r.response()
        assert status == 413 and b"over the limit" in body
        assert headers.get("connection") == "close"
        assert r.closed()


def test_chunked_body_over_the_limit(server: Server) -> None:
    """A chunked body has no length to check first: it is refused once it passes the limit."""
    with connect(server) as sock:
        sock.sendall(b"POST /fn/mlp HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"[" + b"1," * 40_000
        sent, r = 0, Reader(sock)
        try:
            while sent <= LIMIT + len(chunk):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = r.response()
        assert status == 413 and b"over the limit" in body


def test_a_compressed_body_is_held_to_the_limit_once_inflated(server: Server) -> None:
    """The limit is the body's as sent and as inflated: a small gzip body that inflates past it gets the 413
    of a body sent that large, without being inflated further (a bomb: 50 MB of zeros in 50 kB), and the
    connection serves on."""
    fits = infer_body() + b" " * (LIMIT - len(infer_body()))
    with connect(server) as sock:
        reader = Reader(sock)
        for path in ("/v2/models/mlp/infer", "/v2/models/ml%70/infer"):  # the hot route, and ASGI's
            for body, status in ((fits, 200), (fits + b" ", 413), (b"\0" * 50_000_000, 413)):
                packed = gzip.compress(body)
                assert len(packed) < LIMIT // 2
                sock.sendall(post(path, packed, "content-encoding: gzip"))
                got, _, answer = reader.response()
                assert got == status, (path, len(body), answer)
                if status == 413:
                    assert b"over the limit of 200000 bytes" in answer


def test_chunked_body_is_answered(server: Server) -> None:
    body = infer_body()
    half = len(body) // 2
    with connect(server) as sock:
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        sock.sendall(b"%x\r\n%s\r\n" % (half, body[:half]))
        time.sleep(0.05)
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - half, body[half:]))
        status, _, answer = Reader(sock).response()
        assert status == 200 and len(output(answer)) == 10


def test_a_body_in_parts_and_a_query_string(server: Server) -> None:
    # the body's first part is kept as it came, later ones appended (protocol.py's on_body); the route is
    # remembered by the whole URL, query string and all: the second request with it takes that path
    body = infer_body([0.5] * 256)
    want = mlp_numpy(np.array([[0.5] * 256], np.float32))[0]
    with connect(server) as sock:
        reader = Reader(sock)
        for path in ("/v2/models/mlp/infer?trace=1", "/v2/models/mlp/infer?trace=1", "/v2/models/mlp/infer"):
            request = post(path, body)
            cut = len(request) - len(body)
            for part in (request[:cut + 100], request[cut + 100:cut + 3000], request[cut + 3000:]):
                sock.sendall(part)
                time.sleep(0.02)
            status, _, answer = reader.response()
            assert status == 200, answer
            np.testing.assert_allclose(output(answer), want, rtol=1e-5)


def test_http_10_closes_after_the_answer(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(post("/v2/models/mlp/infer", infer_body(), version="1.0"))
        r = Reader(sock)
        status, headers, _ = r.response()
        assert status == 200 and headers.get("connection") == "close"
        assert r.closed()


def test_idle_connections_close_after_the_keep_alive_timeout(server: Server) -> None:
    """The keep-alive timeout (DESPINA_KEEP_ALIVE_TIMEOUT_S), counted from each answer: a connection idle
    that long is closed; one whose requests come less than that apart stays open, however long it lives."""
    idle, busy = connect(server), connect(server)
    with idle, busy:
        idle_reader, busy_reader = Reader(idle), Reader(busy)
        for sock, reader in ((idle, idle_reader), (busy, busy_reader)):
            sock.sendall(post("/v2/models/mlp/infer", infer_body()))
            assert reader.response()[0] == 200
        answered = time.monotonic()
        for _ in range(3):   # half the timeout apart: 1.5 times the timeout in all
            time.sleep(KEEP_ALIVE_S / 2)
            busy.sendall(post("/v2/models/mlp/infer", infer_body()))
            assert busy_reader.response()[0] == 200
        idle.settimeout(KEEP_ALIVE_S + 5)
        assert idle_reader.closed()
        assert KEEP_ALIVE_S * 0.9 < time.monotonic() - answered < KEEP_ALIVE_S + 2.5  # the setting's, not 5 s


def test_a_request_arriving_as_the_keep_alive_timeout_falls_is_answered(server: Server) -> None:
    """The timeout and the client's next request at the same moment (here: the gateway stopped past
    the timeout, the request waiting in its socket when it continues). The request is read and
    answered; closing then would have reset the connection under it, the request lost."""
    (gateway,) = role_pids(server, "gateway")
    with connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(post("/v2/models/mlp/infer", infer_body()))
        assert reader.response()[0] == 200
        os.kill(gateway, signal.SIGSTOP)
        try:
            time.sleep(KEEP_ALIVE_S + 0.5)
            sock.sendall(post("/v2/models/mlp/infer", infer_body()))
            time.sleep(0.2)
        finally:
            os.kill(gateway, signal.SIGCONT)
        status, _, body = reader.response()
        assert status == 200, body
        sock.sendall(post("/v2/models/mlp/infer", infer_body()))  # and the connection stays usable
        assert reader.response()[0] == 200


def test_a_connection_refused_before_its_body_still_times_out(server: Server) -> None:
    """A request refused on its path before its body is read: the body that follows is skipped, and the
    connection then idles into the keep-alive timeout as after any answer (the body's reads stopped the
    timer its answer had armed, and nothing armed it again: the connection stayed open for good)."""
    with connect(server) as hot, connect(server) as asgi:
        readers = [Reader(hot), Reader(asgi)]
        for reader, path in zip(readers, ("/v2/models/mlp/versions/x/infer", "/v2/models/ml%70/versions/x/infer")):
            request = post(path, infer_body())
            cut = request.index(b"\r\n\r\n") + 4
            reader.sock.sendall(request[:cut])
            assert reader.response()[0] == 404, path
            reader.sock.sendall(request[cut:])
        sent = time.monotonic()
        for reader in readers:
            reader.sock.settimeout(30)
            assert reader.closed()
        assert time.monotonic() - sent > KEEP_ALIVE_S * 0.9


def test_keep_alive_after_errors(server: Server) -> None:
    """Errors answered without reading a model keep the connection usable."""
    with connect(server) as sock:
        r = Reader(sock)
        for path, body, status in [("/v2/models/mlp/infer", b"{", 400),
                                   ("/v2/models/mlp/versions/x/infer", infer_body(), 404),
                                   ("/v2/models/nope/infer", infer_body(), 404),
                                   ("/v2/models/mlp/infer", infer_body(), 200)]:
            sock.sendall(post(path, body))
            assert r.response()[0] == status, path


def test_client_gone_before_its_answer(server: Server) -> None:
    """Clients that leave with requests in flight cost nothing but their answers; the next is served."""
    for _ in range(20):
        sock = connect(server)
        sock.sendall(post("/v2/models/mlp/infer", infer_body()))
        sock.close()
    with connect(server) as sock:
        sock.sendall(post("/v2/models/mlp/infer", infer_body()))
        assert Reader(sock).response()[0] == 200


def test_a_client_gone_with_requests_pipelined_leaves_no_traceback(server: Server) -> None:
    """A client that pipelines requests to ASGI routes and leaves before its answers: the request being
    answered is told, not only the last one read, and its answer is dropped quietly (this was uvloop's
    "the handler is closed" in an "Exception in ASGI application" traceback, one per connection)."""
    for _ in range(5):
        sock = connect(server)
        sock.sendall(post("/v2/models/ml%70/infer", infer_body()) * 2)
        sock.close()
    with connect(server) as sock:  # answered after those: by then they have answered too
        reader = Reader(sock)
        sock.sendall(post("/v2/models/ml%70/infer", infer_body()))
        assert reader.response()[0] == 200
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n")
        assert reader.response()[0] == 200
    assert "Exception in ASGI application" not in server.logs()


def test_a_head_over_the_limit_is_refused(server: Server) -> None:
    """Headers without end get 431 and a closed connection once past 64 KiB, on the infer routes and the
    others alike: uvicorn's protocol read them without limit and never answered, each read copying all
    that had come so far. A head under the limit, however it is cut into reads, is served."""
    def request(path: str, *headers: str) -> bytes:
        if path.endswith("/infer"):
            return post(path, infer_body(), *headers)
        return "\r\n".join([f"GET {path} HTTP/1.1", "host: test", *headers, "", ""]).encode()

    for path in ("/v2/models/mlp/infer", "/v2/models/ml%70/infer", "/v2/health/ready"):
        with connect(server) as sock:
            fits = request(path, "x-big: " + "a" * 60_000)
            for at in range(0, len(fits), 4096):
                sock.sendall(fits[at:at + 4096])
            assert Reader(sock).response()[0] == 200, path
        with connect(server) as sock:
            sock.sendall(request(path)[:40])
            try:
                for _ in range(256):  # 1 MiB of one header, never ended
                    sock.sendall(b"a" * 4096)
            except (BrokenPipeError, ConnectionResetError):
                pass
            reader = Reader(sock)
            status, headers, answer = reader.response()
            assert (status, headers.get("connection")) == (431, "close"), path
            assert b"over the limit of 65536 bytes" in answer
            assert reader.closed()


def test_malformed_request_line(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\ncontent-length: x\r\n\r\n")
        r = Reader(sock)
        assert r.response()[0] == 400


def test_a_client_that_pipelines_without_reading_is_not_read_further(server: Server) -> None:
    """Requests sent on without reading the answers: the gateway answers those it has read, a request
    at a time, and reads no more from that client until they are answered (its memory stays bounded;
    the client's sends stall once the socket buffers are full). Others are served meanwhile."""
    blob = post("/fn/mlp", orjson.dumps([0.25] * 256)) * 200
    sock = connect(server)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    sent = 0

    def send_for(seconds: float) -> None:
        nonlocal sent
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            try:
                sent += sock.send(blob[sent % len(blob):])
            except BlockingIOError:
                time.sleep(0.01)

    try:
        send_for(3.0)
    finally:
        sock.close()
    # What got through is what the kernel's socket buffers hold (autotuning grows them up to
    # tcp_rmem + tcp_wmem's maximum: 32 + 4 MiB on these machines) and a read buffer of requests:
    # bounded. Before the fix every answer let the gateway read on, a read buffer (~50 requests) each
    # time: 247 MB in 2 s in a run by hand where answers came fast.
    assert sent < 64_000_000, f"{sent / 1e6:.1f} MB read from a client that reads nothing"
    with connect(server) as other:
        other.sendall(post("/v2/models/mlp/infer", infer_body()))
        assert Reader(other).response()[0] == 200


def test_an_escaped_path_is_answered_by_the_asgi_routes(server: Server) -> None:
    # a %-escaped path is not the protocol's to decode: uvicorn's cycle and Starlette's router answer it,
    # with the same routes (AsgiEndpoint); this answered 500 while Starlette called them as functions
    sock = connect(server)
    reader = Reader(sock)
    for path in ("/v2/models/ml%70/infer", "/fn/ml%70"):
        body = infer_body() if path.startswith("/v2") else orjson.dumps(ROW)
        sock.sendall(post(path, body))
        status, _, answer = reader.response()
        assert status == 200, (path, answer)
    want = mlp_numpy(np.array([ROW], np.float32))[0]
    sock.sendall(post("/v2/models/ml%70/infer", infer_body()))
    status, _, answer = reader.response()
    np.testing.assert_allclose(output(answer), want, rtol=1e-5)
    sock.sendall(post("/v2/models/ml%70/infer", b"{oops"))
    status, _, answer = reader.response()
    assert status == 400 and orjson.loads(answer)["error"]
    sock.close()
