"""Compressed answers: an infer request's Accept-Encoding, as Triton's HTTP server reads it, on a real
`despina serve` (tritonclient's response_compression_algorithm, and raw HTTP for the headers)."""
from __future__ import annotations

import gzip
import socket
import zlib
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from despina.examples import mlp_numpy
from despina.gateway.compression import INLINE_MAX, SMALLEST, chosen

from .conftest import Server

X = np.random.default_rng(5).standard_normal((40, 256)).astype(np.float32)  # answers over SMALLEST
INFLATE = {"gzip": gzip.decompress, "deflate": zlib.decompress}


@pytest.fixture(scope="module")
def client(example_server: Server) -> httpclient.InferenceServerClient:
    c = httpclient.InferenceServerClient(example_server.url.removeprefix("http://"))
    yield c
    c.close()


def binary_body(request_id: str) -> tuple[bytes, int]:
    header = orjson.dumps({"id": request_id, "inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32",
                                                        "parameters": {"binary_data_size": X.nbytes}}],
                           "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
    return header + X.tobytes(), len(header)


def json_body(request_id: str) -> bytes:
    return orjson.dumps({"id": request_id, "inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32",
                                                      "data": X.reshape(-1).tolist()}]})


def raw_post(server: Server, path: str, body: bytes, headers: dict[str, str]) -> tuple[httpx.Response, bytes]:
    """The answer and its body as it came on the wire (httpx would inflate it)."""
    with httpx.Client(base_url=server.url, timeout=30) as http, \
            http.stream("POST", path, content=body, headers=headers) as r:
        return r, b"".join(r.iter_raw())


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_reads_a_compressed_answer(client: httpclient.InferenceServerClient, algorithm: str,
                                                binary: bool) -> None:
    inp = httpclient.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    result = client.infer("mlp", [inp], outputs=[out], request_id="packed",
                          response_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("y"), mlp_numpy(X), rtol=1e-4, atol=1e-5)
    assert result.get_response()["id"] == "packed"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_binary_answer_is_compressed_whole_and_its_header_length_counts_it_uncompressed(
        example_server: Server, algorithm: str) -> None:
    body, length = binary_body("b")
    headers = {"Inference-Header-Content-Length": str(length)}
    # (httpx asks for gzip and deflate unless told otherwise)
    plain, plain_raw = raw_post(example_server, "/v2/models/mlp/infer", body, {**headers, "Accept-Encoding": "identity"})
    packed, raw = raw_post(example_server, "/v2/models/mlp/infer", body, {**headers, "Accept-Encoding": algorithm})
    assert plain.status_code == packed.status_code == 200
    assert "content-encoding" not in plain.headers
    assert packed.headers["content-encoding"] == algorithm
    assert int(packed.headers["content-length"]) == len(raw)
    assert INFLATE[algorithm](raw) == plain_raw  # the JSON header and the tensors, all of it
    # as Triton: the JSON header's length in the answer as inflated, the content type unchanged
    assert packed.headers["inference-header-content-length"] == plain.headers["inference-header-content-length"]
    assert packed.headers["content-type"] == plain.headers["content-type"] == "application/octet-stream"
    result = httpclient.InferResult.from_response_body(
        raw, header_length=int(packed.headers["inference-header-content-length"]), content_encoding=algorithm)
    np.testing.assert_allclose(result.as_numpy("y"), mlp_numpy(X), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("path", ["/v2/models/mlp/versions/1/infer",
                                  "/v2/models/ml%70/infer"])  # an escaped name: served through ASGI
def test_json_answer_is_compressed(example_server: Server, algorithm: str, path: str) -> None:
    packed, raw = raw_post(example_server, path, json_body("j"),
                           {"Accept-Encoding": algorithm, "X-Request-ID": "trace-1"})
    assert packed.status_code == 200 and packed.headers["content-encoding"] == algorithm
    assert packed.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in packed.headers
    assert packed.headers["x-request-id"] == "trace-1"
    doc = orjson.loads(INFLATE[algorithm](raw))
    assert doc["id"] == "j"
    np.testing.assert_allclose(np.array(doc["outputs"][0]["data"], np.float32).reshape(40, 10), mlp_numpy(X),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("accept, expected", [
    ("gzip, deflate", "gzip"),                   # the first of equals (httpx's, requests', aiohttp's own)
    ("deflate, gzip", "deflate"),
    ("gzip;q=0.5, deflate", "deflate"),          # the highest q
    ("deflate;q=0.2, gzip;q=0.8", "gzip"),
    ("br, zstd, deflate", "deflate"),            # codings Triton does not write are passed over
    ("identity, gzip", None),                    # identity listed first among equals: as it is
    ("gzip;q=0", None),                          # not acceptable
    ("br", None),                                # nothing it writes: the answer as it is, not a 406
    ("*", None),
    ("gzip;q=nonsense", None),                   # an entry that does not parse is passed over
    (",,;q=1", None),
    ("", None),
])
def test_accept_encoding_picks_as_triton_and_an_unknown_one_answers_uncompressed(
        example_server: Server, accept: str, expected: str | None) -> None:
    packed, raw = raw_post(example_server, "/v2/models/mlp/infer", json_body("q"), {"Accept-Encoding": accept})
    assert packed.status_code == 200
    assert packed.headers.get("content-encoding") == expected
    doc = orjson.loads(INFLATE[expected](raw) if expected else raw)
    assert doc["id"] == "q" and doc["outputs"][0]["shape"] == [40, 10]


@pytest.mark.parametrize("binary", [False, True])
def test_a_small_answer_goes_as_it_is_though_compression_was_asked(example_server: Server, binary: bool) -> None:
    """Under SMALLEST bytes zlib costs more than the bytes it saves: one row's answer is sent as it is (HTTP
    lets a server answer in identity whatever Accept-Encoding says), and tritonclient reads it so."""
    row = X[:1]
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                       **({"parameters": {"binary_data_size": row.nbytes}} if binary
                                          else {"data": row.reshape(-1).tolist()})}],
                           "outputs": [{"name": "y", "parameters": {"binary_data": binary}}]})
    body = header + row.tobytes() if binary else header
    extra = {"Inference-Header-Content-Length": str(len(header))} if binary else {}
    answer, raw = raw_post(example_server, "/v2/models/mlp/infer", body, {**extra, "Accept-Encoding": "gzip"})
    assert answer.status_code == 200 and "content-encoding" not in answer.headers and len(raw) < SMALLEST
    if not binary:
        assert orjson.loads(raw)["outputs"][0]["shape"] == [1, 10]


def test_errors_and_other_routes_are_not_compressed(example_server: Server) -> None:
    # as Triton: an error's JSON goes as it is; so does everything but an infer answer
    for path, body in [("/v2/models/nope/infer", json_body("e")),
                       ("/v2/models/mlp/infer", b'{"inputs": []}'),
                       ("/v2/models/mlp/infer", b"{"),
                       ("/v2/repository/index", b"{}")]:
        r, raw = raw_post(example_server, path, body, {"Accept-Encoding": "gzip"})
        assert "content-encoding" not in r.headers, path
        orjson.loads(raw)
    with httpx.Client(base_url=example_server.url) as http:
        r = http.get("/v2/models/mlp", headers={"Accept-Encoding": "gzip"})
        assert r.status_code == 200 and "content-encoding" not in r.headers


def test_several_accept_encoding_lines_read_as_one_list(example_server: Server) -> None:
    body = json_body("m")
    request = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nAccept-Encoding: br\r\n"
               b"Accept-Encoding: deflate\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
    address = urlsplit(example_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, raw = answer.split(b"\r\n\r\n", 1)
    assert b"\r\ncontent-encoding: deflate\r\n" in head.lower()
    assert orjson.loads(zlib.decompress(raw))["id"] == "m"


@pytest.mark.parametrize("accept, expected", [
    (b"gzip", b"gzip"), (b"GZIP", b"gzip"), (b" deflate ; q=0.9 , gzip ;q=0.8", b"deflate"),
    (b"gzip;q=1.0, deflate;q=1.0", b"gzip"), (b"x-gzip", None), (b"gzip;level=1", None),
    (b"identity;q=0.5, gzip;q=0.4", None), (b"gzip;q=-1", None), (b"gzip;q=", None),
])
def test_chosen(accept: bytes, expected: bytes | None) -> None:
    assert chosen(accept) == expected


def test_a_large_answer_is_compressed_off_the_event_loop_and_the_same(example_server: Server) -> None:
    # 128 rows' JSON answer is past compression.INLINE_MAX: compressed in a thread, then sent
    x = np.random.default_rng(6).standard_normal((128, 256)).astype(np.float32)
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [128, 256], "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.nbytes}}]})
    headers = {"Inference-Header-Content-Length": str(len(header))}
    plain, plain_raw = raw_post(example_server, "/v2/models/mlp/infer", header + x.tobytes(),
                                {**headers, "Accept-Encoding": "identity"})
    packed, raw = raw_post(example_server, "/v2/models/mlp/infer", header + x.tobytes(),
                           {**headers, "Accept-Encoding": "gzip"})
    assert len(plain_raw) > INLINE_MAX and packed.headers["content-encoding"] == "gzip"
    assert gzip.decompress(raw) == plain_raw and int(packed.headers["content-length"]) == len(raw) < len(plain_raw)
    data = orjson.loads(plain_raw)["outputs"][0]["data"]
    np.testing.assert_allclose(np.array(data, np.float32).reshape(128, 10), mlp_numpy(x), rtol=1e-4, atol=1e-5)
