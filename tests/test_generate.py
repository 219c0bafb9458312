"""Triton's generate extension (/generate and /generate_stream) on a real `despina serve`: a text model in
Python, batched and not, an ONNX model with numeric inputs, the errors; and a decoupled Python model that
streams its responses from a thread, errs, and dies."""
from __future__ import annotations

import gzip
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from despina.contract.errors import InvalidArgument
from despina.contract.keys import GROUP, Keys
from despina.contract.records import InferReply, Tensor
from despina.examples import build_add_sub

from .conftest import Server, module_server, settled_stats
from .control_support import wait_until, worker_hashes

# text_output: the text it got, "|", and the parameters it got (sorted JSON); "fail" fails the request,
# "unavailable" too with the code UNAVAILABLE
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
            if said == "unavailable":
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("not now", pb_utils.TritonError.UNAVAILABLE)))
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

# Answers from a thread after execute returned, as decoupled models do: a response per word of its
# text_input ("length" is the word's place), the last one flagged final; the words below do otherwise.
STREAMER = '''
import os
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def response(word, i):
    return pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([word.encode()], dtype=np.object_)),
                                       pb_utils.Tensor("length", np.array([i], dtype=np.int32))])


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            if text == "raise":
                raise pb_utils.TritonModelException("execute refused")
            if text == "sent then raise":  # a response from execute, then execute raises
                request.get_response_sender().send(response("sent", 0))
                raise pb_utils.TritonModelException("raised after a response")
            threading.Thread(target=self.stream, args=(text, request.get_response_sender())).start()
        return None

    def stream(self, text, sender):
        words = text.split()
        if words[0] == "bare":  # two responses, then the final flag alone
            sender.send(response("x", 0))
            sender.send(response("y", 1))
            sender.send(flags=FINAL)
            try:
                sender.send(response("late", 2), flags=FINAL)
            except pb_utils.TritonModelException:
                return
            os._exit(3)  # a send after the final one must raise
        if words[0] == "patient":  # a word every 50 ms until its client goes away, then it says so
            for i in range(400):
                if sender.is_cancelled():
                    with open(words[1], "w") as f:
                        f.write(str(i))
                    sender.send(flags=FINAL)
                    return
                sender.send(response(f"p{i}", i))
                time.sleep(0.05)
            sender.send(flags=FINAL)
            return
        if words[0] == "none":  # no response: the final flag alone
            sender.send(flags=FINAL)
            return
        if words[0] == "silent":  # never a response, nor the final flag
            return
        if words[0] == "refuse":  # an error response, then the final flag alone
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("no such word")))
            sender.send(flags=FINAL)
            return
        if words[0] == "oops":  # an error response, then a good final one
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("bad word")))
            sender.send(response("after", 1), flags=FINAL)
            return
        for i, word in enumerate(words):
            if word == "crash":
                os._exit(1)
            time.sleep(0.02)
            sender.send(response(word, i), flags=FINAL if i == len(words) - 1 else 0)
'''

# Triton's async execute of a decoupled model (24.04 and later): each request's coroutine runs on the
# process's event loop while the next requests start. "wait" answers once "release" (a later request) came.
ASYNC_STREAMER = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.released = None

    async def execute(self, requests):
        if self.released is None:
            self.released = asyncio.Event()
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            if text == "raise":
                raise pb_utils.TritonModelException("execute refused")
            if text == "wait":
                try:
                    await asyncio.wait_for(self.released.wait(), 10)
                    text = "released"
                except asyncio.TimeoutError:
                    text = "never released"
            elif text == "release":
                self.released.set()
            elif text == "call":  # a model call awaited, then one that blocks, after execute returned
                said = []
                for word in ("async", "blocking"):
                    word_in = pb_utils.Tensor("text_input", np.array([word.encode()], dtype=np.object_))
                    call = pb_utils.InferenceRequest(model_name="text_unbatched", inputs=[word_in],
                                                     requested_output_names=["text_output"])
                    got = await call.async_exec() if word == "async" else call.exec()
                    said.append(pb_utils.get_output_tensor_by_name(got, "text_output").as_numpy()[0].decode())
                text = " ".join(said)
            out = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
            length = pb_utils.Tensor("length", np.array([0], dtype=np.int32))
            request.get_response_sender().send(pb_utils.InferenceResponse([out, length]), flags=FINAL)
'''

# Calls the decoupled model with exec(), and answers with what it got
CALLER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="streamer", requested_output_names=["text_output"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "text_input")])
            got = call.exec()
            said = got.error().message() if got.has_error() else "no error"
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text_output", np.array([said.encode()], dtype=np.object_)),
                pb_utils.Tensor("length", np.array([0], dtype=np.int32))]))
        return out
'''

STREAMER_CONFIG = TEXT_CONFIG.format(name="streamer", batch=0) + '''
model_transaction_policy { decoupled: true }
'''

# A 2 x 2 output and a one-element one, with response parameters
MATRIX = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("matrix", np.array([[1, 2], [3, 4]], dtype=np.int32)),
             pb_utils.Tensor("text_output", np.array([b"done"], dtype=np.object_))],
            parameters={"finish_reason": "stop", "tokens": 3}) for _ in requests]
'''

MATRIX_CONFIG = '''
name: "matrix"
backend: "python"
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [
  { name: "matrix", data_type: TYPE_INT32, dims: [ 2, 2 ] },
  { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] }
]
'''

# Says the shape its input "x" came with ("zz") and its element count ("aa"): names on either side of
# model_name in an answer's keys
SHAPES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("zz", np.array([str(list(x.shape)).encode()], dtype=np.object_)),
                pb_utils.Tensor("aa", np.array([x.size], dtype=np.int32))]))
        return out
'''

SHAPES_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: {batch}
input [ {{ name: "x", data_type: TYPE_FP32, dims: {dims} }} ]
output [
  {{ name: "zz", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "aa", data_type: TYPE_INT32, dims: [ 1 ] }}
]
'''
SHAPES_MODELS = {"shapes": (4, "[ 2 ]"), "shapes_fixed": (0, "[ 2, 2 ]"), "shapes_open": (0, "[ -1, 2, -1 ]")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("generate-repo")
    for name, batch in (("text", 8), ("text_unbatched", 0)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(TEXT)
        (root / name / "config.pbtxt").write_text(TEXT_CONFIG.format(name=name, batch=batch))
    (root / "streamer" / "1").mkdir(parents=True)
    (root / "streamer" / "1" / "model.py").write_text(STREAMER)
    (root / "streamer" / "config.pbtxt").write_text(STREAMER_CONFIG)
    (root / "streamer_sequence" / "1").mkdir(parents=True)
    (root / "streamer_sequence" / "1" / "model.py").write_text(STREAMER)
    (root / "streamer_sequence" / "config.pbtxt").write_text(
        STREAMER_CONFIG.replace('name: "streamer"', 'name: "streamer_sequence"') + "sequence_batching { }\n")
    (root / "async_streamer" / "1").mkdir(parents=True)
    (root / "async_streamer" / "1" / "model.py").write_text(ASYNC_STREAMER)
    (root / "async_streamer" / "config.pbtxt").write_text(STREAMER_CONFIG.replace('"streamer"', '"async_streamer"'))
    (root / "caller" / "1").mkdir(parents=True)
    (root / "caller" / "1" / "model.py").write_text(CALLER)
    (root / "caller" / "config.pbtxt").write_text(TEXT_CONFIG.format(name="caller", batch=0))
    (root / "matrix" / "1").mkdir(parents=True)
    (root / "matrix" / "1" / "model.py").write_text(MATRIX)
    (root / "matrix" / "config.pbtxt").write_text(MATRIX_CONFIG)
    for name, (batch, dims) in SHAPES_MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(SHAPES)
        (root / name / "config.pbtxt").write_text(SHAPES_CONFIG.format(name=name, batch=batch, dims=dims))
    for name, extra in (("add_sub", ""), ("add_sub_decoupled", "model_transaction_policy { decoupled: true }\n")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n{extra}')
        build_add_sub(root / name / "1" / "model.onnx")
    yield from module_server(root, tmp_path_factory, redis_url,
                             ("text", "text_unbatched", "add_sub", "streamer", "async_streamer", "caller",
                              "matrix", *SHAPES_MODELS))


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


def test_a_key_that_starts_with_triton_is_a_parameter_of_generate(server: Server) -> None:
    """Triton 2.51's /generate passes it on to the model (its /infer refuses it: test_parameters.py)."""
    r = post(server, "text/generate", {"text_input": "hi", "triton_x": True})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == 'hi|{"triton_x": true}'


def test_an_output_of_several_elements_is_one_flat_list(server: Server) -> None:
    """Triton writes a tensor's elements as one list whatever its shape (and one element as a scalar)."""
    r = post(server, "matrix/generate", {"text_input": "x"})
    assert r.status_code == 200, r.text
    assert r.json()["matrix"] == [1, 2, 3, 4]
    assert r.json()["text_output"] == "done"


def test_response_parameters_are_keys_of_the_answer(server: Server) -> None:
    """Triton writes each response parameter as a key beside the outputs, not under "parameters"."""
    for route in ("generate", "generate_stream"):
        r = post(server, f"matrix/{route}", {"text_input": "x"})
        assert r.status_code == 200, r.text
        doc = r.json() if route == "generate" else events(r)[0]
        assert doc == {"model_name": "matrix", "model_version": "1", "matrix": [1, 2, 3, 4],
                       "text_output": "done", "finish_reason": "stop", "tokens": 3}


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


def test_an_answers_keys_come_sorted_as_triton_writes_them(server: Server) -> None:
    """Triton 2.51 writes a generate answer's keys in their sorted order, the outputs' among the others."""
    r = post(server, "shapes/generate", {"x": [1, 2], "id": "q"})
    assert r.status_code == 200, r.text
    assert r.content == b'{"aa":2,"id":"q","model_name":"shapes","model_version":"1","zz":"[1, 2]"}'
    r = post(server, "streamer/generate_stream", {"text_input": "one two"})
    assert r.content == (b'data: {"length":0,"model_name":"streamer","model_version":"1","text_output":"one"}\n\n'
                         b'data: {"length":1,"model_name":"streamer","model_version":"1","text_output":"two"}\n\n')


@pytest.mark.parametrize(("model", "value", "shape"), [
    ("shapes", [1, 2], [1, 2]),
    ("shapes", [1, 2, 3, 4], [2, 2]),  # the batch dimension is the one left open
    ("shapes", [[1, 2], [3, 4]], [2, 2]),  # nested lists are their shape (Triton refuses them)
    ("shapes_fixed", [1, 2, 3, 4], [2, 2]),
    ("shapes_open", [1, 2, 3, 4, 5, 6], [1, 2, 3]),  # the last open dimension takes the rest, the others 1
    ("shapes_open", [], [1, 2, 0]),
    ("shapes_open", 7, None),
    ("shapes", [1, 2, 3], None),
    ("shapes_fixed", [1, 2], None),
    ("shapes", list(range(10)), None),  # [5, 2]: past max_batch_size 4
])
def test_a_flat_list_fills_the_models_shape_as_triton_does(server: Server, model: str, value: object,
                                                           shape: list[int] | None) -> None:
    """Triton 2.51 reads an input's value as its elements, in the model's shape (batch dimension
    included, as -1) with each -1 but the last 1 and the last what the count leaves for it."""
    for route in ("generate", "generate_stream"):
        r = post(server, f"{model}/{route}", {"x": value})
        if shape is None:
            assert r.status_code == 400, r.text
            assert "'x'" in r.json()["error"]
            continue
        assert r.status_code == 200, r.text
        doc = r.json() if route == "generate" else events(r)[0]
        assert doc["zz"] == str(shape) and doc["aa"] == math.prod(shape)


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_generate_reads_a_gzip_body(server: Server, route: str) -> None:
    r = httpx.post(f"{server.url}/v2/models/text/{route}", content=gzip.compress(b'{"text_input": "zip"}'),
                   headers={"content-encoding": "gzip"}, timeout=30)
    assert r.status_code == 200, r.text
    assert "zip|{}" in r.text

def test_generate_numeric_lists(server: Server) -> None:
    r = post(server, "add_sub/generate", {"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]})
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "add_sub", "model_version": "1", "sum": [2.0, 3.0, 4.0, 5.0],
                        "diff": [0.0, 1.0, 2.0, 3.0]}
    r = post(server, "add_sub/generate", {"a": [1, 2, 3], "b": [1, 1, 1]})  # its dims are [4]
    assert r.status_code == 400 and "'a'" in r.json()["error"], r.text


def test_the_names_infer_reads_itself_are_parameters_for_the_model_here(server: Server) -> None:
    """Triton 2.51's generate reads no key as /infer's priority, timeout, sequence or binary flags: each
    is a parameter that reaches the model as it came (request.timeout() stays 0)."""
    r = post(server, "text/generate", {"text_input": "p", "priority": -1, "timeout": "soon",
                                       "sequence_id": 7, "parameters": {"binary_data_output": True}})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == ('p|{"binary_data_output": true, "priority": -1, "sequence_id": 7, '
                                       '"timeout": "soon"}')


def test_an_integer_past_int64_reaches_the_model_as_a_double(server: Server) -> None:
    """Triton's parameters hold int64, double, bool or string: a larger integer (up to uint64's and past
    it) comes as a double, beside or in "parameters"."""
    r = post(server, "text/generate", {"text_input": "i", "a": 2**63, "b": -(2**63), "c": 2**63 - 1,
                                       "parameters": {"d": 2**64 - 1, "e": -(2**63) - 1, "f": 2**70}})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == ('i|{"a": 9.223372036854776e+18, "b": -9223372036854775808, '
                                       '"c": 9223372036854775807, "d": 1.8446744073709552e+19, '
                                       '"e": -9.223372036854776e+18, "f": 1.1805916207174113e+21}')


@pytest.mark.parametrize("body, said", [
    # of a key given twice in one object, each time its first value, as rapidjson finds a member
    (b'{"text_input": "t", "n": 1, "n": 2}', 't|{"n": 1}'),
    (b'{"text_input": "t", "n": 1, "n": {"deep": 1}}', 't|{"n": 1}'),
    (b'{"text_input": "t", "parameters": {"n": 1}, "parameters": {"m": 2}}', 't|{"n": 1}'),
    (b'{"text_input": "t", "parameters": {"n": 1, "n": 2}, "n": 3}', 't|{"n": 3}'),
    (b'{"text_input": "t", "id": "a", "id": "b"}', 't|{"id": "a"}'),
])
def test_a_key_given_twice_is_read_as_triton_reads_it(server: Server, body: bytes, said: str) -> None:
    r = post(server, "text/generate", body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == said


@pytest.mark.parametrize("body, words", [
    (b'{"text_input": "a", "text_input": "b"}', "input 'text_input' already exists"),
    (b'{"text_input": "a", "\\u0074ext_input": "b"}', "input 'text_input' already exists"),
    (b'{"text_input": "a", "n": {"deep": 1}, "n": 1}', "field 'n' is not an input"),
    (b'{"parameters": {"n": 1}, "parameters": {"text_input": "b"}}', "text_input"),  # the second unread
])
def test_a_key_given_twice_is_refused_where_triton_refuses_it(server: Server, body: bytes, words: str) -> None:
    r = post(server, "text/generate", body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"], r.text


@pytest.mark.parametrize("body, words", [
    (b"{not json", "malformed JSON"),
    ([1, 2], "a generate request is a JSON object"),
    ({"text_input": "a", "parameters": [1]}, "field 'parameters' must be an object"),
    ({"text_input": "a", "extra": {"nested": 1}}, "field 'extra' is not an input of model 'text'"),
    ({"text_input": "a", "parameters": {"text_input": "b"}}, "input 'text_input' already exists"),
    ({"parameters": {"text_input": "b"}, "text_input": "a"}, "input 'text_input' already exists"),
    ({"text_input": "a", "id": 7}, "field 'id' must be a string"),
    ({"text_input": "a", "parameters": {"n": None}}, "parameter 'n' must be a string, a number or a boolean "
                                                     "(model 'text' has no input of that name)"),
    ({"text_input": 5}, "BYTES data must be strings"),
    ({"text_input": ["a"] * 9}, "text_input"),  # [9, 1]: past max_batch_size 8 (["a", "b"] is a batch of 2)
    ({"text_input": [[["a"]]]}, "nested more than"),
    ({}, "text_input"),
])
def test_bad_requests_get_400_with_a_reason(server: Server, body: object, words: str) -> None:
    for route in ("generate", "generate_stream"):  # refused before inference: JSON errors from both
        r = post(server, f"text/{route}", body)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"] == "application/json"
        assert words in r.json()["error"], r.json()


def test_a_key_of_parameters_that_names_an_input_is_that_input(server: Server) -> None:
    """As Triton reads "parameters" (its generate endpoint test sends an input there): an input by its
    name, any other key a parameter; of a parameter given twice, the later counts."""
    r = post(server, "text/generate", {"parameters": {"text_input": "inside", "n": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == 'inside|{"n": 1}'
    r = post(server, "add_sub/generate", {"a": [1, 2, 3, 4], "parameters": {"b": [1, 1, 1, 1]}})
    assert r.status_code == 200, r.text
    assert r.json()["sum"] == [2.0, 3.0, 4.0, 5.0]
    r = post(server, "text/generate", b'{"text_input": "t", "n": 1, "parameters": {"n": 2}}')
    assert r.status_code == 200 and r.json()["text_output"] == 't|{"n": 2}', r.text
    r = post(server, "text/generate", b'{"parameters": {"n": 2}, "n": 1, "text_input": "t"}')
    assert r.status_code == 200 and r.json()["text_output"] == 't|{"n": 1}', r.text


def test_the_requests_id_comes_back_in_each_response(server: Server) -> None:
    """Triton's generate: a string "id" is the request's id (and, as any key, a parameter), and every
    response carries it."""
    r = post(server, "text/generate", {"text_input": "i", "id": "req-7"})
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "text", "model_version": "1", "id": "req-7", "length": 1,
                        "text_output": 'i|{"id": "req-7"}'}
    r = post(server, "streamer/generate_stream", {"text_input": "one two", "id": "s-1"})
    assert r.status_code == 200, r.text
    assert [(d["id"], d["text_output"]) for d in events(r)] == [("s-1", "one"), ("s-1", "two")]
    r = post(server, "text/generate", {"text_input": "i", "parameters": {"id": "inner"}})
    assert "id" not in r.json() and r.json()["text_output"] == 'i|{"id": "inner"}'


def test_unknown_model_is_404(server: Server) -> None:
    r = post(server, "nope/generate", {"text_input": "a"})
    assert r.status_code == 404 and "nope" in r.json()["error"]


def test_a_model_failure_is_a_400_error_event_from_generate_stream_and_a_400_error_from_generate(
        server: Server) -> None:
    """As Triton 2.51 answers them: a failed inference is a 400 from the generate routes whatever the
    error's code (V2 infer keeps the code's status), and /generate_stream sends it as an event."""
    for text, words in (("fail", "asked to fail"), ("unavailable", "not now")):
        r = post(server, "text/generate_stream", {"text_input": text})
        assert r.status_code == 400, r.text
        assert events(r) == [{"error": words}]
        r = post(server, "text/generate", {"text_input": text})
        assert r.status_code == 400 and r.json() == {"error": words}
        assert r.headers["content-type"] == "application/json"
    body = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["unavailable"]}]}
    r = httpx.post(f"{server.url}/v2/models/text/infer", json=body, timeout=30)
    assert r.status_code == 503, r.text


def test_decoupled_models_despina_cannot_serve_are_refused_at_load_with_their_reason(server: Server) -> None:
    index = httpx.post(f"{server.url}/v2/repository/index", timeout=30).json()
    row = next(row for row in index if row["name"] == "add_sub_decoupled")
    assert row["state"] == "UNAVAILABLE"
    assert "model_transaction_policy.decoupled needs backend \"python\"" in row["reason"]
    row = next(row for row in index if row["name"] == "streamer_sequence")
    assert row["state"] == "UNAVAILABLE"
    assert "a decoupled model with sequence_batching is not supported" in row["reason"]


def test_a_decoupled_model_streams_each_response_as_it_sends_it(server: Server) -> None:
    with httpx.stream("POST", f"{server.url}/v2/models/streamer/generate_stream", timeout=30,
                      json={"text_input": "one two three"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert "content-length" not in r.headers  # chunked: each event goes when the model sends it
        chunks = [c for c in r.iter_raw() if c]
    assert len(chunks) >= 2  # the events came apart, not as one body
    body = b"".join(chunks).decode()
    docs = [json.loads(e.removeprefix("data: ")) for e in body.split("\n\n") if e]
    assert docs == [{"model_name": "streamer", "model_version": "1", "text_output": w, "length": i}
                    for i, w in enumerate(["one", "two", "three"])]


def test_concurrent_streams_each_get_their_own_responses(server: Server) -> None:
    texts = [" ".join(f"w{k}-{i}" for i in range(4)) for k in range(6)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda t: post(server, "streamer/generate_stream", {"text_input": t}), texts))
    for text, r in zip(texts, answers):
        assert r.status_code == 200, r.text
        assert [d["text_output"] for d in events(r)] == text.split()


def test_a_bare_final_flag_ends_the_stream_and_sends_after_it_raise(server: Server) -> None:
    r = post(server, "streamer/generate_stream", {"text_input": "bare"})
    assert [d["text_output"] for d in events(r)] == ["x", "y"]
    assert post(server, "streamer/generate_stream", {"text_input": "go on"}).status_code == 200  # still up


def test_an_error_response_is_an_event_and_the_stream_goes_on(server: Server) -> None:
    r = post(server, "streamer/generate_stream", {"text_input": "oops"})
    assert r.status_code == 400  # its first response's status (Triton's for a failed inference)
    docs = events(r)
    assert docs[0] == {"error": "bad word"}
    assert docs[1]["text_output"] == "after"


def test_execute_failing_and_the_process_dying_end_the_stream_with_an_error(server: Server) -> None:
    r = post(server, "streamer/generate_stream", {"text_input": "raise"})
    assert r.status_code == 400
    assert events(r) == [{"error": "model 'streamer': execute failed: execute refused"}]
    r = post(server, "streamer/generate_stream", {"text_input": "sent then raise"})
    assert r.status_code == 200  # set by its first response, before the error
    assert events(r) == [{"model_name": "streamer", "model_version": "1", "text_output": "sent", "length": 0},
                         {"error": "model 'streamer': execute failed: raised after a response"}]
    r = post(server, "streamer/generate_stream", {"text_input": "first crash"})
    assert r.status_code == 200  # set by its first response, before the error
    docs = events(r)
    assert docs[0]["text_output"] == "first"
    assert "error" in docs[-1] and "process ended" in docs[-1]["error"], docs
    for _ in range(50):  # the instance is started again, and serves the next request
        r = post(server, "streamer/generate_stream", {"text_input": "back again"})
        if r.status_code == 200 and "error" not in events(r)[0]:
            break
    assert [d["text_output"] for d in events(r)] == ["back", "again"]


def test_an_async_decoupled_execute_runs_while_the_next_requests_start(server: Server) -> None:
    """As in Triton: the instance takes the next request while a coroutine waits, here for that request."""
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(post, server, "async_streamer/generate", {"text_input": "wait"})
        time.sleep(0.5)
        r = post(server, "async_streamer/generate", {"text_input": "release"})
        assert r.status_code == 200 and r.json()["text_output"] == "release", r.text
        assert waiting.result().json()["text_output"] == "released"
    r = post(server, "async_streamer/generate", {"text_input": "call"})
    assert r.json().get("text_output") == "async|{} blocking|{}", r.text
    r = post(server, "async_streamer/generate_stream", {"text_input": "raise"})
    assert events(r) == [{"error": "model 'async_streamer': execute failed: execute refused"}]


def test_generate_takes_a_decoupled_models_single_response_and_refuses_several(server: Server) -> None:
    r = post(server, "streamer/generate", {"text_input": "alone"})
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "streamer", "model_version": "1", "text_output": "alone", "length": 0}
    r = post(server, "streamer/generate", {"text_input": "refuse"})  # its one response an error
    assert r.status_code == 400 and r.json() == {"error": "no such word"}
    # two responses, or none, or one and then execute raising (Triton's error response, a second one):
    # Triton's words (under a 400, not its 200)
    for text in ("a b", "none", "sent then raise"):
        r = post(server, "streamer/generate", {"text_input": text})
        assert r.status_code == 400
        assert r.json()["error"] == ("generate expects model to produce exactly 1 response, use generate "
                                     "stream for model that generates various number of responses")


def test_infer_and_fn_refuse_a_decoupled_model(server: Server) -> None:
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}
    for path, doc in (("v2/models/streamer/infer", body), ("fn/streamer", {"text_input": ["a"]})):
        r = httpx.post(f"{server.url}/{path}", json=doc, timeout=30)
        assert r.status_code == 501, r.text  # Triton's HTTP infer: 501, the endpoint does not support it
        # Triton's words first, then where such a model's responses can be had
        assert r.json()["error"] == ("HTTP end point doesn't support models with decoupled transaction policy: "
                                     "model 'streamer' is decoupled (several responses to a request): call it "
                                     "through .../generate_stream"), r.text


def test_a_client_that_goes_away_mid_stream_cancels_it(server: Server, tmp_path: Path) -> None:
    """The model sees request.is_cancelled() and stops; the request counts as CANCELED."""
    marker = tmp_path / "stopped-at"
    with httpx.stream("POST", f"{server.url}/v2/models/streamer/generate_stream", timeout=30,
                      json={"text_input": f"patient {marker}"}) as r:
        assert r.status_code == 200
        seen = 0
        for chunk in r.iter_text():
            seen += chunk.count("data: ")
            if seen >= 3:
                break  # and the connection closes
    closed = time.monotonic()
    wait_until(marker.exists, 10, every=0.02, what="the model to see the cancellation")
    stopped_at = int(marker.read_text())
    assert time.monotonic() - closed < 5 and stopped_at < 100, stopped_at  # not the whole 400 words
    failures = wait_until(lambda: settled_stats(server.url, "streamer")["inference_stats"]["fail"]["count"],
                          10, what="the request counted")
    assert failures >= 1
    metrics = httpx.get(server.metrics_url, timeout=10).text
    assert 'nv_inference_request_failure{model="streamer",version="1",reason="CANCELED"} 1' in metrics, \
        [line for line in metrics.splitlines() if "failure" in line and "streamer" in line]


def test_a_model_calling_a_decoupled_one_without_decoupled_gets_an_error(server: Server) -> None:
    r = post(server, "caller/generate", {"text_input": "a"})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == ("calling model 'streamer': it is decoupled (several responses to a "
                                       "request): call it with exec(decoupled=True)")


def test_a_streams_statistics_count_it_once(server: Server) -> None:
    before = settled_stats(server.url, "streamer")
    assert post(server, "streamer/generate_stream", {"text_input": "p q r"}).status_code == 200
    after = settled_stats(server.url, "streamer")
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_count"] == before["inference_count"] + 1
    # Triton's compute counts are its successes less its cache hits: a stream's execute is its compute
    for step in ("compute_input", "compute_infer", "compute_output"):
        assert after["inference_stats"][step]["count"] == before["inference_stats"][step]["count"] + 1, step
    # and its time in Triton's Python backend's parts: the requests made ready for the model's process
    # (input), its execute (infer)
    for step in ("compute_input", "compute_infer"):
        assert after["inference_stats"][step]["ns"] > before["inference_stats"][step]["ns"], step


def test_reply_records_carry_a_responses_place() -> None:
    reply = InferReply("r1", (Tensor("y", "FP32", (1,), b"\0" * 4),), index=2, final=False)
    again = InferReply.unpack(reply.pack())
    assert (again.index, again.final, again.empty) == (2, False, False)
    bare = InferReply.unpack(InferReply("r1", index=3, empty=True).pack())
    assert (bare.index, bare.final, bare.empty) == (3, True, True)
    assert len(InferReply("r1").pack()) == 5  # one response, as every other model's: as before
    with pytest.raises(InvalidArgument):
        InferReply.unpack(["r1", [], None, 0, 0, {}, [-1, True, False]])


def test_a_stream_whose_worker_dies_is_rerun_and_the_client_gets_each_response_once(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Two workers; the one running a stream is killed after its second response. The control plane
    requeues what it held, the other worker runs the request from the start, and the gateway passes on
    only the responses past those the client had: every word once, in order."""
    (tmp_path / "repo" / "streamer" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "streamer" / "1" / "model.py").write_text(STREAMER.replace("0.02", "0.25"))
    (tmp_path / "repo" / "streamer" / "config.pbtxt").write_text(STREAMER_CONFIG)
    server = serve(tmp_path / "repo", "--workers", "2", "--model-replicas", "0", wait_models=("streamer",),
                   env={"DESPINA_WORKER_TTL_S": "2"})
    wait_until(lambda: len(worker_hashes(redis_url, key_prefix)) == 2, what="two workers")
    pids = {wid: orjson.loads(h[b"info"])["pid"] for wid, h in worker_hashes(redis_url, key_prefix).items()}
    client = redis.Redis.from_url(redis_url)
    stream = Keys(key_prefix).request_stream("streamer", 1)
    words = [f"w{i}" for i in range(8)]
    got: list[dict] = []
    try:
        with httpx.stream("POST", f"{server.url}/v2/models/streamer/generate_stream", timeout=60,
                          json={"text_input": " ".join(words)}) as r:
            assert r.status_code == 200
            buffer = ""
            for text in r.iter_text():
                buffer += text
                while "\n\n" in buffer:
                    chunk, buffer = buffer.split("\n\n", 1)
                    got.append(json.loads(chunk.removeprefix("data: ")))
                if len(got) == 2 and len(pids) == 2:
                    holder = next(c["name"].decode() for c in client.xpending(stream, GROUP)["consumers"]
                                  if c["pending"])
                    os.kill(pids.pop(holder), signal.SIGKILL)
    finally:
        client.close()
    assert len(pids) == 1, "no worker was killed"
    assert [d.get("text_output", d) for d in got] == words
    assert "requeued" in server.logs()


def test_the_example_streaming_model(example_server: Server) -> None:
    wait_until(lambda: httpx.get(f"{example_server.url}/v2/models/text_stream/ready").status_code == 200,
               what="text_stream ready")
    r = httpx.post(f"{example_server.url}/v2/models/text_stream/generate_stream", timeout=30,
                   json={"text_input": "one two three", "word_delay_ms": 1})
    assert [(d["text_output"], d["index"]) for d in events(r)] == [("one", 0), ("two", 1), ("three", 2)]
    r = httpx.post(f"{example_server.url}/v2/models/text_stream/generate", json={"text_input": "hi"}, timeout=30)
    assert r.json() == {"model_name": "text_stream", "model_version": "1", "text_output": "hi", "index": 0}


def test_a_stream_longer_than_the_visibility_timeout_is_not_redelivered(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """Each response keeps the request's entry from looking abandoned: a 3 s stream under a 1 s
    visibility timeout runs once."""
    (tmp_path / "repo" / "streamer" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "streamer" / "1" / "model.py").write_text(STREAMER.replace("0.02", "0.25"))
    (tmp_path / "repo" / "streamer" / "config.pbtxt").write_text(STREAMER_CONFIG)
    server = serve(tmp_path / "repo", wait_models=("streamer",), env={"DESPINA_VISIBILITY_TIMEOUT_S": "1"})
    words = [f"w{i}" for i in range(12)]
    r = post(server, "streamer/generate_stream", {"text_input": " ".join(words)})
    assert [d["text_output"] for d in events(r)] == words
    stats = settled_stats(server.url, "streamer")
    assert stats["execution_count"] == 1, stats
    assert "redeliver" not in server.logs().lower()


def test_a_stream_the_model_never_ends_is_given_up_at_its_deadline(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A model that never sends its final flag: at the request's deadline the worker ends the request
    (DEADLINE_EXCEEDED, the model told by is_cancelled()), acknowledges its entry and frees its place."""
    (tmp_path / "repo" / "streamer" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "streamer" / "1" / "model.py").write_text(STREAMER)
    (tmp_path / "repo" / "streamer" / "config.pbtxt").write_text(STREAMER_CONFIG)
    server = serve(tmp_path / "repo", wait_models=("streamer",), env={"DESPINA_REQUEST_TIMEOUT_S": "1"})
    r = post(server, "streamer/generate_stream", {"text_input": "silent"})
    assert r.status_code == 504, r.text
    client = redis.Redis.from_url(redis_url)
    try:
        stream = Keys(key_prefix).request_stream("streamer", 1)
        wait_until(lambda: client.xpending(stream, GROUP)["pending"] == 0, 10, what="the entry acknowledged")
    finally:
        client.close()
    stats = settled_stats(server.url, "streamer")
    assert stats["inference_stats"]["fail"]["count"] == 1, stats
    r = post(server, "streamer/generate_stream", {"text_input": "still here"})
    assert [d["text_output"] for d in events(r)] == ["still", "here"]
