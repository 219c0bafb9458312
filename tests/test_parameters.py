"""Custom request parameters reach a Python model, and its response parameters come back: a real
`despina serve` with a Python model that echoes them, and the records that carry them on their own."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina.contract import records
from despina.contract.errors import InvalidArgument
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.examples import build_add_sub

from .conftest import FULL_QUEUE_DELAY, Server, module_server, settled_stats
from .test_pb_utils import load_pb_utils

# PARAMS: each request's request.parameters() as it came; ID: its request_id(); BATCH: the requests of
# its execute. Response parameters: how many parameters it saw, and `reply` back when asked; the
# parameter `bad_reply` makes it answer with a float, which Triton's Python backend refuses.
ECHO = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "X").as_numpy().shape[0]
            raw = request.parameters()
            params = json.loads(raw)
            outputs = [pb_utils.Tensor("PARAMS", np.array([[raw.encode()]] * rows, dtype=np.object_)),
                       pb_utils.Tensor("ID", np.array([[request.request_id().encode()]] * rows,
                                                      dtype=np.object_)),
                       pb_utils.Tensor("BATCH", np.full((rows, 1), len(requests), dtype=np.int32))]
            reply = {"seen": len(params), "model": "echo"} if params else None
            if reply and "reply" in params:
                reply["reply"] = params["reply"]
            if params.get("bad_reply"):
                reply = {"ratio": 0.5}
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs, parameters=reply))
        return responses
'''

ECHO_CONFIG = '''
name: "echo"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [
  { name: "PARAMS", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "ID", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 200000 }
'''

ADD_SUB_CONFIG = '''
platform: "onnxruntime_onnx"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 200000 }
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("parameters-repo")
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "1" / "model.py").write_text(ECHO)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "add_sub" / "1").mkdir(parents=True)
    (root / "add_sub" / "config.pbtxt").write_text(ADD_SUB_CONFIG)
    build_add_sub(root / "add_sub" / "1" / "model.onnx")
    # the same model behind a reshape (workers/reshape.py): its inputs and outputs are re-made, and the
    # request's parameters and the response's must survive that
    (root / "echo_reshaped" / "1").mkdir(parents=True)
    (root / "echo_reshaped" / "1" / "model.py").write_text(ECHO)
    (root / "echo_reshaped" / "config.pbtxt").write_text(
        ECHO_CONFIG.replace('name: "echo"', 'name: "echo_reshaped"')
        .replace('dims: [ 1 ] } ]', 'dims: [ 1 ] reshape: { shape: [ ] } } ]', 1))
    yield from module_server(root, tmp_path_factory, redis_url, ("echo", "add_sub", "echo_reshaped"),
                             env=FULL_QUEUE_DELAY)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"), concurrency=8)
    yield c
    c.close()


def x_input(value: float = 1.0) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.float32), binary_data=True)
    return [tensor]


def text(result: httpclient.InferResult, output: str) -> str:
    value = result.as_numpy(output)[0, 0]  # bytes from a binary output, str from a JSON one
    return value.decode() if isinstance(value, bytes) else value


def echoed(result: httpclient.InferResult) -> dict[str, Any]:
    return json.loads(text(result, "PARAMS"))


def post_echo(server: Server, body: dict[str, Any]) -> httpx.Response:
    body = {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}], **body}
    return httpx.post(f"{server.url}/v2/models/echo/infer", json=body, timeout=30)


def test_json_request_parameters_reach_the_model_and_response_parameters_come_back(server: Server) -> None:
    sent = {"temperature": 0.5, "top_k": 3, "greedy": True, "name": "ünï", "reply": "pong"}
    reserved = {"priority": 0, "timeout": 0, "binary_data_output": False, "sequence_id": 0,
                "sequence_start": False, "sequence_end": False}
    r = post_echo(server, {"id": "req-7", "parameters": {**sent, **reserved}})
    assert r.status_code == 200, r.text
    body = r.json()
    outputs = {o["name"]: o["data"] for o in body["outputs"]}
    assert json.loads(outputs["PARAMS"][0]) == sent  # as sent, and none of the reserved ones
    assert outputs["ID"] == ["req-7"]
    assert body["id"] == "req-7"
    assert body["parameters"] == {"seen": len(sent), "model": "echo", "reply": "pong"}
    assert list(body) == ["model_name", "model_version", "id", "parameters", "outputs"]


def test_parameters_survive_a_reshape(server: Server) -> None:
    body = {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}],
            "parameters": {"reply": "pong"}, "id": "r1"}
    r = httpx.post(f"{server.url}/v2/models/echo_reshaped/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert json.loads(outputs["PARAMS"][0]) == {"reply": "pong"} and outputs["ID"] == ["r1"]
    assert r.json()["parameters"] == {"seen": 1, "model": "echo", "reply": "pong"}


def test_without_parameters_the_model_gets_an_empty_object_and_the_response_has_none(server: Server
                                                                                     ) -> None:
    for extra in ({}, {"parameters": {}}, {"parameters": {"binary_data_output": False, "priority": 0}}):
        r = post_echo(server, extra)
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
        assert outputs["PARAMS"] == ["{}"] and outputs["ID"] == [""]
        assert "parameters" not in r.json()


def test_binary_requests_carry_parameters_both_ways(client: httpclient.InferenceServerClient) -> None:
    """tritonclient's binary body (Inference-Header-Content-Length), with binary outputs and with JSON
    ones; twice with the same header (the gateway then decodes it by its remembered plan)."""
    json_outputs = [httpclient.InferRequestedOutput(n, binary_data=False) for n in ("PARAMS", "ID", "BATCH")]
    for outputs in (None, json_outputs, None):
        result = client.infer("echo", x_input(), outputs=outputs, request_id="bin-1",
                              parameters={"temperature": 0.25, "mode": "fast", "reply": 42})
        assert echoed(result) == {"temperature": 0.25, "mode": "fast", "reply": 42}
        assert text(result, "ID") == "bin-1"
        response = result.get_response()
        assert response["parameters"] == {"seen": 3, "model": "echo", "reply": 42}
        assert response["id"] == "bin-1"
    plain = client.infer("echo", x_input())
    assert echoed(plain) == {} and "parameters" not in plain.get_response()


def test_requests_of_one_batch_each_get_their_own_parameters(client: httpclient.InferenceServerClient
                                                              ) -> None:
    pending = [client.async_infer("echo", x_input(i), request_id=f"r{i}", parameters={"index": i})
               for i in range(6)]
    results = [p.get_result() for p in pending]
    for i, result in enumerate(results):
        assert echoed(result) == {"index": i}
        assert text(result, "ID") == f"r{i}"
        assert result.get_response()["parameters"] == {"seen": 1, "model": "echo"}
    assert max(int(r.as_numpy("BATCH")[0, 0]) for r in results) > 1  # they did share an execute


def test_requests_with_different_parameters_share_a_batch_on_other_backends(
        client: httpclient.InferenceServerClient, server: Server) -> None:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    before = settled_stats(server.url, "add_sub")
    pending = []
    for i in range(6):
        inputs = [httpclient.InferInput(n, [1, 4], "FP32") for n in ("a", "b")]
        inputs[0].set_data_from_numpy(a + i)
        inputs[1].set_data_from_numpy(a)
        pending.append(client.async_infer("add_sub", inputs, parameters={"index": i, "tag": f"t{i}"}))
    for i, p in enumerate(pending):
        result = p.get_result()
        np.testing.assert_array_equal(result.as_numpy("sum"), 2 * a + i)
        assert "parameters" not in result.get_response()  # the model has none to give
    after = settled_stats(server.url, "add_sub")
    inferences = after["inference_count"] - before.get("inference_count", 0)
    executions = after["execution_count"] - before.get("execution_count", 0)
    assert inferences == 6 and executions < inferences


@pytest.mark.parametrize(("parameters", "message"), [
    ([1, 2], "field 'parameters' must be an object"),
    ("temperature=1", "field 'parameters' must be an object"),
    ({"temperature": {"value": 1}}, "parameter 'temperature' must be a string, a number or a boolean, not an object"),
    ({"stop": ["a", "b"]}, "parameter 'stop' must be a string, a number or a boolean, not an array"),
    ({"seed": None}, "parameter 'seed' must be a string, a number or a boolean, not null"),
    # Triton 2.51's words; the model got it
    ({"seed": 1, "triton_x": True}, "parameter keys starting with 'triton_' are reserved for Triton usage and "
                                    "should not be specified."),
])
def test_bad_parameters_are_a_400_with_a_clear_message(server: Server, parameters: Any, message: str) -> None:
    r = post_echo(server, {"parameters": parameters})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == message
    # the same header ahead of binary data
    header = json.dumps({"parameters": parameters, "inputs": [
        {"name": "X", "shape": [1, 1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}]}).encode()
    r = httpx.post(f"{server.url}/v2/models/echo/infer", content=header + np.float32(1).tobytes(),
                   headers={"Inference-Header-Content-Length": str(len(header)),
                            "Content-Type": "application/octet-stream"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == message


def test_response_parameters_must_be_what_tritons_python_backend_takes(server: Server) -> None:
    r = post_echo(server, {"parameters": {"bad_reply": True}})
    assert r.status_code == 500, r.text
    assert "response parameter 'ratio' must be a bool, int or str, not float" in r.json()["error"]
    assert post_echo(server, {"parameters": {"reply": "again"}}).status_code == 200  # the model goes on


def test_server_metadata_lists_the_parameters_extension(client: httpclient.InferenceServerClient) -> None:
    assert "parameters" in client.get_server_metadata()["extensions"]


def test_tritonclient_refuses_reserved_names_itself(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="reserved"):
        client.infer("echo", x_input(), parameters={"priority": 1})


def test_pb_utils_takes_parameters_as_tritons_python_backend_does() -> None:
    pb_utils = load_pb_utils()
    assert pb_utils.InferenceRequest().parameters() == "{}"
    assert json.loads(pb_utils.InferenceRequest(parameters={"t": 0.5}).parameters()) == {"t": 0.5}
    assert pb_utils.InferenceResponse([]).parameters() == "{}"
    response = pb_utils.InferenceResponse([], parameters={"n": 2, "ok": True, "s": "x"})
    assert json.loads(response.parameters()) == {"n": 2, "ok": True, "s": "x"}
    for bad, message in (('{"n": 2}', "must be a dict, not str"), ({1: "x"}, "names must be str"),
                         ({"f": 0.5}, "'f' must be a bool, int or str, not float"),
                         ({"big": 2**63}, "'big' is out of the int64 range")):
        with pytest.raises(pb_utils.TritonModelException, match=message):
            pb_utils.InferenceResponse([], parameters=bad)


# -- the records on their own ----------------------------------------------------------------------


def test_request_records_with_and_without_parameters_decode() -> None:
    t = Tensor("x", "FP32", (1, 2), b"\0" * 8)
    old = ["1", "rep", 12.5, [t.pack()], ["y"], 1, 100, 11.0, "trace"]  # as a gateway before parameters
    (req,) = records.decode_requests(msgpack.packb([old], use_bin_type=True))
    assert req.parameters == {} and req.request_id == "" and req.trace == "trace"
    plain = InferRequest("1", "rep", 12.5, (t,), ("y",), 1, 100, 11.0, "trace")
    assert plain.pack() == old  # what an older worker reads
    assert records.decode_requests(records.encode([plain])) == [plain]
    for new in (InferRequest("2", "rep", 1.0, (t,), parameters={"a": 1, "b": "x", "c": True, "d": 0.5}),
                InferRequest("3", "rep", 1.0, (t,), request_id="v2-id"),
                InferRequest("4", "rep", 1.0, (t,), parameters={"k": -(2**63)}, request_id="v2-id")):
        assert records.decode_requests(records.encode([new])) == [new]
    assert len(InferRequest("3", "rep", 1.0, (t,), request_id="v2-id").pack()) == 11


def test_reply_records_with_and_without_parameters_decode() -> None:
    t = Tensor("y", "FP32", (1,), b"\0" * 4)
    old = ["1", [t.pack()], None, 3, 4]  # as a worker before parameters
    (reply,) = records.decode_replies(msgpack.packb([old], use_bin_type=True))
    assert reply.parameters == {} and reply.queue_us == 3 and reply.outputs == (t,)
    assert InferReply("1", (t,), None, 3, 4).pack() == old
    new = InferReply("1", (t,), None, 3, 4, {"seen": 2, "model": "echo", "ok": False})
    assert records.decode_replies(records.encode([new])) == [new]


@pytest.mark.parametrize("parameters", [[1], "x", None, {"a": {"b": 1}}, {"a": [1]}, {"a": None},
                                        {"a": b"bytes"}, {b"key": 1}])
def test_records_with_malformed_parameters_are_refused(parameters: Any) -> None:
    request = ["1", "rep", 1.0, [], [], 0, 0, 1.0, "", parameters]
    with pytest.raises(InvalidArgument, match="malformed request record"):
        records.decode_requests(msgpack.packb([request], use_bin_type=True))
    reply = ["1", [], None, 0, 0, parameters]
    with pytest.raises(InvalidArgument, match="malformed reply record"):
        records.decode_replies(msgpack.packb([reply], use_bin_type=True))


@pytest.mark.parametrize("record", [
    ["1", "rep", 1.0, [], [], 0, 0, 1.0, "", {}, 7],            # a request_id that is not a string
    ["1", "rep", 1.0, [], [], 0, 0, 1.0, "", {}, "id", "more"],  # past the request_id
])
def test_request_records_with_more_than_they_should_are_refused(record: list[Any]) -> None:
    with pytest.raises(InvalidArgument, match="malformed request record"):
        records.decode_requests(msgpack.packb([record], use_bin_type=True))
    with pytest.raises(InvalidArgument, match="malformed reply record"):
        records.decode_replies(msgpack.packb([["1", [], None, 0, 0, {}, {}]], use_bin_type=True))
