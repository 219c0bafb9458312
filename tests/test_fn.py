"""The function URL, `POST /fn/{model}[/versions/{version}]`, as a developer with curl calls it."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from .conftest import Server, module_server
from .control_support import ROW, expected, mlp_folder

ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()
            n = pb_utils.get_input_tensor_by_name(request, "n")
            k = n.as_numpy() if n is not None else np.zeros((len(text), 1), np.int32)
            upper = np.array([[v.upper() for v in row] for row in text], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("upper", upper), pb_utils.Tensor("k", k)]))
        return responses
"""

ECHO_CONFIG = """backend: "python"
max_batch_size: 8
input [ { name: "text", data_type: TYPE_STRING, dims: [ 1 ] },
        { name: "n", data_type: TYPE_INT32, dims: [ 1 ], optional: true } ]
output [ { name: "upper", data_type: TYPE_STRING, dims: [ 1 ] },
         { name: "k", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("fn")
    mlp_folder(repo, "mlp", {1: 0, 2: 1}, extra="version_policy { all { } }")
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "1" / "model.py").write_text(ECHO)
    (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / "stateful" / "1").mkdir(parents=True)
    (repo / "stateful" / "1" / "model.py").write_text(ECHO)
    (repo / "stateful" / "config.pbtxt").write_text(ECHO_CONFIG + "sequence_batching { }\n")
    yield from module_server(repo, tmp_path_factory, redis_url, ("mlp", "echo", "stateful"))


def test_a_version_is_called_by_its_path_as_in_v2(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, seed in (("/fn/mlp", 1), ("/fn/mlp/versions/2", 1), ("/fn/mlp/versions/1", 0)):
            r = http.post(path, json=ROW)
            assert r.status_code == 200, (path, r.text)
            np.testing.assert_allclose(r.json()["y"], expected(seed), rtol=1e-5, err_msg=path)
        for path, status, words in (("/fn/mlp/versions/3", 404, "version 3"),
                                    ("/fn/mlp/versions/x", 404, "version"),
                                    ("/fn/nope/versions/1", 404, "unknown model")):
            r = http.post(path, json=ROW)
            assert r.status_code == status and words in r.json()["error"], (path, r.text)
        assert http.get("/fn/mlp/versions/1").headers["allow"] == "POST"


@pytest.mark.parametrize(("body", "answer"), [
    (b'["ab"]', {"upper": ["AB"], "k": [0]}),  # a bare list: the one input the model needs
    (b'[["ab"], ["cd"]]', {"upper": [["AB"], ["CD"]], "k": [[0], [0]]}),
    (b'{"text": ["ab"], "n": [3]}', {"upper": ["AB"], "k": [3]}),
])
def test_a_bare_list_is_the_one_input_the_model_needs(server: Server, body: bytes, answer: dict) -> None:
    r = httpx.post(f"{server.url}/fn/echo", content=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == answer


@pytest.mark.parametrize(("body", "answer"), [
    (b'"ab"', {"upper": ["AB"], "k": [0]}),  # a bare scalar: the one element of the one input needed
    (b'{"text": "ab", "n": 3}', {"upper": ["AB"], "k": [3]}),
    (b'{"text": "ab", "n": [3]}', {"upper": ["AB"], "k": [3]}),
])
def test_a_scalar_is_the_one_element_of_an_input_that_holds_one(server: Server, body: bytes,
                                                                 answer: dict) -> None:
    r = httpx.post(f"{server.url}/fn/echo", content=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == answer


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/fn/echo", b'{"n": [3]}', "needs input(s) text"),
    ("/fn/echo", b'{"text": 1}', "BYTES data must be strings"),
    ("/fn/echo", b'{"text": "ab", "n": 2.5}', "whole numbers"),
    ("/fn/mlp", b"0.5", "shape [] has 0 dimensions"),  # one number is not a row of 256
    ("/fn/mlp", b'{"x": 0.5}', "shape [] has 0 dimensions"),
    ("/fn/mlp", b"null", "shape [] has 0 dimensions"),
])
def test_what_cannot_be_taken_is_a_400_that_says_why(server: Server, path: str, body: bytes,
                                                     words: str) -> None:
    r = httpx.post(f"{server.url}{path}", content=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_a_form_is_refused_with_the_way_to_send_json(server: Server) -> None:
    # curl -F 'x=[...]' sends multipart/form-data, which no JSON parser reads; orjson's own words
    # ("no digit after sign") left a curl user guessing
    r = httpx.post(f"{server.url}/fn/mlp", files={"x": (None, "[0.5]")}, timeout=30)
    assert r.status_code == 400
    assert "multipart" in r.json()["error"] and "--data-binary" in r.json()["error"], r.text
    # curl -d sends its JSON as application/x-www-form-urlencoded: it is read as JSON all the same
    r = httpx.post(f"{server.url}/fn/mlp", content=b"[" + b"0.5," * 255 + b"0.5]",
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_stateful_model_is_refused_with_where_to_call_it(server: Server) -> None:
    # /fn has no way to name a sequence: its request reached the worker, which answered that "an
    # ensemble's step or a model's call of a stateful model cannot yet", of neither
    r = httpx.post(f"{server.url}/fn/stateful", content=b'"ab"', timeout=30)
    assert r.status_code == 400
    assert r.json()["error"] == ("model 'stateful' is stateful (sequence batching): call it through "
                                 "/v2/models/stateful/infer or .../generate with the parameter 'sequence_id'")
