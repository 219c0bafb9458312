"""Triton's generate extension (/generate and /generate_stream) on a real `despina serve`: a text model in
Python, batched and not, an ONNX model with numeric inputs, the errors, and a decoupled model refused at
load with its reason."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from despina.examples import build_add_sub

from .conftest import Server, module_server

# text_output: the text it got, "|", and the parameters it got (sorted JSON); "fail" fails the request
TEXT = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            said = text.reshape(-1)[0].decode()
            if said == "fail":
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("asked to fail")))
                continue
            reply = said + "|" + json.dumps(json.loads(request.parameters()), sort_keys=True)
            out = np.array([reply.encode()] * text.size, dtype=np.object_).reshape(text.shape)
            length = np.full(text.shape, len(said), dtype=np.int32)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("text_output", out), pb_utils.Tensor("length", length)]))
        return responses
'''

TEXT_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: {batch}
input [ {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "length", data_type: TYPE_INT32, dims: [ 1 ] }}
]
'''

DECOUPLED_CONFIG = TEXT_CONFIG.format(name="streamer", batch=0) + '''
model_transaction_policy { decoupled: true }
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("generate-repo")
    for name, batch in (("text", 8), ("text_unbatched", 0)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(TEXT)
        (root / name / "config.pbtxt").write_text(TEXT_CONFIG.format(name=name, batch=batch))
    (root / "streamer" / "1").mkdir(parents=True)
    (root / "streamer" / "1" / "model.py").write_text(TEXT)
    (root / "streamer" / "config.pbtxt").write_text(DECOUPLED_CONFIG)
    (root / "add_sub" / "1").mkdir(parents=True)
    (root / "add_sub" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    build_add_sub(root / "add_sub" / "1" / "model.onnx")
    yield from module_server(root, tmp_path_factory, redis_url, ("text", "text_unbatched", "add_sub"))


def post(server: Server, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v2/models/{path}", content=content, timeout=30)


def events(r: httpx.Response) -> list[dict]:
    """The data of each server-sent event in a whole body."""
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = r.text.split("\n\n")
    assert chunks[-1] == ""  # every event ends with a blank line
    out = []
    for chunk in chunks[:-1]:
        assert chunk.startswith("data: "), chunk
        out.append(json.loads(chunk.removeprefix("data: ")))
    return out


@pytest.mark.parametrize("model", ["text", "text_unbatched"])
def test_generate_maps_keys_to_inputs_and_parameters_and_outputs_to_keys(server: Server, model: str) -> None:
    r = post(server, f"{model}/generate", {"text_input": "hello", "parameters": {"temperature": 0.5},
                                           "stream": False, "max_tokens": 7})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    # every key that is not an input is a parameter, beside "parameters" or in it
    assert r.json() == {"model_name": model, "model_version": "1", "length": 5,
                        "text_output": 'hello|{"max_tokens": 7, "stream": false, "temperature": 0.5}'}


def test_generate_with_a_version_in_the_path(server: Server) -> None:
    r = post(server, "text/versions/1/generate", {"text_input": "v"})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "v|{}"
    assert post(server, "text/versions/2/generate", {"text_input": "v"}).status_code == 404


def test_generate_stream_answers_one_event(server: Server) -> None:
    r = post(server, "text/generate_stream", {"text_input": "hi", "parameters": {"n": 1}})
    assert r.status_code == 200, r.text
    assert events(r) == [{"model_name": "text", "model_version": "1", "length": 2,
                          "text_output": 'hi|{"n": 1}'}]


def test_generate_numeric_lists(server: Server) -> None:
    r = post(server, "add_sub/generate", {"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]})
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "add_sub", "model_version": "1", "sum": [2.0, 3.0, 4.0, 5.0],
                        "diff": [0.0, 1.0, 2.0, 3.0]}
    r = post(server, "add_sub/generate", {"a": [1, 2, 3], "b": [1, 1, 1]})  # its dims are [4]
    assert r.status_code == 400 and "'a'" in r.json()["error"], r.text


def test_scheduling_parameters_are_read_not_passed_on(server: Server) -> None:
    r = post(server, "text/generate", {"text_input": "p", "parameters": {"priority": 0, "timeout": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "p|{}"
    r = post(server, "text/generate", {"text_input": "p", "priority": -1})
    assert r.status_code == 400 and "priority" in r.json()["error"]


@pytest.mark.parametrize("body, words", [
    (b"{not json", "malformed JSON"),
    ([1, 2], "a generate request is a JSON object"),
    ({"text_input": "a", "parameters": [1]}, "field 'parameters' must be an object"),
    ({"text_input": "a", "extra": {"nested": 1}}, "field 'extra' is not an input of model 'text'"),
    ({"text_input": "a", "n": 1, "parameters": {"n": 2}}, "parameter 'n' is given twice"),
    ({"text_input": "a", "parameters": {"n": None}}, "parameter 'n' must be a string, a number or a boolean"),
    ({"text_input": 5}, "BYTES data must be strings"),
    ({"text_input": ["a", "b"]}, "text_input"),
    ({"text_input": [[["a"]]]}, "nested more than"),
    ({}, "text_input"),
])
def test_bad_requests_get_400_with_a_reason(server: Server, body: object, words: str) -> None:
    for route in ("generate", "generate_stream"):  # refused before inference: JSON errors from both
        r = post(server, f"text/{route}", body)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"] == "application/json"
        assert words in r.json()["error"], r.json()


def test_unknown_model_is_404(server: Server) -> None:
    r = post(server, "nope/generate", {"text_input": "a"})
    assert r.status_code == 404 and "nope" in r.json()["error"]


def test_a_model_failure_is_an_error_event_from_generate_stream_and_an_error_from_generate(
        server: Server) -> None:
    r = post(server, "text/generate_stream", {"text_input": "fail"})
    assert r.status_code == 200
    assert events(r) == [{"error": "model 'text': asked to fail"}]
    r = post(server, "text/generate", {"text_input": "fail"})
    assert r.status_code == 500 and r.json() == {"error": "model 'text': asked to fail"}


def test_a_decoupled_model_is_refused_at_load_with_its_reason(server: Server) -> None:
    index = httpx.post(f"{server.url}/v2/repository/index", timeout=30).json()
    row = next(row for row in index if row["name"] == "streamer")
    assert row["state"] == "UNAVAILABLE"
    assert "decoupled models (model_transaction_policy.decoupled) are not supported" in row["reason"]
    r = post(server, "streamer/generate_stream", {"text_input": "a"})
    assert r.status_code == 503 and "decoupled" in r.json()["error"]
