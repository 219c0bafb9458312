"""Triton Python-backend models: a real `despina serve`, and the backend on its own (pb_utils alone:
test_pb_utils.py).

Every model.py here is written against Triton's documented `triton_python_backend_utils` API only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from despina import logs
from despina.contract.errors import Code, ConfigError, DespinaError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.examples import build_add_sub
from despina.gateway.http import STATUS
from despina.workers.backends import Instance, backend_class
from despina.workers.backends.base import visible_gpus

from .conftest import FULL_QUEUE_DELAY, ROOT, Server, module_server

# BYTES in, BYTES and INT32 out; uses the type helpers, the config helpers and the BYTES codec.
STRINGS = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        config = json.loads(args["model_config"])
        self.length_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "LENGTH")["data_type"])
        assert pb_utils.get_input_config_by_name(config, "TEXT")["data_type"] == "TYPE_STRING"
        assert pb_utils.get_input_config_by_name(config, "NOPE") is None
        pb_utils.Logger.log_info("strings: initialized")

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT")
            assert text.name() == "TEXT"
            values = text.as_numpy()
            assert pb_utils.numpy_to_triton_type(values.dtype) == 13
            wire = pb_utils.serialize_byte_tensor(values)
            flat = pb_utils.deserialize_bytes_tensor(wire)
            upper = np.array([v.upper() for v in flat], dtype=np.object_).reshape(values.shape)
            length = np.array([len(v) for v in flat], dtype=self.length_dtype).reshape(values.shape)
            assert pb_utils.triton_to_numpy_type(8) == np.int32
            args = np.array([json.dumps(self.args).encode()] * values.shape[0], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("UPPER", upper), pb_utils.Tensor("LENGTH", length),
                pb_utils.Tensor("ARGS", args.reshape(-1, 1))]))
        return responses
'''

STRINGS_CONFIG = '''
name: "strings"
backend: "python"
max_batch_size: 16
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [
  { name: "UPPER", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "LENGTH", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "ARGS", data_type: TYPE_STRING, dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 100000 }
'''

# X * 2 per request; special values: -1 ends the process, -2 raises, -3 fails only that request.
FLAKY = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        values = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        if any((v == -1).any() for v in values):
            os._exit(3)
        if any((v == -2).any() for v in values):
            raise ValueError("minus two is not welcome")
        responses = []
        for v in values:
            if (v == -3).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("minus three fails alone", pb_utils.TritonError.INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", v * 2),
                pb_utils.Tensor("PID", np.full((v.shape[0], 1), os.getpid(), dtype=np.int64)),
                pb_utils.Tensor("BATCH", np.full((v.shape[0], 1), len(requests), dtype=np.int32))]))
        return responses
'''

FLAKY_CONFIG = '''
name: "flaky"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [
  { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 200000 }
'''

# No config.pbtxt at all: the model describes itself.
AUTO = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [3]})
        auto_complete_model_config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [3]})
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)]) for r in requests]
'''

# Answers Y only, though its config declares Z too (a model may leave an output out of a response);
# its tensors come in a tuple, which Triton's InferenceResponse takes as it takes a list.
SOME = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse((pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(
            r, "X").as_numpy() * 2),)) for r in requests]
'''
SOME_CONFIG = ('name: "some"\nbackend: "python"\nmax_batch_size: 0\n'
               'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
               'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }, '
               '{ name: "Z" data_type: TYPE_FP32 dims: [ 2 ] } ]\n')

# Not decoupled, yet each request answers as X[0] % 4 says: 0 in execute's list, 1 through its response
# sender with the final flag, 2 through it and then the flag alone, 3 from a thread after execute
# returned (None in the list's place of 1-3, and None for the whole list when all are so).
SENDERS = '''
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        returned, later = [], []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", x * 2),
                pb_utils.Tensor("BATCH", np.full((x.shape[0], 1), len(requests), dtype=np.int32))])
            way = int(x[0, 0]) % 4
            if way == 0:
                returned.append(response)
                continue
            sender = request.get_response_sender()
            if way == 1:
                sender.send(response, flags=FINAL)
            elif way == 2:
                sender.send(response)
                sender.send(flags=FINAL)
            else:
                later.append((sender, response))
            returned.append(None)
        threading.Thread(target=self.answer_later, args=(later,)).start()
        return None if all(r is None for r in returned) else returned

    def answer_later(self, later):
        time.sleep(0.05)
        for sender, response in later:
            sender.send(response, flags=FINAL)
'''
SENDERS_CONFIG = FLAKY_CONFIG.replace('"flaky"', '"senders"').replace(
    '  { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] },\n', "")


def write_model(repo: Path, name: str, source: str, config: str | None) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(source)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    return folder


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("python-repo")
    shutil.copytree(ROOT / "model_repository" / "add_sub_python", root / "add_sub_python")
    write_model(root, "strings", STRINGS, STRINGS_CONFIG)
    write_model(root, "flaky", FLAKY, FLAKY_CONFIG)
    write_model(root, "auto", AUTO, None)
    write_model(root, "some", SOME, SOME_CONFIG)
    write_model(root, "senders", SENDERS, SENDERS_CONFIG)
    (root / "add_sub" / "1").mkdir(parents=True)
    (root / "add_sub" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    build_add_sub(root / "add_sub" / "1" / "model.onnx")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, repo: Path) -> Iterator[Server]:
    yield from module_server(repo, tmp_path_factory, redis_url,
                             ("add_sub_python", "strings", "flaky", "auto", "some", "senders",
                                                       "add_sub"), env=FULL_QUEUE_DELAY)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"), concurrency=8)
    yield c
    c.close()


def inputs_of(**arrays: np.ndarray) -> list[httpclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    return inputs


def infer(client: httpclient.InferenceServerClient, model: str, **arrays: np.ndarray
          ) -> httpclient.InferResult:
    return client.infer(model, inputs_of(**arrays))


def infer_together(client: httpclient.InferenceServerClient, model: str, name: str,
                   values: list[np.ndarray]) -> list[httpclient.InferResult | InferenceServerException]:
    """Send the requests at once (tritonclient's own concurrency), so they can share a batch."""
    pending = [client.async_infer(model, inputs_of(**{name: v})) for v in values]
    results: list[httpclient.InferResult | InferenceServerException] = []
    for p in pending:
        try:
            results.append(p.get_result())
        except InferenceServerException as exc:
            results.append(exc)
    return results


def flaky(client: httpclient.InferenceServerClient, value: float) -> httpclient.InferResult:
    return infer(client, "flaky", X=np.full((1, 2), value, dtype=np.float32))


def test_triton_add_sub_example_runs_unchanged(client: httpclient.InferenceServerClient, server: Server
                                               ) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    result = infer(client, "add_sub_python", INPUT0=a, INPUT1=b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    r = httpx.post(f"{server.url}/fn/add_sub_python", json={"INPUT0": [1, 2, 3, 4], "INPUT1": [4, 3, 2, 1]})
    assert r.status_code == 200, r.text
    assert r.json() == {"OUTPUT0": [5.0, 5.0, 5.0, 5.0], "OUTPUT1": [-3.0, -1.0, 1.0, 3.0]}


def test_bytes_tensors_through_a_python_model(client: httpclient.InferenceServerClient, server: Server
                                              ) -> None:
    text = np.array([[b"hello", b"w\x00rld", "ünï".encode()]], dtype=object)
    result = infer(client, "strings", TEXT=text)
    assert result.as_numpy("UPPER").tolist() == [[b"HELLO", b"W\x00RLD", "ünï".encode().upper()]]
    np.testing.assert_array_equal(result.as_numpy("LENGTH"), [[5, 5, len("ünï".encode())]])
    assert result.as_numpy("LENGTH").dtype == np.int32
    r = httpx.post(f"{server.url}/fn/strings", json={"TEXT": ["abc", "de"]})
    assert r.status_code == 200, r.text
    assert r.json()["UPPER"] == ["ABC", "DE"] and r.json()["LENGTH"] == [3, 2]


def test_messages_larger_than_the_sockets_buffer_cross_every_time(client: httpclient.InferenceServerClient
                                                                   ) -> None:
    """A 1 MiB input and its 1 MiB answer, call after call: the worker's end of the connection to the model's
    process is left non-blocking by the event loop (uvloop) after the first call, and a message larger than
    the socket's buffer broke off there, taken for the process's death (a 500, then a restart)."""
    big = bytes(range(97, 123)) * (40 << 10)  # 1 MiB of a-z
    for _ in range(3):
        result = infer(client, "strings", TEXT=np.array([[big]], dtype=object))
        assert result.as_numpy("UPPER")[0, 0] == big.upper()


def test_initialize_gets_tritons_args(client: httpclient.InferenceServerClient, repo: Path) -> None:
    result = infer(client, "strings", TEXT=np.array([[b"x"]], dtype=object))
    args = json.loads(result.as_numpy("ARGS")[0, 0])
    assert set(args) == {"model_config", "model_instance_kind", "model_instance_name",
                         "model_instance_device_id", "model_repository", "model_version", "model_name"}
    assert all(isinstance(v, str) for v in args.values())
    assert args["model_name"] == "strings" and args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU" and args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] == "strings_0"  # Triton's: its config names no instance_group
    assert Path(args["model_repository"]) == (repo / "strings").resolve()
    config = json.loads(args["model_config"])
    assert config["name"] == "strings" and config["max_batch_size"] == 16
    assert config["default_model_filename"] == "model.py"  # as Triton completes it
    assert [(g["name"], g["count"]) for g in config["instance_group"]] == [("strings", 1)]
    # as Triton's: the kind it runs as, not the KIND_AUTO that GET .../config shows
    assert config["instance_group"][0]["kind"] == ("KIND_GPU" if visible_gpus() else "KIND_CPU")
    assert config["dynamic_batching"]["preferred_batch_size"] == [16]


def test_execute_gets_a_batch_and_answers_each_request(client: httpclient.InferenceServerClient) -> None:
    values = [np.full((1, 2), i, dtype=np.float32) for i in range(6)]
    results = infer_together(client, "flaky", "X", values)
    for v, result in zip(values, results):
        assert isinstance(result, httpclient.InferResult), result
        np.testing.assert_array_equal(result.as_numpy("Y"), v * 2)
    assert max(int(r.as_numpy("BATCH")[0, 0]) for r in results) > 1  # they did share an execute


def test_error_response_fails_only_its_request(client: httpclient.InferenceServerClient) -> None:
    values = [np.full((1, 2), v, dtype=np.float32) for v in (1.0, -3.0, 2.0, 3.0)]
    results = infer_together(client, "flaky", "X", values)
    assert isinstance(results[1], InferenceServerException)
    assert "minus three fails alone" in str(results[1]) and results[1].status() == "400"
    for value, result in zip([1.0, 2.0, 3.0], [results[0], *results[2:]]):
        assert isinstance(result, httpclient.InferResult), result
        np.testing.assert_array_equal(result.as_numpy("Y"), [[value * 2] * 2])
    assert max(int(r.as_numpy("BATCH")[0, 0]) for r in results if isinstance(r, httpclient.InferResult)) > 1


def test_a_model_not_decoupled_answers_through_its_response_senders(
        client: httpclient.InferenceServerClient) -> None:
    """As Triton's Python backend allows since 24.06, a model that is not decoupled may answer a request
    through request.get_response_sender() (one response, the final flag with it or after it, from
    execute or from a thread after it returned) and return None in its place, or None for all; one batch
    may answer both ways. get_response_sender() raised "needs a decoupled model"."""
    values = [np.full((1, 2), i, dtype=np.float32) for i in range(8)]
    results = infer_together(client, "senders", "X", values)
    for v, result in zip(values, results):
        assert isinstance(result, httpclient.InferResult), result
        np.testing.assert_array_equal(result.as_numpy("Y"), v * 2)
    assert max(int(r.as_numpy("BATCH")[0, 0]) for r in results) > 1  # they did share an execute
    later = infer(client, "senders", X=np.full((1, 2), 3, dtype=np.float32))  # execute returned None
    np.testing.assert_array_equal(later.as_numpy("Y"), [[6.0, 6.0]])


def test_exception_in_execute_fails_the_batch_and_the_model_goes_on(
        client: httpclient.InferenceServerClient) -> None:
    pid = int(flaky(client, 1.0).as_numpy("PID")[0, 0])
    with pytest.raises(InferenceServerException, match="minus two is not welcome"):
        flaky(client, -2.0)
    after = flaky(client, 5.0)
    np.testing.assert_array_equal(after.as_numpy("Y"), [[10.0, 10.0]])
    assert int(after.as_numpy("PID")[0, 0]) == pid  # same process: an exception is not a crash


def test_crash_fails_its_requests_restarts_and_other_models_keep_serving(
        client: httpclient.InferenceServerClient, server: Server) -> None:
    pid = int(flaky(client, 1.0).as_numpy("PID")[0, 0])
    stop = threading.Event()
    answered: list[int] = []

    def other_model() -> None:  # the ONNX model on the same worker, throughout the crash
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                r = http.post(f"{server.url}/fn/add_sub", json={"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]})
                answered.append(r.status_code)
                time.sleep(0.01)

    thread = threading.Thread(target=other_model)
    thread.start()
    try:
        time.sleep(0.1)
        with pytest.raises(InferenceServerException, match="crashed"):
            flaky(client, -1.0)
        after = flaky(client, 4.0)  # a new process answers the next request
        np.testing.assert_array_equal(after.as_numpy("Y"), [[8.0, 8.0]])
        assert int(after.as_numpy("PID")[0, 0]) != pid
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert answered and set(answered) == {200}
    assert client.is_model_ready("flaky") and client.is_model_ready("add_sub")
    assert "died while executing" in server.logs()


def test_auto_complete_config_describes_the_model(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("auto")
    assert meta["inputs"] == [{"name": "IN", "datatype": "INT32", "shape": [-1, 3]}]
    assert meta["outputs"] == [{"name": "OUT", "datatype": "INT32", "shape": [-1, 3]}]
    config = client.get_model_config("auto")
    assert config["backend"] == "python" and config["max_batch_size"] == 4 and "dynamic_batching" in config
    result = infer(client, "auto", IN=np.array([[1, 2, 3]], dtype=np.int32))
    np.testing.assert_array_equal(result.as_numpy("OUT"), [[2, 3, 4]])


def test_a_response_without_an_asked_output_answers_the_outputs_it_has(
        client: httpclient.InferenceServerClient, server: Server) -> None:
    """Triton's stub sends a response's tensors that were asked for and nothing else: an output the
    response lacks is absent from the reply, not an error."""
    x = np.array([1, 2], dtype=np.float32)
    result = client.infer("some", inputs_of(X=x), outputs=[httpclient.InferRequestedOutput("Y"),
                                                            httpclient.InferRequestedOutput("Z")])
    np.testing.assert_array_equal(result.as_numpy("Y"), x * 2)
    assert result.as_numpy("Z") is None
    r = httpx.post(f"{server.url}/v2/models/some/infer",
                   json={"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 2]}]})
    assert r.status_code == 200, r.text
    assert [o["name"] for o in r.json()["outputs"]] == ["Y"]
    r = httpx.post(f"{server.url}/v2/models/some/infer",
                   json={"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 2]}],
                         "outputs": [{"name": "Z"}]})
    assert r.status_code == 200 and r.json()["outputs"] == [], r.text


# -- the backend on its own ------------------------------------------------------------------------


def backend_for(folder: Path, name: str = "m_0") -> object:
    entry = load_model(folder)
    spec = ModelSpec.from_config(entry.config)
    return backend_class("python")(spec, folder / "1", Instance(name))


def test_initialize_failure_is_a_load_error(tmp_path: Path) -> None:
    source = FLAKY.replace("    def execute", "    def initialize(self, args):\n"
                           "        raise RuntimeError('no weights here')\n\n    def execute")
    backend = backend_for(write_model(tmp_path, "flaky", source, FLAKY_CONFIG))
    with pytest.raises(ConfigError) as caught:
        backend.load()  # type: ignore[attr-defined]
    assert caught.value.message == "model 'flaky': initialize failed: RuntimeError: no weights here (model.py:9)"


def test_a_model_whose_initialize_failed_is_not_finalized(tmp_path: Path) -> None:
    """As in Triton 2.51, finalize() runs only for a model that initialized: Despina called it after a
    failed initialize too, on a model that had set up nothing (whose finalize may then fail on what
    initialize never made)."""
    marker = tmp_path / "finalized"
    source = FLAKY.replace("    def execute", "    def initialize(self, args):\n"
                           "        raise RuntimeError('no weights here')\n\n"
                           f"    def finalize(self):\n        open({str(marker)!r}, 'w').close()\n\n"
                           "    def execute")
    backend = backend_for(write_model(tmp_path, "flaky", source, FLAKY_CONFIG))
    with pytest.raises(ConfigError, match="no weights here"):
        backend.load()  # type: ignore[attr-defined]
    assert not marker.exists()


def test_wrong_number_of_responses_fails_every_request(tmp_path: Path) -> None:
    source = FLAKY.replace("        return responses", "        return responses[:1]")
    backend = backend_for(write_model(tmp_path, "flaky", source, FLAKY_CONFIG))
    backend.load()  # type: ignore[attr-defined]
    try:
        x = np.ones((1, 2), dtype=np.float32)
        results = backend.execute_requests([{"X": x}, {"X": x}], [["Y"], ["Y"]])  # type: ignore[attr-defined]
        # Triton 2.51's words (after "model 'flaky': execute failed: ")
        assert all(isinstance(r, DespinaError) and r.message.endswith(
            "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
            "InferenceRequest(s) size is:2, and InferenceResponse(s) size is:1") for r in results), results
        one = backend.execute_requests([{"X": x}], [["Y", "BATCH"]])  # type: ignore[attr-defined]
        assert set(one[0]) == {"Y", "BATCH"}  # only what was asked comes back
    finally:
        backend.unload()  # type: ignore[attr-defined]


def test_a_response_returned_outside_a_list_fails_in_tritons_words(tmp_path: Path) -> None:
    source = FLAKY.replace("        return responses", "        return responses[0]")
    backend = backend_for(write_model(tmp_path, "flaky", source, FLAKY_CONFIG))
    backend.load()  # type: ignore[attr-defined]
    try:
        x = np.ones((1, 2), dtype=np.float32)
        [result] = backend.execute_requests([{"X": x}], [["Y"]])  # type: ignore[attr-defined]
        assert isinstance(result, DespinaError) and result.message == (
            "model 'flaky': execute failed: Expected a list in the execute return, found type "
            "'<class '_despina_requests.InferenceResponse'>'."), result
    finally:
        backend.unload()  # type: ignore[attr-defined]


def test_model_process_ends_with_unload(tmp_path: Path) -> None:
    backend = backend_for(write_model(tmp_path, "flaky", FLAKY, FLAKY_CONFIG))
    backend.load()  # type: ignore[attr-defined]
    process = backend.stub.process  # type: ignore[attr-defined]
    assert process.poll() is None
    backend.unload()  # type: ignore[attr-defined]
    assert process.poll() is not None


def test_unloading_a_model_that_is_executing_starts_no_process_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unload stops the process under an execute still running (a warmup that hangs, say): that is not a
    crash to recover from, and a process started again then served a model no longer loaded, for good.
    Nor is it a process to wait for once finalize went unanswered: it is killed then (it was given 5 s
    more, for nothing)."""
    from despina.workers.backends import python_process as python

    monkeypatch.setattr(python, "FINALIZE_TIMEOUT_S", 1.0)
    source = FLAKY.replace("        if any((v == -1).any() for v in values):",
                           "        if any((v == 7).any() for v in values):\n            import time\n"
                           "            time.sleep(60)\n        if any((v == -1).any() for v in values):")
    backend = backend_for(write_model(tmp_path, "flaky", source, FLAKY_CONFIG))
    backend.load()  # type: ignore[attr-defined]
    answers: list[object] = []
    running = threading.Thread(target=lambda: answers.extend(backend.execute_requests(  # type: ignore[attr-defined]
        [{"X": np.full((1, 2), 7, dtype=np.float32)}], [["Y"]])))
    running.start()
    time.sleep(1.0)  # the model is in its sleep
    unloading = time.monotonic()
    backend.unload()  # type: ignore[attr-defined]
    assert time.monotonic() - unloading < 1.0 + 3  # finalize's timeout, then the kill: not 5 s more
    running.join(30)
    restart = backend._restart  # type: ignore[attr-defined]
    if restart is not None:
        restart.join(30)
    assert isinstance(answers[0], DespinaError) and "unloaded" in answers[0].message, answers
    assert not backend.stub.alive()  # type: ignore[attr-defined]


@pytest.mark.parametrize("stub, message", [
    ("import sys; sys.exit(3)", "its process ended while starting (exit code 3)"),
    ("import time; time.sleep(30)", "its process did not start within 1 s"),
])
def test_a_model_process_that_does_not_start_is_a_load_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stub: str, message: str) -> None:
    """Triton's stub timeout: a process that dies or says nothing while starting fails the load."""
    from despina.workers.backends import python_process as python

    (tmp_path / "stub.py").write_text(stub)
    monkeypatch.setattr(python, "STUB", tmp_path / "stub.py")
    monkeypatch.setattr(python, "STARTUP_TIMEOUT_S", 1.0)
    backend = backend_for(write_model(tmp_path, "flaky", FLAKY, FLAKY_CONFIG))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(message)):
        backend.load()  # type: ignore[attr-defined]
    assert time.monotonic() - started < 10  # two tries of at most 1 s each


def test_a_model_process_that_does_not_start_the_first_time_is_started_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stub that hangs before its hello the first time only: the second process serves."""
    from despina.workers.backends import python_process as python

    marker = tmp_path / "tried"
    real = Path(python.__file__).parent / "python_stub" / "stub.py"
    (tmp_path / "stub.py").write_text(
        "import pathlib, runpy, sys, time\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "if not marker.exists():\n"
        "    marker.touch()\n"
        "    time.sleep(30)\n"
        f"sys.path.insert(0, {str(real.parent)!r})\n"
        f"runpy.run_path({str(real)!r}, run_name='__main__')\n")
    monkeypatch.setattr(python, "STUB", tmp_path / "stub.py")
    monkeypatch.setattr(python, "STARTUP_TIMEOUT_S", 2.0)
    backend = backend_for(write_model(tmp_path, "flaky", FLAKY, FLAKY_CONFIG))
    backend.load()  # type: ignore[attr-defined]
    try:
        x = np.ones((1, 2), dtype=np.float32)
        result = backend.execute_requests([{"X": x}], [["Y"]])[0]  # type: ignore[attr-defined]
        assert not isinstance(result, DespinaError) and "Y" in result
    finally:
        backend.unload()  # type: ignore[attr-defined]


def test_missing_model_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "empty" / "1").mkdir(parents=True)
    (tmp_path / "empty" / "config.pbtxt").write_text('backend: "python"\n')
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "empty")


# Each request's X names the TritonError code its error response carries.
CODES = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "code " + str(int(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0])),
            int(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0]))) for r in requests]
'''
CODES_CONFIG = ('name: "codes"\nbackend: "python"\nmax_batch_size: 0\n'
                'input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')


def test_an_error_responses_code_gives_tritons_status(tmp_path: Path) -> None:
    """Triton's HTTP status of a TritonError code: UNKNOWN, ALREADY_EXISTS and CANCELLED are a 400 as
    INVALID_ARG is, NOT_FOUND a 404, UNAVAILABLE a 503, UNSUPPORTED a 501, INTERNAL a 500. The message
    is the model's own, as Triton passes it to the client (it was prefixed "model 'codes': ")."""
    backend: Any = backend_for(write_model(tmp_path, "codes", CODES, CODES_CONFIG))
    backend.load()
    try:
        results = backend.execute_requests([{"X": np.array([code], np.int32)} for code in range(8)],
                                           [["Y"]] * 8)
        # UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED
        assert [r.code for r in results] == [Code.INVALID_ARGUMENT, Code.BACKEND, Code.NOT_FOUND,
                                             Code.INVALID_ARGUMENT, Code.UNAVAILABLE, Code.UNIMPLEMENTED,
                                             Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT]
        assert results[6].message == "code 6"
        assert [STATUS[r.code] for r in results] == [400, 500, 404, 400, 503, 501, 400, 400]
    finally:
        backend.unload()


IMPORTS = '''
import triton_python_backend_utils as pb_utils
from .helper import FACTOR
from shared import OFFSET


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * FACTOR + OFFSET)]) for r in requests]
'''


def test_model_imports_its_neighbours_as_in_triton(tmp_path: Path) -> None:
    """Triton imports model.py as `<version>.model`, with its version folder and the model's folder on
    sys.path: a relative import of a module beside it, or one of a module beside the version folder,
    works there. Despina imported it as a top-level `model` ("attempted relative import with no known
    parent package") without the model's folder on sys.path."""
    folder = write_model(tmp_path, "codes", IMPORTS, CODES_CONFIG)
    (folder / "1" / "helper.py").write_text("FACTOR = 3\n")
    (folder / "shared.py").write_text("OFFSET = 1\n")
    backend: Any = backend_for(folder)
    backend.load()
    try:
        [out] = backend.execute_requests([{"X": np.array([2], np.int32)}], [["Y"]])
        assert out["Y"].tolist() == [7]
    finally:
        backend.unload()


SHAPES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            x *= 2  # a model may write into its input
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("T", x.T),                                 # not C-contiguous
                pb_utils.Tensor("BIG", x.astype(">f4")),                   # big-endian
                pb_utils.Tensor("POSITIVE", x > 0),                         # bool
                pb_utils.Tensor("WORDS", np.array([[b"a", b"bc"]], dtype=np.object_)),
            ]))
        return responses
'''
SHAPES_CONFIG = ('name: "shapes"\nbackend: "python"\nmax_batch_size: 0\n'
                 'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]\n'
                 'output [ { name: "T" data_type: TYPE_FP32 dims: [ 3, 2 ] }, '
                 '{ name: "BIG" data_type: TYPE_FP32 dims: [ 2, 3 ] }, '
                 '{ name: "POSITIVE" data_type: TYPE_BOOL dims: [ 2, 3 ] }, '
                 '{ name: "WORDS" data_type: TYPE_STRING dims: [ 1, 2 ] } ]\n')


def test_arrays_cross_to_the_model_process_and_back_intact(tmp_path: Path) -> None:
    """Arrays travel as raw bytes (objects as they are): values, dtypes, shapes and layout survive."""
    backend = backend_for(write_model(tmp_path, "shapes", SHAPES, SHAPES_CONFIG))
    backend.load()  # type: ignore[attr-defined]
    try:
        x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
        [out] = backend.execute_requests([{"X": x}], [["T", "BIG", "POSITIVE", "WORDS"]])  # type: ignore[attr-defined]
        assert isinstance(out, dict), out
        assert np.array_equal(x, np.arange(6, dtype=np.float32).reshape(2, 3) - 2)  # ours is untouched
        assert np.array_equal(out["T"], (2 * x).T) and out["T"].shape == (3, 2)
        assert out["BIG"].dtype == np.dtype(">f4") and np.array_equal(out["BIG"], 2 * x)
        assert out["POSITIVE"].dtype == np.bool_ and out["POSITIVE"].tolist() == (x > 0).tolist()
        assert out["WORDS"].dtype == np.object_ and out["WORDS"].tolist() == [[b"a", b"bc"]]
    finally:
        backend.unload()  # type: ignore[attr-defined]


def test_awaited_calls_stay_in_step_when_one_is_cancelled_and_survive_a_crash(tmp_path: Path) -> None:
    """The worker awaits a batch's answer on its event loop: a call given up on (cancelled) still gets
    its answer read, so the next call receives its own; a crash under an awaited call fails that batch
    and the next one runs in a new process."""
    source = FLAKY.replace("    def execute(self, requests):\n",
                           "    def execute(self, requests):\n        import time\n"
                           "        if any((pb_utils.get_input_tensor_by_name(r, 'X').as_numpy() == 5).any()"
                           " for r in requests):\n            time.sleep(0.3)\n")
    backend: Any = backend_for(write_model(tmp_path, "flaky", source, FLAKY_CONFIG))
    backend.load()

    async def scenario() -> None:
        slow = asyncio.ensure_future(backend.execute_requests_async([{"X": np.full((1, 2), 5, np.float32)}],
                                                                    [["Y"]]))
        await asyncio.sleep(0.05)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        [out] = await backend.execute_requests_async([{"X": np.full((1, 2), 7, np.float32)}], [["Y"]])
        assert isinstance(out, dict) and out["Y"].tolist() == [[14.0, 14.0]]  # not the cancelled call's 10s
        [crashed] = await backend.execute_requests_async([{"X": np.full((1, 2), -1, np.float32)}], [["Y"]])
        assert isinstance(crashed, DespinaError) and "crashed" in crashed.message
        assert not backend.quick()  # restarting: the worker takes the thread path, which waits for it

    try:
        asyncio.run(scenario())
        [after] = backend.execute_requests([{"X": np.ones((1, 2), np.float32)}], [["Y"]])
        assert isinstance(after, dict) and after["Y"].tolist() == [[2.0, 2.0]]
        assert backend.quick()
    finally:
        backend.unload()


# Each request's X says how it answers, or how it misuses its response sender, in a model that is not
# decoupled: 0 returned, 1 sent, 2 sent twice, 3 the final flag before a response, 4 a flag that is
# not one, 5 sent and returned too, 6 neither sent nor returned, 7 sent from a thread after execute
# returned, which then sends once more and writes what its sender said to later.txt. A misuse's
# exception ends execute.
MISUSE = '''
import threading
from pathlib import Path
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.folder = Path(args["model_repository"])

    def execute(self, requests):
        returned = []
        for request in requests:
            way = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            response = pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([way], np.int32))])
            sender = request.get_response_sender() if way not in (0, 6) else None
            if way in (1, 2, 5):
                sender.send(response, flags=FINAL)
            if way == 2:
                sender.send(response, flags=FINAL)
            if way == 3:
                sender.send(flags=FINAL)
            if way == 4:
                sender.send(response, flags=2)
            if way == 7:
                threading.Thread(target=self.later, args=(sender, response)).start()
            returned.append(response if way in (0, 5) else None)
        return returned

    def later(self, sender, response):
        sender.send(response)
        sender.send(flags=FINAL)
        said = []
        for again in ((response, 0), (None, FINAL)):
            try:
                sender.send(*again)
            except pb_utils.TritonModelException as exc:
                said.append(exc.message())
        (self.folder / "later.tmp").write_text("\\n".join(said))
        (self.folder / "later.tmp").rename(self.folder / "later.txt")
'''
MISUSE_CONFIG = ('name: "misuse"\nbackend: "python"\nmax_batch_size: 0\n'
                 'input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                 'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')


def test_a_response_senders_misuse_fails_as_in_triton(tmp_path: Path) -> None:
    """Triton's rules for the response sender of a model that is not decoupled, with its messages: one
    response per request, the final flag not before it, flags 0 or the final one, no response returned
    for a request that sent one (that fails the whole execute). A request that sent its response keeps
    it when execute fails; the others get execute's error."""
    backend: Any = backend_for(write_model(tmp_path, "misuse", MISUSE, MISUSE_CONFIG))
    backend.load()

    def run(*ways: int) -> list[Any]:
        return backend.execute_requests([{"X": np.array([w], np.int32)} for w in ways], [["Y"]] * len(ways))

    def failed(result: Any, message: str) -> bool:
        return isinstance(result, DespinaError) and result.code == Code.BACKEND and result.message == (
            f"model 'misuse': {message}")

    try:
        sent, twice, left = run(1, 2, 0)
        assert sent["Y"].tolist() == [1] and twice["Y"].tolist() == [2]
        assert failed(left, "execute failed: Unable to send response. Non-decoupled model cannot send more "
                            "than one response.")
        assert all(failed(r, "execute failed: Unable to send response. Non-decoupled model cannot send "
                             "complete final before sending a response.") for r in run(3, 0))
        assert failed(run(4)[0], "execute failed: Unable to send response. Unsupported flag provided.")
        both, returned = run(5, 0)
        assert both["Y"].tolist() == [5]
        assert failed(returned, "execute failed: Unable to send response. Non-decoupled model cannot send "
                                "more than one response.")
        neither, returned, sent = run(6, 0, 1)  # (as it fails where no request takes its sender)
        assert failed(neither, "Expected an 'InferenceResponse' object in the execute function return list, "
                               "found type '<class 'NoneType'>'.")
        assert returned["Y"].tolist() == [0] and sent["Y"].tolist() == [1]
        assert [r["Y"].tolist() for r in run(0, 7, 0)] == [[0], [7], [0]]  # and the model goes on
        later = tmp_path / "misuse" / "later.txt"
        deadline = time.monotonic() + 30
        while not later.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert later.read_text().split("\n") == [
            "Unable to send response. Non-decoupled model cannot send more than one response.",
            "Unable to send response. Response sender has been closed."]
    finally:
        backend.unload()


ASYNC_SENDERS = '''
import asyncio
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.tasks = set()

    async def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            task = asyncio.create_task(self.answer(request.get_response_sender(), x))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return None

    async def answer(self, sender, x):
        await asyncio.sleep(0.05)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def test_an_async_model_not_decoupled_answers_through_its_senders_after_execute(tmp_path: Path) -> None:
    """An `async def execute` that leaves tasks to send its responses, as Triton's tests of the
    response sender do: the model's event loop runs until they have."""
    backend: Any = backend_for(write_model(tmp_path, "misuse", ASYNC_SENDERS, MISUSE_CONFIG))
    backend.load()
    try:
        for _ in range(2):
            results = backend.execute_requests([{"X": np.array([v], np.int32)} for v in (1, 2, 3)],
                                               [["Y"]] * 3)
            assert [r["Y"].tolist() for r in results] == [[2], [3], [4]]
    finally:
        backend.unload()


LOGGER = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        logger = pb_utils.Logger
        logger.log_info("an info line")
        logger.log_warn("a warning line")
        logger.log_error("an error line")
        logger.log_verbose("a verbose line")
        logger.log("a verbose line by its level", logger.LogLevel.VERBOSE)
        logger.log("a warning line by its level", pb_utils.Logger.WARNING)
        logger.log("an info line by default")
        try:
            logger.log("no line", 7)
        except TypeError as exc:
            logger.log_error(f"refused: {exc}")
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "X")]) for r in requests]
'''


STAMPED = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} model\[\d+\] "


def test_a_models_log_lines_follow_the_servers_log_settings(tmp_path: Path,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    """As in Triton, pb_utils.Logger's levels (Logger.LogLevel, or Logger.INFO and the others) follow the
    server's log settings: VERBOSE lines only at a log_verbose_level of 1 or more, the others by their
    switch. The model's process hears of a change before its next call."""
    backend: Any = backend_for(write_model(tmp_path, "logger", LOGGER, MISUSE_CONFIG.replace("misuse", "logger")))
    root, despina = logging.getLogger(), logging.getLogger("despina")
    saved = root.handlers[:], root.level, despina.level
    root.handlers[:] = [logging.StreamHandler()]  # pytest's own handlers stay out of it

    def lines() -> list[str]:
        results = backend.execute_requests([{"X": np.array([1], np.int32)}], [["Y"]])
        assert not isinstance(results[0], DespinaError), results[0]
        # each line as the worker's: "2026-12-06 10:22:20,863 model[1234] INFO model 'logger': ..."
        found = [line for line in capfd.readouterr().err.splitlines() if "model 'logger'" in line]
        assert all(re.match(STAMPED, line) for line in found), found
        return [re.sub(STAMPED, "", line) for line in found]

    backend.load()
    try:
        assert lines() == [
            "INFO model 'logger': an info line", "WARNING model 'logger': a warning line",
            "ERROR model 'logger': an error line", "WARNING model 'logger': a warning line by its level",
            "INFO model 'logger': an info line by default",
            "ERROR model 'logger': refused: Logger.log: level must be a pb_utils.Logger.LogLevel (INFO, WARNING, "
            "ERROR or VERBOSE), not 7"]
        logs.apply({**logs.defaults("info"), "log_verbose_level": 1})
        assert [line for line in lines() if line.startswith("VERBOSE")] == [
            "VERBOSE model 'logger': a verbose line", "VERBOSE model 'logger': a verbose line by its level"]
        logs.apply({**logs.defaults("info"), "log_info": False, "log_error": False})
        assert lines() == ["WARNING model 'logger': a warning line",
                           "WARNING model 'logger': a warning line by its level"]
        # Triton's ISO8601 stamps; JSON objects where the worker writes JSON lines (--log-format json)
        logs.apply({**logs.defaults("info"), "log_format": "ISO8601"})
        results = backend.execute_requests([{"X": np.array([1], np.int32)}], [["Y"]])
        assert not isinstance(results[0], DespinaError), results[0]
        iso = [line for line in capfd.readouterr().err.splitlines() if "model 'logger'" in line]
        assert iso and all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z model\[\d+\] ", line) for line in iso)
        logs.setup("info", "worker", json=True)
        logs.apply(logs.defaults("info"))
        results = backend.execute_requests([{"X": np.array([1], np.int32)}], [["Y"]])
        docs = [json.loads(line) for line in capfd.readouterr().err.splitlines() if '"model": "logger"' in line]
        assert docs[0]["level"] == "INFO" and docs[0]["message"] == "an info line", docs
        assert docs[0]["role"] == "model" and docs[0]["logger"] == "model.logger" and docs[0]["pid"] > 0
    finally:
        logs.setup("info", "worker")
        logs.apply(logs.defaults("info"))
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        despina.setLevel(saved[2])
        backend.unload()


DECOUPLED_MISUSE = '''
import os
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            response = pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(request, "X")])
            said = []
            for args, flags in (((response,), 3), ((response,), 2), ((None,), 0), ((), 0), ((response,), 0),
                                ((response,), FINAL), ((response,), FINAL), ((), FINAL), ((response,), 0)):
                try:
                    sender.send(*args, flags=flags)
                    said.append("sent")
                except pb_utils.TritonModelException as exc:
                    said.append(exc.message())
            with open(os.path.join(os.path.dirname(__file__), "said.txt"), "w") as f:
                f.write("\\n".join(said))
        return None
'''


def test_a_decoupled_senders_misuse_fails_as_in_triton(tmp_path: Path) -> None:
    """Triton's checks of a decoupled model's response sender, with its messages: flags 0 or the final
    one, a response unless the flag is final, nothing once the final flag went."""
    config = MISUSE_CONFIG.replace("misuse", "decoupled_misuse") + "model_transaction_policy { decoupled: true }\n"
    backend: Any = backend_for(write_model(tmp_path, "decoupled_misuse", DECOUPLED_MISUSE, config))
    got: list[tuple[Any, Any, bool]] = []
    backend.on_response = lambda stream, result, final: got.append((stream, result, final))
    backend.load()
    try:
        assert backend.execute_streams([{"X": np.array([4], np.int32)}], [["X"]], [1]) == [None]
        unsupported = "Unable to send response. Unsupported flag provided."
        no_response = "Inference Response object must be provided when the response flags is set to zero."
        closed = "Unable to send response. Response sender has been closed."
        said = (tmp_path / "decoupled_misuse" / "1" / "said.txt").read_text().split("\n")
        assert said == [unsupported, unsupported, no_response, no_response, "sent", "sent", closed, closed, closed]
        assert [(stream, final) for stream, _, final in got] == [(1, False), (1, True)]
    finally:
        backend.unload()
