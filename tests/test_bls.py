"""Models calling models (Triton's business logic scripting): a Python model's `InferenceRequest.exec()`
and `async_exec()` against a real `despina serve`, on one worker (the call is queued into the called
model's runner in the same process) and on two (through the called model's Redis stream); then the
pipe protocol on its own, on the worker's thread path.

Every model.py here is written against Triton's documented `triton_python_backend_utils` API only.
"""
from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from despina.contract.catalog import CatalogEntry
from despina.contract.errors import Code, DespinaError
from despina.contract.keys import Keys
from despina.examples import build_add_sub
from despina.workers.backends.base import Request

from .conftest import Server, module_server, settled_stats
from .test_backend_python import backend_for, write_model

# exec(): add_sub (or the model named by the request's parameter "target") on X and ones, with the request
# id "call_id" says; an error of the call becomes this request's error, its code in the message, and the
# called model's response parameters become this response's.
CALLER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if params.get("bad_shape"):
                x = x.reshape(-1)
            call = pb_utils.InferenceRequest(
                model_name=params.get("target", "add_sub"), requested_output_names=["sum", "diff"],
                inputs=[pb_utils.Tensor("a", x), pb_utils.Tensor("b", np.ones_like(x))],
                timeout=params.get("call_timeout", 0), parameters={"sleep_ms": params.get("sleep_ms", 0)},
                request_id=params.get("call_id", ""))
            response = call.exec()
            if response.has_error():
                error = response.error()
                message = f"the call failed ({error.code()}): {error.message()}"
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)))
                continue
            outputs = [pb_utils.Tensor(name.upper(), pb_utils.get_output_tensor_by_name(response, name).as_numpy())
                       for name in ("sum", "diff")]
            responses.append(pb_utils.InferenceResponse(outputs, parameters=json.loads(response.parameters())))
        return responses
'''

# async_exec(): two calls of add_sub at once, each asking for one output.
ASYNC_CALLER = '''
import asyncio
import re
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            twice = pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["sum"],
                                              inputs=[pb_utils.Tensor("a", x), pb_utils.Tensor("b", x)])
            less = pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["diff"],
                                             inputs=[pb_utils.Tensor("a", x), pb_utils.Tensor("b", np.ones_like(x))],
                                             model_version=1, timeout=10_000_000)
            first, second = await asyncio.gather(twice.async_exec(), less.async_exec())
            if first.has_error() or second.has_error():
                failed = first if first.has_error() else second
                responses.append(pb_utils.InferenceResponse(error=failed.error()))
                continue
            assert [t.name() for t in first.output_tensors()] == ["sum"]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(first, "sum").as_numpy()),
                pb_utils.Tensor("DIFF", pb_utils.get_output_tensor_by_name(second, "diff").as_numpy())]))
        return responses
'''

# add_sub as a Python model, for a Python model calling a Python model; it sleeps as asked, and its response
# parameters say the request id and the parameters it got.
ADD_SUB_PY = '''
import json
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            time.sleep(json.loads(request.parameters()).get("sleep_ms", 0) / 1000)
            a = pb_utils.get_input_tensor_by_name(request, "a").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "b").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("sum", a + b), pb_utils.Tensor("diff", a - b)],
                parameters={"request_id": request.request_id(), "parameters": request.parameters()}))
        return responses
'''

# A decoupled model, as Triton's square_int32 example: for IN = n it sends n responses (OUT = 0..n-1), then
# the final flag alone, or with the last response when the parameter "final_with_last" says so; the
# parameter "fail_at" makes that response an error (the stream goes on). It waits "sleep_ms" before each,
# and stops when its request is cancelled, saying so in the log.
COUNTER = '''
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            params = json.loads(request.parameters())
            sender = request.get_response_sender()
            for i in range(n):
                time.sleep(params.get("sleep_ms", 0) / 1000)
                if request.is_cancelled():
                    pb_utils.Logger.log_info(f"counter: cancelled at {i}, request {request.request_id()}")
                    n = 0
                    break
                last = params.get("final_with_last") and i == n - 1
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
                if i == params.get("fail_at", -1):
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"no {i}")), flags=flags)
                else:
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]),
                                flags=flags)
            if not (params.get("final_with_last") and n):
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
COUNTER_CONFIG = '''
name: "counter"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
{memory}
'''

# exec(decoupled=True) of counter (or of the model the parameter "target" names), or async_exec with the
# parameter "use_async": the sum of the OUTs, how many responses came, how many were empty (the last,
# when the final flag came alone) and how many were errors; exec() without decoupled=True when asked
# ("plain"), whose error becomes this request's. With "cancel_after": k it cancels the call after k
# responses (ResponseIterator.cancel()), and iterates on to the end.
STREAM_CALLER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            n = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            target = params.get("target", "counter")
            inputs = [pb_utils.Tensor("IN", n)] if target == "counter" else \\
                [pb_utils.Tensor("a", np.ones((1, 4), np.float32)), pb_utils.Tensor("b", np.ones((1, 4), np.float32))]
            call = pb_utils.InferenceRequest(
                model_name=target, inputs=inputs,
                requested_output_names=["OUT"] if target == "counter" else ["sum"],
                parameters={k: v for k, v in params.items() if k in ("final_with_last", "fail_at", "sleep_ms")},
                request_id=params.get("call_id", ""))
            if params.get("plain"):
                response = call.exec()
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            stream = await call.async_exec(decoupled=True) if params.get("use_async") else call.exec(decoupled=True)
            total = count = empty = errors = 0
            for response in stream:
                if count == params.get("cancel_after", -1):
                    stream.cancel()
                    stream.cancel()  # (once is enough)
                count += 1
                if response.has_error():
                    errors += 1
                elif len(response.output_tensors()) == 0:
                    empty += 1
                else:
                    total += int(response.output_tensors()[0].as_numpy().sum())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor(name, np.array([value], np.int32))
                for name, value in (("SUM", total), ("RESPONSES", count), ("EMPTY", empty), ("ERRORS", errors))]))
        return responses
'''
STREAM_CALLER_CONFIG = '''
name: "stream_caller"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [
  { name: "SUM", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "RESPONSES", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "EMPTY", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "ERRORS", data_type: TYPE_INT32, dims: [ 1 ] }
]
{memory}
'''


def memory(memory_mb: int) -> str:
    return f'parameters {{ key: "memory_mb" value: {{ string_value: "{memory_mb}" }} }}' if memory_mb else ""


# A call from initialize: refused, as in Triton.
EARLY_CALLER = CALLER.replace("    def execute", '''    def initialize(self, args):
        try:
            pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["sum"], inputs=[]).exec()
        except pb_utils.TritonModelException as exc:
            assert "BLS is only supported during the 'execute' function." == exc.message(), exc.message()
        else:
            raise RuntimeError("a call from initialize went through")

    def execute''')


def caller_config(name: str, memory_mb: int = 0) -> str:
    memory = f'parameters {{ key: "memory_mb" value: {{ string_value: "{memory_mb}" }} }}\n' if memory_mb else ""
    return f'''
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [
  {{ name: "SUM", data_type: TYPE_FP32, dims: [ 4 ] }},
  {{ name: "DIFF", data_type: TYPE_FP32, dims: [ 4 ] }}
]
{memory}'''


ADD_SUB_PY_CONFIG = '''
name: "add_sub_py"
backend: "python"
max_batch_size: 8
input [ { name: "a", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "b", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "sum", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "diff", data_type: TYPE_FP32, dims: [ 4 ] } ]
'''


def add_onnx_add_sub(root: Path, memory_mb: int = 0) -> None:
    (root / "add_sub" / "1").mkdir(parents=True)
    memory = f'parameters {{ key: "memory_mb" value: {{ string_value: "{memory_mb}" }} }}\n' if memory_mb else ""
    (root / "add_sub" / "config.pbtxt").write_text(f'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n{memory}')
    build_add_sub(root / "add_sub" / "1" / "model.onnx")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bls-repo")
    write_model(root, "caller", CALLER, caller_config("caller"))
    write_model(root, "async_caller", ASYNC_CALLER, caller_config("async_caller"))
    write_model(root, "add_sub_py", ADD_SUB_PY, ADD_SUB_PY_CONFIG)
    write_model(root, "counter", COUNTER, COUNTER_CONFIG.replace("{memory}", ""))
    write_model(root, "stream_caller", STREAM_CALLER, STREAM_CALLER_CONFIG.replace("{memory}", ""))
    add_onnx_add_sub(root)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, repo: Path) -> Iterator[Server]:
    yield from module_server(repo, tmp_path_factory, redis_url,
                             ("caller", "async_caller", "add_sub_py", "add_sub", "counter", "stream_caller"))


def infer(server: Server, model: str, x: np.ndarray, **parameters: Any) -> httpx.Response:
    body: dict[str, Any] = {"inputs": [{"name": "X", "datatype": "FP32", "shape": list(x.shape),
                                        "data": x.ravel().tolist()}]}
    if parameters:
        body["parameters"] = parameters
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)


def outputs(response: httpx.Response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    return {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"])
            for o in response.json()["outputs"]}


X = np.arange(8, dtype=np.float32).reshape(2, 4)


def test_exec_calls_an_onnx_model(server: Server) -> None:
    out = outputs(infer(server, "caller", X))
    np.testing.assert_array_equal(out["SUM"], X + 1)
    np.testing.assert_array_equal(out["DIFF"], X - 1)


def test_async_exec_runs_two_calls_at_once(server: Server) -> None:
    out = outputs(infer(server, "async_caller", X))
    np.testing.assert_array_equal(out["SUM"], X * 2)
    np.testing.assert_array_equal(out["DIFF"], X - 1)


def test_a_python_model_calls_a_python_model(server: Server) -> None:
    out = outputs(infer(server, "caller", X, target="add_sub_py"))
    np.testing.assert_array_equal(out["SUM"], X + 1)
    np.testing.assert_array_equal(out["DIFF"], X - 1)


def test_a_call_passes_its_request_id_and_parameters_and_returns_the_response_parameters(server: Server) -> None:
    """As in Triton: the called model sees the call's request_id and parameters, and the caller gets the
    called model's response parameters (response.parameters())."""
    r = infer(server, "caller", X, target="add_sub_py", call_id="call-7", sleep_ms=1)
    assert r.status_code == 200, r.text
    assert r.json()["parameters"] == {"request_id": "call-7", "parameters": '{"sleep_ms":1}'}
    r = infer(server, "caller", X, target="add_sub")  # a model that sets none: none
    assert r.status_code == 200 and "parameters" not in r.json(), r.text


def test_calling_a_missing_model_is_an_error_response(server: Server) -> None:
    response = infer(server, "caller", X, target="nope")
    assert response.status_code == 500
    assert "the call failed (2): Request for unknown model: 'nope' is not found" in response.json()["error"]


def test_a_call_with_a_wrong_shape_is_an_error_response(server: Server) -> None:
    response = infer(server, "caller", X, bad_shape=True)
    assert response.status_code == 500
    error = response.json()["error"]
    assert "the call failed (3): calling model 'add_sub': input 'a': shape [8]" in error
    np.testing.assert_array_equal(outputs(infer(server, "caller", X))["SUM"], X + 1)  # and it goes on


def test_a_call_that_cannot_be_answered_in_time_is_an_error_response(server: Server) -> None:
    """The called model takes 1.5 s (the call's parameters tell it to); the call's timeout, 300 ms (in µs
    as Triton takes it), ends the wait."""
    response = infer(server, "caller", X, target="add_sub_py", call_timeout=300_000, sleep_ms=1500)
    assert response.status_code == 500
    assert "the call failed (4): no answer from model 'add_sub_py' within 0.3 s" in response.json()["error"]
    # (after the slow one: the next test counts add_sub_py's requests)
    np.testing.assert_array_equal(outputs(infer(server, "caller", X, target="add_sub_py"))["SUM"], X + 1)


def test_the_called_model_counts_the_calls(server: Server) -> None:
    def count() -> int:
        return int(settled_stats(server.url, "add_sub_py")["inference_stats"]["success"]["count"])

    before = count()
    for _ in range(3):
        outputs(infer(server, "caller", X, target="add_sub_py"))
    assert count() == before + 3


def stream_call(server: Server, n: int, **parameters: Any) -> dict[str, int]:
    body: dict[str, Any] = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [n]}],
                            "parameters": parameters}
    r = httpx.post(f"{server.url}/v2/models/stream_caller/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"][0] for o in r.json()["outputs"]}


@pytest.mark.parametrize("use_async", [False, True])
def test_exec_decoupled_iterates_a_decoupled_models_responses(server: Server, use_async: bool) -> None:
    """Each response in order, then an empty last one for the final flag alone, as Triton's iterator
    gives it; with the final flag on the last response, no empty one."""
    assert stream_call(server, 4, use_async=use_async) == {"SUM": 6, "RESPONSES": 5, "EMPTY": 1, "ERRORS": 0}
    assert stream_call(server, 4, use_async=use_async, final_with_last=True) == \
        {"SUM": 6, "RESPONSES": 4, "EMPTY": 0, "ERRORS": 0}
    assert stream_call(server, 0, use_async=use_async) == {"SUM": 0, "RESPONSES": 1, "EMPTY": 1, "ERRORS": 0}
    # an error response on the way is one of the responses; the stream goes on past it
    assert stream_call(server, 4, use_async=use_async, fail_at=1) == \
        {"SUM": 5, "RESPONSES": 5, "EMPTY": 1, "ERRORS": 1}


def cancelled_call(server: Server, call_id: str) -> None:
    """A call of counter cancelled after two of its 500 responses: the iteration ends with an error
    response (CANCELLED) soon after, and counter sees its request cancelled and stops."""
    result = stream_call(server, 500, cancel_after=2, sleep_ms=10, call_id=call_id)
    assert 3 <= result["RESPONSES"] <= 10 and result["ERRORS"] == 1 and result["EMPTY"] == 0, result
    deadline = time.monotonic() + 30
    while "counter: cancelled at" not in server.logs() or f"request {call_id}" not in server.logs():
        assert time.monotonic() < deadline, "counter never saw its request cancelled"
        time.sleep(0.1)
    stopped = re.search(rf"counter: cancelled at (\d+), request {call_id}", server.logs())
    assert stopped and int(stopped.group(1)) < 20, stopped


def test_a_decoupled_call_cancelled_ends_and_the_called_model_stops(server: Server) -> None:
    """Triton's ResponseIterator.cancel() on exec(decoupled=True)'s iterator; on the iterator of
    async_exec(decoupled=True), which has every response already, it changes nothing."""
    cancelled_call(server, "cancel-here")
    assert stream_call(server, 4, use_async=True, cancel_after=2) == \
        {"SUM": 6, "RESPONSES": 5, "EMPTY": 1, "ERRORS": 0}


def test_exec_decoupled_of_a_model_that_answers_once_gives_its_one_response(server: Server) -> None:
    assert stream_call(server, 1, target="add_sub") == {"SUM": 8, "RESPONSES": 1, "EMPTY": 0, "ERRORS": 0}


def test_a_decoupled_model_called_without_decoupled_is_an_error_response(server: Server) -> None:
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [2]}],
            "parameters": {"plain": True}}
    r = httpx.post(f"{server.url}/v2/models/stream_caller/infer", json=body, timeout=30)
    # the call's error passed on as this request's, its code with it (INVALID_ARGUMENT: 400)
    assert r.status_code == 400 and "call it with exec(decoupled=True)" in r.json()["error"], r.text


def test_exec_decoupled_through_redis_to_a_decoupled_model_on_another_worker(
        serve: Any, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The caller and counter land apart (room for one model each): the responses come back through the
    worker's own reply stream, in order."""
    write_model(tmp_path / "repo", "counter", COUNTER, COUNTER_CONFIG.replace("{memory}", memory(100)))
    write_model(tmp_path / "repo", "stream_caller", STREAM_CALLER,
                STREAM_CALLER_CONFIG.replace("{memory}", memory(100)))
    server = serve(tmp_path / "repo", "--workers", "2", env={"DESPINA_WORKER_MEMORY_MB": "150"},
                   wait_models=("counter", "stream_caller"))
    client = redis.Redis.from_url(redis_url)
    try:
        placed = {name: CatalogEntry.loads(client.hget(Keys(key_prefix).catalog, name)).workers
                  for name in ("counter", "stream_caller")}
    finally:
        client.close()
    assert len({w for ws in placed.values() for w in ws}) == 2, placed
    for use_async in (False, True):
        assert stream_call(server, 5, use_async=use_async) == {"SUM": 10, "RESPONSES": 6, "EMPTY": 1, "ERRORS": 0}
        assert stream_call(server, 3, use_async=use_async, fail_at=0, final_with_last=True) == \
            {"SUM": 3, "RESPONSES": 3, "EMPTY": 0, "ERRORS": 1}
    cancelled_call(server, "cancel-far")  # the cancellation goes through Redis too


def test_calls_go_through_redis_to_a_model_on_another_worker(
        serve: Any, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Two workers with room for one model each: the caller and add_sub land apart, and the call goes
    through add_sub's request stream."""
    write_model(tmp_path / "repo", "caller", CALLER, caller_config("caller", memory_mb=100))
    write_model(tmp_path / "repo", "async_caller", ASYNC_CALLER, caller_config("async_caller", memory_mb=100))
    add_onnx_add_sub(tmp_path / "repo", memory_mb=100)
    server = serve(tmp_path / "repo", "--workers", "3", env={"DESPINA_WORKER_MEMORY_MB": "150"},
                   wait_models=("caller", "async_caller", "add_sub"))
    client = redis.Redis.from_url(redis_url)
    try:
        placed = {name: CatalogEntry.loads(client.hget(Keys(key_prefix).catalog, name)).workers
                  for name in ("caller", "async_caller", "add_sub")}
    finally:
        client.close()
    assert len({w for ws in placed.values() for w in ws}) == 3, placed
    before = int(settled_stats(server.url, "add_sub")["inference_stats"]["success"]["count"])
    out = outputs(infer(server, "caller", X))
    np.testing.assert_array_equal(out["SUM"], X + 1)
    out = outputs(infer(server, "async_caller", X))
    np.testing.assert_array_equal(out["SUM"], X * 2)
    np.testing.assert_array_equal(out["DIFF"], X - 1)
    response = infer(server, "caller", X, bad_shape=True)
    assert "the call failed (3): calling model 'add_sub': input 'a'" in response.json()["error"]
    after = int(settled_stats(server.url, "add_sub")["inference_stats"]["success"]["count"])
    assert after == before + 3


def test_a_call_through_redis_passes_its_request_id_and_returns_the_response_parameters(
        serve: Any, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The same with the caller and the called model on two workers (room for one model each)."""
    write_model(tmp_path / "repo", "caller", CALLER, caller_config("caller", memory_mb=100))
    write_model(tmp_path / "repo", "add_sub_py", ADD_SUB_PY, ADD_SUB_PY_CONFIG + memory(100))
    server = serve(tmp_path / "repo", "--workers", "2", env={"DESPINA_WORKER_MEMORY_MB": "150"},
                   wait_models=("caller", "add_sub_py"))
    client = redis.Redis.from_url(redis_url)
    try:
        placed = {name: CatalogEntry.loads(client.hget(Keys(key_prefix).catalog, name)).workers
                  for name in ("caller", "add_sub_py")}
    finally:
        client.close()
    assert len({w for ws in placed.values() for w in ws}) == 2, placed
    r = infer(server, "caller", X, target="add_sub_py", call_id="far-1")
    assert r.status_code == 200, r.text
    assert r.json()["parameters"] == {"request_id": "far-1", "parameters": '{"sleep_ms":0}'}


# -- the pipe on its own -----------------------------------------------------------------------------


class LoopCaller:
    """A worker's ModelCaller as the pipe sees it (its event loop, `infer`), serving add_sub's sums
    itself on a loop of its own thread: what is tested is the backend's side of the pipe."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.calls: list[tuple[str, int | None, float]] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def infer(self, model: str, version: int | None, inputs: dict[str, np.ndarray], outputs: list[str],
                    timeout_s: float, parameters: Any, sequence: Any = None, partial: Any = None,
                    request_id: str = "", cancel: Any = None) -> dict[str, np.ndarray] | DespinaError:
        self.calls.append((model, version, timeout_s))
        if model == "boom":  # a fault of the worker's side: the model must hear of it, not wait forever
            raise RuntimeError("the caller broke")
        if model == "slow":
            await asyncio.sleep(30)
        if model != "add_sub":
            return DespinaError(f"unknown model '{model}'", Code.NOT_FOUND)
        a, b = inputs["a"], inputs["b"]
        return {name: value for name, value in (("sum", a + b), ("diff", a - b)) if name in outputs}

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


def test_the_thread_path_serves_calls_and_initialize_may_not_call(tmp_path: Path) -> None:
    backend: Any = backend_for(write_model(tmp_path, "caller", EARLY_CALLER, caller_config("caller")))
    caller = LoopCaller()
    backend.caller = caller
    backend.load()
    try:
        x = np.ones((1, 4), np.float32)
        [out] = backend.execute_requests([{"X": x}], [["SUM", "DIFF"]])  # the thread way
        assert isinstance(out, dict), out
        np.testing.assert_array_equal(out["SUM"], x + 1)
        assert caller.calls == [("add_sub", None, 0.0)]
    finally:
        backend.unload()
        caller.close()


def test_a_fault_in_the_workers_side_of_a_call_is_an_error_response_not_a_hang(tmp_path: Path) -> None:
    from despina.workers.backends.base import Request

    backend: Any = backend_for(write_model(tmp_path, "caller", CALLER, caller_config("caller")))
    caller = LoopCaller()
    backend.caller = caller
    backend.load()
    try:
        request = Request({"X": np.ones((1, 4), np.float32)}, {"target": "boom"}, "")
        [out] = backend.execute_requests([request], [["SUM", "DIFF"]])
        assert isinstance(out, DespinaError) and "the caller broke" in out.message, out
    finally:
        backend.unload()
        caller.close()


def test_without_a_caller_a_call_is_an_unavailable_error_response(tmp_path: Path) -> None:
    backend: Any = backend_for(write_model(tmp_path, "caller", CALLER, caller_config("caller")))
    backend.load()
    try:
        [out] = backend.execute_requests([{"X": np.ones((1, 4), np.float32)}], [["SUM", "DIFF"]])
        assert isinstance(out, DespinaError)
        assert "the call failed (4): model calls are not available here" in out.message
    finally:
        backend.unload()


def test_a_cancelled_execute_gives_up_its_calls_and_the_next_one_runs(tmp_path: Path) -> None:
    """The worker gave up on a batch (cancelled) while its model waited for a call: the call is answered
    at once, the process finishes that execute, and the next batch gets its own answer."""
    backend: Any = backend_for(write_model(tmp_path, "caller", CALLER, caller_config("caller")))
    caller = LoopCaller()
    backend.caller = caller
    backend.load()
    x = np.ones((1, 4), np.float32)

    async def scenario() -> None:
        slow = asyncio.ensure_future(backend.execute_requests_async(
            [Request({"X": x}, {"target": "slow"}, "")], [["SUM", "DIFF"]]))
        await asyncio.sleep(0.3)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        [out] = await asyncio.wait_for(backend.execute_requests_async([{"X": x}], [["SUM", "DIFF"]]), 5)
        assert isinstance(out, dict), out
        np.testing.assert_array_equal(out["DIFF"], x - 1)

    try:
        asyncio.run(scenario())
    finally:
        backend.unload()
        caller.close()
