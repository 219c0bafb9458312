"""The gateway's connections on the wire (gateway/connection.py), over raw sockets: an error that ends a
pipelined connection comes after the answers owed before it."""
from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest

from .conftest import EMBEDDED, Server, module_server
from .test_gateway_http import Reader, connect, post

# answers x, after sleeping x[0] seconds
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("repo")
    (repo / "sleepy" / "1").mkdir(parents=True)
    (repo / "sleepy" / "1" / "model.py").write_text(SLEEPY)
    (repo / "sleepy" / "config.pbtxt").write_text(CONFIG)
    yield from module_server(repo, tmp_path_factory, redis_url, ("sleepy",), use_redis=not EMBEDDED)


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
            try:
                for _ in range(100):  # the read the head began in is not counted, and reads go up to 256 KiB
                    sock.sendall(b"a" * 4096)
            except (BrokenPipeError, ConnectionResetError):
                pass
            reader = Reader(sock)
            assert reader.response()[0] == 200
            last_word(reader, 431, "over the limit of 65536 bytes")
