"""Rolling restarts as Kubernetes does them: a gateway told to stop (SIGTERM) while its clients still hold
connections to it, as a load balancer does whose endpoints have not yet moved."""
from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from .conftest import Server
from .test_gateway_http import ROW, Reader, connect, infer_body, post

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
