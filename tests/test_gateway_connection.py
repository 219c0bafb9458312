"""The gateway's connections on the wire (gateway/connection.py), over raw sockets: read timeouts (408) on
the infer routes answered outside ASGI and on the Starlette routes, what they leave alone (a request
waiting for its answer, a slow but steady client, the keep-alive idle), an error that ends a pipelined
connection after the answers owed before it, the lingering close that lets a client still sending read its
error answer, and the answers owed to a client that half-closes."""
from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from .conftest import EMBEDDED, Server, module_server
from .test_gateway_http import Reader, connect, post

HEADER_S = BODY_S = 2.0  # this module's server's read timeouts
WRITE_S = 1.0            # its write timeout
KEEP_ALIVE_S = 3.0       # and its keep-alive timeout
LIMIT = 100_000          # and its body limit

# answers x, after sleeping x[0] seconds: a request that waits for its answer longer than the timeouts
SLEEPY = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            time.sleep(float(x.flat[0]))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x.copy())]))
        return out
"""
CONFIG = """backend: "python"
max_batch_size: 0
input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]
output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]
"""
# answers x[0] zeros: an answer as large as the client asks (4 bytes in JSON each)
WIDE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "y", np.zeros(int(pb_utils.get_input_tensor_by_name(r, "x").as_numpy().flat[0]), np.float32))])
            for r in requests]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("repo")
    (repo / "sleepy" / "1").mkdir(parents=True)
    (repo / "sleepy" / "1" / "model.py").write_text(SLEEPY)
    (repo / "sleepy" / "config.pbtxt").write_text(CONFIG)
    (repo / "wide" / "1").mkdir(parents=True)
    (repo / "wide" / "1" / "model.py").write_text(WIDE)
    (repo / "wide" / "config.pbtxt").write_text(CONFIG.replace('"y", data_type: TYPE_FP32, dims: [1]',
                                                                '"y", data_type: TYPE_FP32, dims: [-1]'))
    yield from module_server(repo, tmp_path_factory, redis_url, ("sleepy", "wide"),
                             env={"DESPINA_HEADER_TIMEOUT_S": str(HEADER_S), "DESPINA_BODY_TIMEOUT_S": str(BODY_S),
                                  "DESPINA_WRITE_TIMEOUT_S": str(WRITE_S), "DESPINA_KEEP_ALIVE_TIMEOUT_S": str(KEEP_ALIVE_S),
                                  "DESPINA_MAX_BODY_BYTES": str(LIMIT)},
                             use_redis=not EMBEDDED)


def infer(seconds: float = 0.0) -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [seconds]}]})


HOT, ASGI = "/v2/models/sleepy/infer", "/v2/models/sleep%79/infer"  # the escaped path: Starlette's route
LIVE = b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n"


def last_word(reader: Reader, status: int, words: str) -> None:
    """The connection's last answer: `status` with an error saying `words`, then the end of the connection."""
    got, headers, body = reader.response()
    assert (got, headers.get("connection")) == (status, "close"), body
    assert words in orjson.loads(body)["error"]
    assert reader.closed()


def test_a_head_that_stops_coming_is_answered_408(server: Server) -> None:
    """A request's line and headers must all come within the header timeout of their first byte: one cut
    short, or sent a byte at a time for longer than that, gets 408 and the connection closes. Before, such
    a connection stayed open for good (a slowloris holds a connection per few bytes). (The connections
    side by side, each on its own clock.)"""
    def cut_short(head: bytes) -> None:
        with connect(server) as sock:
            sock.settimeout(30)
            sock.sendall(head)
            sent = time.monotonic()
            last_word(Reader(sock), 408, "the request line and headers did not all come within 2 s")
            assert time.monotonic() - sent > HEADER_S * 0.9

    def steady() -> None:  # but too slow: the timeout counts from the first byte
        with connect(server) as sock:
            sock.settimeout(30)
            try:
                for at in range(len(LIVE)):
                    if select.select([sock], [], [], 0)[0]:
                        break  # answered: the rest would not be read
                    sock.sendall(LIVE[at:at + 1])
                    time.sleep(HEADER_S / 8)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert at < len(LIVE) - 1, "the whole head went out before any answer"
            last_word(Reader(sock), 408, "the request line and headers did not all come within 2 s")

    with ThreadPoolExecutor(4) as pool:
        cases = [pool.submit(cut_short, head) for head in (post(HOT, infer())[:30], post(ASGI, infer())[:50],
                                                           LIVE[:20])]
        cases.append(pool.submit(steady))
        for case in cases:
            case.result()


def test_a_body_that_stops_coming_is_answered_408(server: Server) -> None:
    """A body may pause at most the body timeout between two reads: on the hot routes, the ASGI ones, and a
    Starlette route that reads a JSON body (without a traceback in the log: nobody reads its answer)."""
    def stopped(request: bytes) -> None:
        with connect(server) as sock:
            sock.settimeout(30)
            sock.sendall(request[:-5])
            sent = time.monotonic()
            last_word(Reader(sock), 408, "no more of the request body came for 2 s")
            assert time.monotonic() - sent > BODY_S * 0.9

    requests = (post(HOT, infer()), post(ASGI, infer()), post("/v2/repository/index", b'{"ready": false}'))
    with ThreadPoolExecutor(3) as pool:  # side by side
        list(pool.map(stopped, requests))
    assert "Traceback" not in server.logs()


def test_slow_steady_clients_and_slow_answers_are_not_timed_out(server: Server) -> None:
    """What the read timeouts leave alone: a body that keeps coming, however long it takes in all; a client
    that waits for its 100 Continue and then takes its time; a request that waits for its answer longer
    than the timeouts (the request timeout's business); pipelined requests waiting their turn."""
    def one(path: str) -> None:
        with connect(server) as sock:
            reader = Reader(sock)
            request = post(path, infer())
            cut = request.index(b"\r\n\r\n") + 4
            sock.sendall(request[:cut])
            step = (len(request) - cut) // 6 + 1
            for at in range(cut, len(request), step):  # 6 pauses of a third of the timeout: 4 s in all
                time.sleep(BODY_S / 3)
                sock.sendall(request[at:at + step])
            assert reader.response()[0] == 200, path

            body = infer()
            sock.sendall(post(path, b"", "expect: 100-continue").replace(
                b"content-length: 0", f"content-length: {len(body)}".encode()))
            assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
            time.sleep(BODY_S * 0.75)
            sock.sendall(body)
            assert reader.response()[0] == 200, path

            # 3 s waiting for its answer, and a request pipelined behind it: the gateway reads the second's
            # body, sent meanwhile, only when its turn comes (flow control), and that is not the client's pause
            second = post(path, infer() + b" " * 90_000)
            sock.sendall(post(path, infer(1.5 * BODY_S)))
            time.sleep(0.3)
            sock.sendall(second[:1000])
            time.sleep(0.3)
            sock.sendall(second[1000:])
            for _ in range(2):
                status, _, answer = reader.response()
                assert status == 200, (path, answer)
            sock.sendall(LIVE)
            assert reader.response()[0] == 200

    with ThreadPoolExecutor(2) as pool:  # the two routes side by side (their waits overlap)
        list(pool.map(one, (HOT, ASGI)))


def test_a_connection_that_sends_nothing_closes_as_an_idle_one(server: Server) -> None:
    """A connection that never sends a byte is closed after the keep-alive timeout, as one idle after an
    answer is (it stayed open for good), and without an answer: it asked nothing."""
    with connect(server) as sock:
        sock.settimeout(30)
        opened = time.monotonic()
        assert sock.recv(1024) == b""
        assert time.monotonic() - opened > KEEP_ALIVE_S * 0.9


def test_an_error_ends_a_pipelined_connection_after_the_answers_before_it(server: Server) -> None:
    """Requests pipelined in one write ahead of a malformed one (a bad request line, a bad chunk in the
    body, a head over the limit): each is answered, in order, then the 400 (or 431), then the connection
    closes. The 400 came at once and the answers before it were lost."""
    bad_chunk = b"POST %s HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{\"a\":\r\nzz\r\n"
    for path in (HOT, ASGI):
        for bad, words in ((b"\x01GARBAGE / HTTP/1.1\r\n\r\n", "malformed HTTP request"),
                           (bad_chunk % path.encode(), "malformed HTTP request: Invalid character in chunk size")):
            with connect(server) as sock:
                sock.sendall(post(path, infer(0.2), "x-request-id: a") + LIVE + post(path, infer(), "x-request-id: b")
                             + bad)
                reader = Reader(sock)
                status, headers, _ = reader.response()
                assert (status, headers.get("x-request-id")) == (200, "a"), path
                assert reader.response()[0] == 200
                status, headers, _ = reader.response()
                assert (status, headers.get("x-request-id")) == (200, "b"), path
                last_word(reader, 400, words)
        with connect(server) as sock:  # a head past 64 KiB, its first part in the same write
            sock.sendall(post(path, infer(0.2)) + b"GET /v2/health/live HTTP/1.1\r\nx-big: ")
            for _ in range(100):  # 400 KiB
                sock.sendall(b"a" * 4096)
            reader = Reader(sock)
            assert reader.response()[0] == 200
            last_word(reader, 431, "over the limit of 65536 bytes")


def test_an_http2_client_is_told_there_is_no_grpc(server: Server) -> None:
    """A gRPC client (perf_analyzer -i grpc, tritonclient.grpc) or curl --http2-prior-knowledge opens with
    HTTP/2's preface: its 400, and the gateway's log, say that the server speaks HTTP/1.1 only and has no
    gRPC, not "Pause on PRI/Upgrade" (llhttp's words). Whole, and in two reads split mid-line."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
    for parts in ((preface,), (preface[:7], preface[7:])):
        with connect(server) as sock:
            for part in parts:
                sock.sendall(part)
                time.sleep(0.05)  # two reads for the gateway, not one
            last_word(Reader(sock), 400, "no gRPC endpoint")
    assert "no gRPC endpoint" in server.logs()


def test_a_client_still_sending_reads_its_error_answer(server: Server) -> None:
    """A client that sends its whole request before it reads (most do) while the gateway has already
    refused it: the gateway answers, then reads and drops what still comes until the client closes,
    instead of closing at once (the kernel reset the connection under the client's sends, which failed,
    and the answer was lost with it). The 413 of a body over the limit on both kinds of route (the ASGI one
    closing only when the client asked for it), the 431 of a head over its limit, the 400 of a bad one."""
    blob = b"[" + b"1," * 2_000_000  # 4 MB: more than the socket buffers hold
    cases = [(HOT, (), 413, "over the limit of 100000"), (ASGI, ("connection: close",), 413, "over the limit"),
             ("/fn/sleepy", (), 413, "over the limit of 100000")]
    for path, headers, status, words in cases:
        with connect(server) as sock:
            sock.settimeout(30)
            sock.sendall(post(path, blob, *headers))  # no error: the gateway read and dropped the body
            last_word(Reader(sock), status, words)
    for request, status, words in ((b"GET / HTTP/1.1\r\nx-big: " + blob, 431, "over the limit of 65536"),
                                   (b"\x01GARBAGE\r\n\r\n" + blob, 400, "malformed HTTP request")):
        with connect(server) as sock:
            sock.settimeout(30)
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            last_word(Reader(sock), status, words)


def test_a_client_that_half_closes_still_reads_its_answers(server: Server) -> None:
    """A client that shuts down its sending side once its requests are sent (HTTP/1.0 clients, `nc -N`, some
    proxies) gets the answers owed to them, the last saying `connection: close`, then the end of the
    connection; a request it cut short gets 400. The gateway closed at the client's EOF, and the answers were
    lost."""
    staggered = (post(HOT, infer(0.3), "x-request-id: a"), post(ASGI, infer(), "x-request-id: b"))
    for parts, ids in (((post(HOT, infer(0.2), "x-request-id: a"),), "a"),
                       ((post(ASGI, infer(0.2), "x-request-id: a"),), "a"),
                       ((post("/fn/sleepy", b'{"x": [0.2]}', "x-request-id: a", version="1.0"),), "a"),
                       (staggered, "ab"), ((staggered[0] + LIVE + staggered[1],), "a-b")):
        with connect(server) as sock:
            for part in parts:  # the second once the first waits for its answer
                sock.sendall(part)
                time.sleep(0.1)
            sock.shutdown(socket.SHUT_WR)
            reader = Reader(sock)
            for want in ids:
                status, headers, body = reader.response()
                assert (status, headers.get("x-request-id", "-")) == (200, want), (parts, body)
            assert headers.get("connection") == "close", parts
            assert reader.closed(), parts
    for path in (HOT, ASGI):
        request = post(path, infer(0.2), "x-request-id: a")
        for cut in (request[:30], request[:-5]):  # in its head, in its body: after the answer owed before it
            with connect(server) as sock:
                sock.sendall(request + cut)
                sock.shutdown(socket.SHUT_WR)
                reader = Reader(sock)
                assert reader.response()[0] == 200
                last_word(reader, 400, "the client closed its side before the request was complete")


def test_the_head_limit_holds_wherever_reads_begin_and_end(server: Server) -> None:
    """The 64 KiB limit on a request's line and headers counts the head itself, however the client's bytes
    fall into the gateway's reads: a head over it is refused (431) when it comes in one read, alone or after
    other requests, whole or still open at the read's end (the read a head began in was not counted: heads
    up to 256 KiB passed), and requests pipelined in a read that began inside a head are all served (the
    limit counted the whole read against the first request's head, and refused the one open where 64 KiB
    ended: 431 after ~450 small requests)."""
    def head(size: int) -> bytes:
        return b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * size + b"\r\n\r\n"

    request = post(HOT, infer())
    for before in (b"", request * 300):
        with connect(server) as sock:
            sock.sendall(before + head(63_000))
            reader = Reader(sock)
            for _ in range(before.count(b"POST") + 1):
                assert reader.response()[0] == 200
        for parts in ((head(66_000),), (head(100_000)[:80_000], head(100_000)[80_000:])):  # whole; open at the end
            with connect(server) as sock:
                sock.sendall(before + parts[0])
                for part in parts[1:]:
                    time.sleep(0.2)
                    sock.sendall(part)
                reader = Reader(sock)
                for _ in range(before.count(b"POST")):
                    assert reader.response()[0] == 200
                last_word(reader, 431, "over the limit of 65536 bytes")
    with connect(server) as sock:
        sock.sendall(request[:20])
        time.sleep(0.2)  # read alone: the next read begins inside this head
        sock.sendall(request[20:] + request * 600)  # 86 KB
        reader = Reader(sock)
        for at in range(601):
            status, _, body = reader.response()
            assert status == 200, (at, body)


def test_a_client_that_reads_nothing_is_cut_after_the_write_timeout(server: Server) -> None:
    """A client that leaves its answers unread once the socket buffers are full (here: answers larger than
    the kernel's buffers can grow) has its connection cut once nothing has been sent to it for the write
    timeout (checked every write timeout: within twice that), whether the connection is kept alive or
    closing after its answer (HTTP/1.0); what the kernel had taken still comes, then the end. Before, the
    gateway held the connection, the answers it owed and the requests pipelined behind them for as long as
    the client kept its socket open. A client that reads slowly but steadily is not cut."""
    kernel = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2]) \
        + int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[1])
    zeros = (kernel + 1_000_000) // 4  # "0.0," each
    wide = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [zeros]}]})
    for requests in (post("/v2/models/wide/infer", wide) * 3, post("/v2/models/wide/infer", wide, version="1.0")):
        with connect(server) as sock:
            sock.sendall(requests)
            time.sleep(3 * WRITE_S)
            sock.settimeout(30)
            with pytest.raises(AssertionError, match="connection closed mid-body"):
                Reader(sock).response()
    with connect(server) as sock:  # 640 KB/s
        sock.sendall(post("/v2/models/wide/infer", wide))
        read, until = b"", time.monotonic() + 3 * WRITE_S
        while time.monotonic() < until:
            read += sock.recv(65536)
            time.sleep(0.1)
        reader = Reader(sock)
        reader.buf = read
        status, _, body = reader.response()
        assert (status, orjson.loads(body)["outputs"][0]["shape"]) == (200, [zeros])


def ends_while_sending(sock: socket.socket, reader: Reader, more: bytes, seconds: float) -> bool:
    """Send `more` again and again for up to `seconds`, reading meanwhile: whether the connection ended."""
    sock.setblocking(False)
    try:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            try:
                sock.send(more)
            except BlockingIOError:
                pass
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            if not chunk:
                return True
            reader.buf += chunk
        return False
    except (BrokenPipeError, ConnectionResetError):
        return True
    finally:
        sock.setblocking(True)


def test_a_body_answered_before_it_is_read_is_not_read_to_its_end(server: Server) -> None:
    """A request answered before its body is read (413 for a Content-Length over the limit, 400 for a bad
    model name, 404 for no such route) whose body is over the limit, declared or sent (chunked): the gateway
    drops no more than the limit of it, then ends the connection (lingering), on every kind of route. It read
    the rest to its end to keep the connection alive, however long the client kept sending: 10 GB in 6 s, a
    terabyte for hours. A small body answered early is still dropped, and the connection kept."""
    huge = "content-length: 1000000000000"
    chunk = b"%x\r\n%s\r\n" % (60_000, b" " * 60_000)
    cases = [(ASGI, huge, 413), ("/v2/repository/index", huge, 413), ("/nope", huge, 404),
             ("/v2/models/bad..name/infer", huge, 400),
             (ASGI, "transfer-encoding: chunked", 413), ("/v2/repository/index", "transfer-encoding: chunked", 413)]
    for path, length, status in cases:
        with connect(server) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nhost: t\r\n{length}\r\n\r\n".encode())
            reader = Reader(sock)
            ended = ends_while_sending(sock, reader, chunk if "chunked" in length else b"x" * 65536, 2.5 * BODY_S)
            assert reader.response()[0] == status, path
            assert ended and reader.closed(), path
    with connect(server) as sock:
        sock.sendall(post("/nope", b"x" * 50_000) + LIVE)
        reader = Reader(sock)
        assert [reader.response()[0], reader.response()[0]] == [404, 200]


def test_answers_that_keep_the_connection_say_for_how_long(server: Server) -> None:
    """Every answer that keeps its connection says how long the connection may then idle before the gateway
    closes it (`keep-alive: timeout=3`, the keep-alive timeout set), on the hot routes and the others, so that
    the clients that read it retire a connection before the gateway closes it under a request; answers that
    end the connection do not. The connection closes after that long idle."""
    for request in (post(HOT, infer()), post(ASGI, infer()), LIVE):
        with connect(server) as sock:
            sock.settimeout(30)
            reader = Reader(sock)
            sock.sendall(request)
            status, headers, _ = reader.response()
            assert (status, headers.get("keep-alive"), headers.get("connection")) == (200, "timeout=3", None)
            answered = time.monotonic()
            assert reader.closed()
            assert KEEP_ALIVE_S * 0.9 < time.monotonic() - answered < KEEP_ALIVE_S + 2
        closing = request.replace(b"host: test\r\n", b"host: test\r\nconnection: close\r\n")
        with connect(server) as sock:
            sock.sendall(closing)
            status, headers, _ = Reader(sock).response()
            assert (status, headers.get("keep-alive"), headers.get("connection")) == (200, None, "close")
