"""The fault tests' load generator (reliability_support.post_all) against a real HTTP/1.1 server: a
request fails there only when the server fails it, whatever the client's own event loop does."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from despina.embedded import free_port

from .reliability_support import Answer, post_all

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


class Server(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, one short answer each, in a loop of its own; a request whose
    X-Request-Id is in `drop` has its connection reset instead."""
    def __init__(self, drop: frozenset[str]) -> None:
        self.drop, self.data = drop, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        assert isinstance(transport, asyncio.Transport)

    def data_received(self, data: bytes) -> None:
        self.data += data
        while b"\r\n\r\n" in self.data:
            head, rest = self.data.split(b"\r\n\r\n", 1)
            fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
            length = int(fields.get(b"content-length", b"0"))
            if len(rest) < length:
                return
            self.data = rest[length:]
            assert isinstance(self.transport, asyncio.Transport)
            if fields.get(b"x-request-id", b"").strip().decode() in self.drop:
                self.transport.abort()
                return
            self.transport.write(ANSWER)


@pytest.fixture
def http_server() -> Iterator[Callable[..., str]]:
    """start(drop=frozenset()): the URL of a server run in a thread; stopped after the test."""
    stops: list[Callable[[], None]] = []

    def start(drop: frozenset[str] = frozenset()) -> str:
        port, ready = free_port(), threading.Event()
        loop = asyncio.new_event_loop()

        def run() -> None:
            server = loop.run_until_complete(loop.create_server(lambda: Server(drop), "127.0.0.1", port))
            ready.set()
            loop.run_forever()
            server.close()
            loop.run_until_complete(server.wait_closed())
            loop.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        ready.wait(10)

        def stop() -> None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

        stops.append(stop)
        return f"http://127.0.0.1:{port}/"

    yield start
    for stop in stops:
        stop()


async def test_a_client_held_up_longer_than_its_keepalive_expiry_fails_no_request(
        http_server: Callable[..., str]) -> None:
    """The loop held up (here 1.5 s, three times) as the fault tests' own blocking Redis calls and a loaded
    machine hold it: httpcore's pool closed connections it had already handed to requests, and 1 to 6 of
    800 failed with ReadError <- ClosedResourceError. The server closed nothing."""
    url = http_server()

    def held_up(i: int) -> str:
        if i in (200, 400, 600):
            time.sleep(1.5)
        return url

    answers: list[Answer] = []
    await post_all(held_up, [b"x"] * 800, 200, answers)
    failed = [(a.index, a.body[:200]) for a in answers if a.status != 200]
    assert not failed and len(answers) == 800, failed[:5]


async def test_a_request_whose_connection_the_server_resets_is_a_failure(http_server: Callable[..., str]) -> None:
    """What the fault tests count on: the client retries nothing the server dropped."""
    dropped = frozenset({"5", "50", "150"})
    url = http_server(drop=dropped)
    answers: list[Answer] = []
    await post_all(lambda i: url, [b"x"] * 200, 20, answers)
    assert sorted(a.index for a in answers) == list(range(200))
    assert {str(a.index) for a in answers if a.status != 200} == dropped
    assert all(a.body == b"ok" for a in answers if a.status == 200)
