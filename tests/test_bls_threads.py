"""Model calls from a decoupled model's own threads, after its execute returned: Triton's stub takes a
BLS call at any time between initialize and finalize, and a decoupled model that answers from a thread
per request (calling a tokenizer, say, on the way) relies on it. Checked against a real Triton 2.51 with
these same models: every stream below ends with the same events there.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import Server, module_server
from .test_backend_python import write_model

# The called models: "double" answers once; "count" (decoupled) answers 0, 1, ... N-1, then the final flag.
DOUBLE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
'''
DOUBLE_CONFIG = '''
name: "double"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]
'''
COUNT = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for i in range(int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([i], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
COUNT_CONFIG = '''
name: "count"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "I", data_type: TYPE_INT32, dims: [ 1 ] } ]
'''
NAP = DOUBLE.replace("class TritonPythonModel:", "import time\n\n\nclass TritonPythonModel:").replace(
    "    def execute(self, requests):", "    def execute(self, requests):\n        time.sleep(NAP_S)")
NAP_S = 4.0
# For each request, a thread started by execute (which returns at once) calls the models, WAYS of them at
# once, and sends what they said as its one response, with the final flag.
WORKER_THREADS = '''
import json
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils


def call(how, x):
    if how == "nap":
        request = pb_utils.InferenceRequest(model_name="nap", requested_output_names=["Y"],
                                            inputs=[pb_utils.Tensor("X", np.array([x], np.float32))])
        return request.exec().output_tensors()[0].as_numpy().tolist()
    if how == "stream":
        request = pb_utils.InferenceRequest(model_name="count", requested_output_names=["I"],
                                            inputs=[pb_utils.Tensor("N", np.array([x], np.int32))])
        return [r.output_tensors()[0].as_numpy().tolist() if r.output_tensors() else None
                for r in request.exec(decoupled=True)]
    response = pb_utils.InferenceRequest(model_name="double", requested_output_names=["Y"],
                                         inputs=[pb_utils.Tensor("X", np.array([x], np.float32))]).exec()
    if response.has_error():
        return "error: " + response.error().message()
    return pb_utils.get_output_tensor_by_name(response, "Y").as_numpy().tolist()


def answer(sender, how, ways):
    said = [None] * ways

    def one(i):
        try:
            said[i] = call(how, i + 1)
        except Exception as exc:
            said[i] = f"{type(exc).__name__}: {exc}"
    threads = [threading.Thread(target=one, args=(i,)) for i in range(ways)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(said)], np.object_))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            how = pb_utils.get_input_tensor_by_name(request, "HOW").as_numpy()[0].decode()
            ways = int(pb_utils.get_input_tensor_by_name(request, "WAYS").as_numpy()[0])
            threading.Thread(target=answer, args=(request.get_response_sender(), how, ways)).start()
            if how == "nap":
                time.sleep(0.5)  # its call goes while execute runs
        return None
'''
WORKER_THREADS_CONFIG = '''
name: "worker_threads"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "HOW", data_type: TYPE_STRING, dims: [ 1 ] }, { name: "WAYS", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''

# Not decoupled: each request answered through its sender by a thread, after a call; execute returns None.
SENDER_THREADS = WORKER_THREADS.replace(
    "def answer(sender, how, ways):", "def answer(sender, how, ways):\n    time.sleep(0.2)  # execute returned")
SENDER_THREADS_CONFIG = WORKER_THREADS_CONFIG.replace('"worker_threads"', '"sender_threads"').replace(
    "model_transaction_policy { decoupled: true }\n", "")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root: Path = tmp_path_factory.mktemp("bls-threads-repo")
    write_model(root, "double", DOUBLE, DOUBLE_CONFIG)
    write_model(root, "count", COUNT, COUNT_CONFIG)
    write_model(root, "worker_threads", WORKER_THREADS, WORKER_THREADS_CONFIG)
    write_model(root, "sender_threads", SENDER_THREADS, SENDER_THREADS_CONFIG)
    write_model(root, "nap", NAP.replace("NAP_S", str(NAP_S)), DOUBLE_CONFIG.replace('"double"', '"nap"'))
    yield from module_server(root, tmp_path_factory, redis_url,
                             ("double", "count", "worker_threads", "sender_threads", "nap"))


def said(server: Server, how: str, ways: int) -> object:
    body = {"HOW": how, "WAYS": ways}
    r = httpx.post(f"{server.url}/v2/models/worker_threads/generate_stream", json=body, timeout=30)
    assert r.status_code == 200, r.text
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 1, events
    return json.loads(events[0]["OUT"])


@pytest.mark.parametrize("ways", [1, 3])
def test_a_decoupled_models_thread_calls_a_model_after_execute_returned(server: Server, ways: int) -> None:
    """Was "TritonModelException: BLS is only supported during the 'execute' function."; Triton 2.51
    answers the call (["[2.0]"] for one way, three answers for three)."""
    assert said(server, "exec", ways) == [[2.0 * (i + 1)] for i in range(ways)]


def test_a_decoupled_models_thread_iterates_a_decoupled_call_after_execute_returned(server: Server) -> None:
    assert said(server, "stream", 2) == [[[0], None], [[0], [1], None]]


def test_requests_keep_coming_while_threads_call_models(server: Server) -> None:
    """Several streams at once: the model's process reads the next requests while its threads wait for
    their calls' answers, and each answer reaches its own thread."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda ways: said(server, "exec", ways), [1, 2, 3, 2]))
    assert answers == [[[2.0 * (i + 1)] for i in range(ways)] for ways in [1, 2, 3, 2]]


def test_a_thread_waiting_for_a_long_call_holds_up_no_other_request(server: Server) -> None:
    """A thread waits for a call of nap (which sleeps 4 s), made while its execute ran; the requests
    after it run and answer meanwhile, as in Triton. The thread used to read the process's connection
    until its answer came, so the process could not answer that execute, and the requests after it
    waited for nap too."""
    order: list[str] = []
    napping = threading.Thread(target=lambda: order.append(f"nap {said(server, 'nap', 1)}"))
    napping.start()
    time.sleep(1.0)  # (its thread is waiting for nap by now, the call made while its execute ran)
    for _ in range(3):
        order.append(f"exec {said(server, 'exec', 1)}")
    napping.join()
    assert order == ["exec [[2.0]]"] * 3 + ["nap [[2.0]]"]


def test_a_models_thread_calls_a_model_before_it_answers_through_the_sender(server: Server) -> None:
    """Not decoupled: execute returned None and the thread answers through the request's sender, after a
    call of its own. Was "BLS is only supported during the 'execute' function."; Triton 2.51 answers it."""
    body = {"inputs": [{"name": "HOW", "datatype": "BYTES", "shape": [1], "data": ["exec"]},
                       {"name": "WAYS", "datatype": "INT32", "shape": [1], "data": [2]}]}
    r = httpx.post(f"{server.url}/v2/models/sender_threads/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["outputs"][0]["data"][0]) == [[2.0], [4.0]]
