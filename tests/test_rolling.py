"""Rolling restarts as Kubernetes does them: a gateway told to stop (SIGTERM) while its clients still hold
connections to it, as a load balancer does whose endpoints have not yet moved."""
from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from .conftest import FULL_QUEUE_DELAY, Server
from .test_gateway_http import ROW, Reader, connect, infer_body, post
from .test_metrics import scrape
from .test_serve import PENDING, slow_repository

LIVE = b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n"


def refused(server: Server) -> bool:
    try:
        connect(server).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_stopping_gateway_answers_what_comes_on_its_open_connections(
        serve: Callable[..., Server], example_repository: Path) -> None:
    """On SIGTERM the gateway closed every idle keep-alive connection at once: a request that a client (a
    load balancer reusing its connections) sent on one just then was cut off unanswered, and a POST cannot
    safely be sent again. Now such a connection stays open while the gateway drains: the request that comes
    on it is answered, with Connection: close, on the infer routes and on the others alike."""
    server = serve(example_repository, wait_models=("mlp",))
    with contextlib.ExitStack() as sockets:
        drain_with_idle_connections(server, sockets)
    assert server.process.wait(30) == 0


def drain_with_idle_connections(server: Server, sockets: contextlib.ExitStack) -> None:
    idle = []
    for request in (LIVE, post("/fn/mlp", orjson.dumps(ROW))):
        sock = sockets.enter_context(connect(server))
        sock.sendall(request)
        assert Reader(sock).response()[0] == 200
        idle.append(sock)
    # a request whose body is still coming keeps the drain going while the idle connections are used
    slow = sockets.enter_context(connect(server))
    body = infer_body()
    slow.sendall(post("/v2/models/mlp/infer", body)[:-10])
    server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not refused(server):  # the gateway has stopped taking connections: it is draining
        assert time.monotonic() < deadline, server.logs()[-2000:]
        time.sleep(0.05)
    for sock, request in zip(idle, (LIVE, post("/fn/mlp", orjson.dumps(ROW)))):
        sock.sendall(request)
        reader = Reader(sock)
        status, headers, answer = reader.response()
        assert (status, headers.get("connection")) == (200, "close"), answer
        assert reader.closed()
    slow.sendall(body[-10:])
    reader = Reader(slow)
    status, headers, answer = reader.response()
    assert (status, headers.get("connection")) == (200, "close"), answer


def test_requests_pipelined_behind_one_in_progress_are_all_answered_at_sigterm(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path) -> None:
    """At SIGTERM the answer to the request in progress (or to the first one read after) ended its
    connection, and the requests the client had pipelined behind it, read or not yet read, were cut off
    unanswered. Now each is answered, and only the last carries Connection: close: on the infer route, on
    an ASGI one (an escaped path), with requests still unread as the drain begins, and with requests sent
    after it."""
    server = serve(slow_repository(example_repository, tmp_path / "slow"), wait_models=("mlp",),
                   env=FULL_QUEUE_DELAY)  # mlp's answers take 2 s
    hot, escaped = "/v2/models/mlp/infer", "/v2/models/ml%70/infer"
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connect(server)) for _ in range(3)]
        for sock, path in zip(socks, (hot, escaped, hot)):
            sock.sendall(request(path, "a"))
        wait_pending(server, 3)
        # pipelined behind the request in progress, and read (then the gateway reads no further)
        for sock, path in zip(socks, (hot, escaped, escaped)):
            sock.sendall(request(path, "b"))
        time.sleep(0.3)
        socks[2].sendall(request("/v2/models/nope/infer", "c"))  # not read yet as the drain begins
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not refused(server):
            assert time.monotonic() < deadline, server.logs()[-2000:]
            time.sleep(0.05)
        for sock, path in zip(socks[:2], (hot, escaped)):
            sock.sendall(request(path, "c") + request(path.replace("mlp", "nope").replace("ml%70", "n%6fpe"), "d"))
        for sock in socks:
            sock.sendall(LIVE)
        expected = [[(200, "a"), (200, "b"), (200, "c"), (404, "d")]] * 2 + [[(200, "a"), (200, "b"), (404, "c")]]
        for sock, answers in zip(socks, expected):
            reader = Reader(sock)
            for status, rid in answers:
                got, headers, body = reader.response()
                assert (got, headers.get("x-request-id"), headers.get("connection")) == (status, rid, None), body
            status, headers, body = reader.response()  # the last: GET live
            assert (status, headers.get("connection")) == (200, "close"), body
            assert reader.closed()
    assert server.process.wait(30) == 0


def test_a_client_that_keeps_pipelining_does_not_hold_the_drain_past_its_time(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path) -> None:
    """Each request read while the gateway drains is answered, and the connection is kept while the client
    has sent more: a client that never stops sending still has its connection ended when the drain's time
    is up, and the gateway stops in time."""
    server = serve(slow_repository(example_repository, tmp_path / "slow"), wait_models=("mlp",),
                   env={**FULL_QUEUE_DELAY, "DESPINA_DRAIN_TIMEOUT_S": "3"})  # mlp's answers take 2 s
    with connect(server) as sock:
        sock.sendall(request("/v2/models/mlp/infer", "0"))
        wait_pending(server, 1)
        server.process.send_signal(signal.SIGTERM)
        started, sent = time.monotonic(), 1
        with contextlib.suppress(OSError):  # the connection is cut at the drain's end
            while server.process.poll() is None and time.monotonic() - started < 30:
                sock.sendall(request("/v2/models/mlp/infer", str(sent)))
                sent += 1
                time.sleep(0.2)
        assert server.process.wait(30) == 0
        assert time.monotonic() - started < 3 + 5, server.logs()[-2000:]
        reader, statuses = Reader(sock), []
        with contextlib.suppress(AssertionError, OSError):  # until the cut
            while len(statuses) < sent:
                statuses.append(reader.response()[0])
    # the first answered, the others waiting as the drain ends 503 (and those read after, cut)
    assert statuses[:1] == [200] and set(statuses[1:]) <= {200, 503}, statuses


def request(path: str, rid: str) -> bytes:
    return post(path, infer_body(), f"x-request-id: {rid}")


def wait_pending(server: Server, count: int) -> None:
    deadline = time.monotonic() + 10
    while scrape(server).get(PENDING) != count:
        assert time.monotonic() < deadline, server.logs()[-2000:]
        time.sleep(0.02)
