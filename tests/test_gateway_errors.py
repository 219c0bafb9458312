"""Bad input gets a clear error with the right status, never a 500 or a hang."""
from __future__ import annotations

import gzip
import zlib

import httpx
import numpy as np
import orjson
import pytest

from .conftest import Server

ROW = [0.5] * 256


def v2(inputs: list[dict], **extra: object) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


def x_input(**changes: object) -> dict:
    return {"name": "x", "shape": [1, 256], "datatype": "FP32", "data": ROW, **changes}


CASES = [
    # (name, path, body, headers, status, words in the message)
    ("unknown model", "/v2/models/nope/infer", v2([x_input()]), {}, 404, "Request for unknown model: 'nope' is not found"),
    ("unknown version", "/v2/models/mlp/versions/9/infer", v2([x_input()]), {}, 404,
     "Request for unknown model: 'mlp' version 9 is not found"),
    ("version not a number", "/v2/models/mlp/versions/abc/infer", v2([x_input()]), {}, 404,
     "no such model version 'abc': a version is a number"),
    ("wrong datatype", "/v2/models/mlp/infer", v2([x_input(datatype="INT32")]), {}, 400,
     "the model expects FP32"),
    ("unknown datatype", "/v2/models/mlp/infer", v2([x_input(datatype="FP128")]), {}, 400, "datatype"),
    ("wrong shape", "/v2/models/mlp/infer", v2([x_input(shape=[1, 255], data=ROW[:255])]), {}, 400,
     "does not match"),
    ("wrong rank", "/v2/models/mlp/infer", v2([x_input(shape=[256])]), {}, 400, "dimensions"),
    ("batch over max", "/v2/models/mlp/infer", v2([x_input(shape=[129, 256], data=[0.0] * 129 * 256)]), {},
     400, "max_batch_size"),
    ("data length", "/v2/models/mlp/infer", v2([x_input(data=ROW[:100])]), {}, 400, "has 100 elements"),
    ("data not numbers", "/v2/models/mlp/infer", v2([x_input(data=["a"] * 256)]), {}, 400, "must be numbers"),
    ("a bool among numbers", "/v2/models/mlp/infer", v2([x_input(data=[True, *ROW[1:]])]), {}, 400,
     "must be numbers"),
    ("null among numbers", "/v2/models/mlp/infer", v2([x_input(data=[None, *ROW[1:]])]), {}, 400,
     "must be numbers"),
    ("lists mixed with numbers", "/v2/models/mlp/infer", v2([x_input(data=[[0.5, 0.5], *ROW[2:]])]), {}, 400,
     "elements"),
    ("negative dim", "/v2/models/mlp/infer", v2([x_input(shape=[-1, 256])]), {}, 400, "non-negative"),
    ("malformed JSON", "/v2/models/mlp/infer", b'{"inputs": [', {}, 400, "malformed JSON"),
    ("not an object", "/v2/models/mlp/infer", b"[1, 2]", {}, 400, "JSON object"),
    ("no inputs", "/v2/models/mlp/infer", b"{}", {}, 400, "'inputs'"),
    ("missing input", "/v2/models/add_sub/infer",
     v2([{"name": "a", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]), {}, 400, "needs input(s) b"),
    ("unknown input", "/v2/models/mlp/infer", v2([x_input(name="z")]), {}, 400, "has no input 'z'"),
    ("input twice", "/v2/models/mlp/infer", v2([x_input(), x_input()]), {}, 400, "given twice"),
    ("unknown output", "/v2/models/mlp/infer", v2([x_input()], outputs=[{"name": "q"}]), {}, 400,
     "unexpected inference output 'q' for model 'mlp'"),
    ("header length past body", "/v2/models/mlp/infer", v2([x_input()]),
     {"Inference-Header-Content-Length": "100000"}, 400, "past the end"),
    ("header length negative", "/v2/models/mlp/infer", v2([x_input()]),
     {"Inference-Header-Content-Length": "-1"}, 400, "is negative"),
    ("header length not a number", "/v2/models/mlp/infer", v2([x_input()]),
     {"Inference-Header-Content-Length": "ten"}, 400, "integer"),
    ("header length with an underscore", "/v2/models/mlp/infer", v2([x_input()]),
     {"Inference-Header-Content-Length": "1_0"}, 400, "integer"),
    ("header length with a plus", "/v2/models/mlp/infer", v2([x_input()]),
     {"Inference-Header-Content-Length": "+5"}, 400, "integer"),
    ("binary size past body", "/v2/models/mlp/infer",
     v2([{"name": "x", "shape": [1, 256], "datatype": "FP32", "parameters": {"binary_data_size": 1024}}]),
     "binary", 400, "past the end"),
    ("id not a string", "/v2/models/mlp/infer", v2([x_input()], id=5), {}, 400, "'id'"),
    ("binary_data not a bool", "/v2/models/mlp/infer",
     v2([x_input()], outputs=[{"name": "y", "parameters": {"binary_data": "x"}}]), {}, 400,
     "'binary_data' must be true or false"),
    ("binary_data_output not a bool", "/v2/models/mlp/infer", v2([x_input()], parameters={"binary_data_output": 1}),
     {}, 400, "'binary_data_output' must be true or false"),
    ("fn: unknown model", "/fn/nope", b"[1]", {}, 404, "unknown model"),
    ("fn: list for two inputs", "/fn/add_sub", b"[1, 2, 3, 4]", {}, 400, "2 inputs"),
    ("fn: ragged", "/fn/add_sub", b'{"a": [[1, 2, 3, 4], [1]], "b": [[1, 2, 3, 4], [1, 2, 3, 4]]}', {}, 400,
     "ragged"),
    ("fn: wrong width", "/fn/mlp", b"[1, 2, 3]", {}, 400, "does not match"),
    ("fn: malformed", "/fn/mlp", b"{", {}, 400, "malformed JSON"),
]


@pytest.mark.parametrize("name,path,body,headers,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(example_server: Server, name: str, path: str, body: bytes, headers: object, status: int,
                   words: str) -> None:
    if headers == "binary":  # JSON header followed by 10 bytes instead of 1024
        headers = {"Inference-Header-Content-Length": str(len(body))}
        body = body + b"\0" * 10
    r = httpx.post(example_server.url + path, content=body, headers=headers, timeout=10)  # type: ignore[arg-type]
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert words in r.json()["error"]


def test_binary_data_not_claimed_by_any_input(example_server: Server) -> None:
    x = np.ones((1, 256), dtype=np.float32)
    header = v2([{"name": "x", "shape": [1, 256], "datatype": "FP32",
                  "parameters": {"binary_data_size": x.nbytes}}])
    r = httpx.post(example_server.url + "/v2/models/mlp/infer", content=header + x.tobytes() + b"junk",
                   headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400 and "no input claims" in r.json()["error"]


# the hot routes, and the same routes through ASGI (a %-escaped path is uvicorn's to parse)
ENCODED = ["/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer", "/fn/mlp", "/v2/models/ml%70/infer",
           "/fn/ml%70"]


def raw_deflate(body: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(body) + packer.flush()


def answer_of(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    doc = r.json()
    return np.array(doc["outputs"][0]["data"] if "outputs" in doc else doc["y"], dtype=np.float32)


@pytest.mark.parametrize("path", ENCODED)
def test_a_body_in_gzip_or_deflate_is_read(example_server: Server, path: str) -> None:
    body = v2([x_input()]) if path.startswith("/v2") else orjson.dumps(ROW)
    url = example_server.url + path
    want = answer_of(httpx.post(url, content=body))
    half = len(body) // 2  # gzip members one after another (RFC 1952) are one body: they were a 400
    members = gzip.compress(body[:half]) + gzip.compress(body[half:])
    for coding, data in (("gzip", gzip.compress(body)), ("GZip", gzip.compress(body)), ("gzip", members),
                         ("deflate", zlib.compress(body)), ("Deflate", raw_deflate(body)), ("identity", body)):
        r = httpx.post(url, content=data, headers={"content-encoding": coding})
        np.testing.assert_allclose(answer_of(r), want, rtol=1e-5, err_msg=coding)


@pytest.mark.parametrize("path", ENCODED)
def test_a_body_in_another_encoding_or_not_in_its_own_is_refused(example_server: Server, path: str) -> None:
    body = v2([x_input()]) if path.startswith("/v2") else orjson.dumps(ROW)
    url = example_server.url + path
    for coding in ("br", "bogus", "gzip, gzip", "compress"):  # was read as a plain body: 200
        r = httpx.post(url, content=body, headers={"content-encoding": coding})
        assert r.status_code == 415, (coding, r.text)
        assert r.headers["accept-encoding"] == "gzip, deflate"
        assert f"'{coding}' is not supported" in r.json()["error"] and "gzip, deflate" in r.json()["error"]
    packed = gzip.compress(body)
    for coding, data, words in (("gzip", packed[:10] + b"\xff" * 8 + packed[18:], "not valid gzip"),
                                ("gzip", packed[:-12], "truncated"),
                                ("gzip", packed + b"junk", "4 bytes after the end"),
                                ("deflate", body, "not valid deflate")):
        r = httpx.post(url, content=data, headers={"content-encoding": coding})
        assert r.status_code == 400, (words, r.text)
        assert words in r.json()["error"]


def test_metadata_of_unknown_model_and_version(example_server: Server) -> None:
    assert httpx.get(example_server.url + "/v2/models/nope").status_code == 404
    assert httpx.get(example_server.url + "/v2/models/mlp/versions/3").status_code == 404
    assert httpx.get(example_server.url + "/v2/models/mlp/versions/3/config").status_code == 404
    for path in ("/v2/models/nope/ready", "/v2/models/mlp/versions/3/ready"):
        r = httpx.get(example_server.url + path)  # Triton 2.51's answer: an error, not an empty body
        assert r.status_code == 400 and r.json() == {"error": "Model version not ready"}, (path, r.text)


def test_statistics_of_every_model_come_in_tritons_order(example_server: Server) -> None:
    # Triton 2.51 lists them by name, then version (its models are in a sorted map); they came in the
    # order of the gateway's view, which is the catalog's hash order
    stats = httpx.get(example_server.url + "/v2/models/stats").json()["model_stats"]
    names = [(s["name"], int(s["version"])) for s in stats]
    assert len(names) > 2 and names == sorted(names), names


def test_server_keeps_serving_after_bad_input(example_server: Server) -> None:
    r = httpx.post(example_server.url + "/fn/mlp", content=orjson.dumps(ROW))
    assert r.status_code == 200 and len(r.json()["y"]) == 10


VERSIONED = [("GET", ""), ("GET", "/ready"), ("GET", "/config"), ("GET", "/stats"), ("POST", "/infer"),
             ("POST", "/generate")]


@pytest.mark.parametrize("version", ["abc", "1x", "-1", "1234567890123456789"])
def test_a_version_that_is_not_a_number_is_not_found_on_every_route(example_server: Server, version: str) -> None:
    """Triton's routes take a version of digits only, so any other path is no route of its: 404 "Not Found"
    (its http_server.cc, the fall-through of HTTPAPIServer::Handle); a longer number is no model's version.
    Here they answered 400 "not a number" (and the metadata route's own check said 404 "unknown version"):
    every route answers 404, saying what a version is."""
    with httpx.Client(base_url=example_server.url, timeout=30) as http:
        for method, rest in VERSIONED:
            for path in (f"/v2/models/mlp/versions/{version}{rest}", f"/fn/mlp/versions/{version}"):
                body = v2([x_input()]) if method == "POST" else None
                r = http.request(method, path, content=body)
                assert r.status_code == 404, (path, r.status_code, r.text)
                assert f"no such model version '{version}': a version is a number" in r.json()["error"], \
                    (path, r.text)
