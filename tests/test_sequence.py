"""Triton's sequence batcher (contract/sequence.py, workers/sequences.py): stateful models get each
sequence's requests in order, on one instance, with its control inputs; against a real `despina serve`
of an ONNX model that shows its controls and a Python model that keeps a running sum per sequence."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from onnx import TensorProto, helper

from despina.contract.catalog import CatalogEntry
from despina.contract.ensemble import Ensemble, is_ensemble
from despina.contract.errors import ConfigError, InvalidArgument
from despina.contract.modelconfig import normalize, parse_text, to_dict, validate
from despina.contract.modelspec import ModelSpec
from despina.examples import save_onnx
from despina.gateway.fn import refuse_stateful
from despina.gateway.models import Model

from .conftest import Server, module_server

CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
"""
# shows: y = x + 100 START + 10 END + READY, and the row's correlation ID
SHOWS = f"""
name: "shows"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 1 ] }}, {{ name: "corr" data_type: TYPE_UINT64 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 500000
  {CONTROLS}
  oldest {{ max_candidate_sequences: 8 max_queue_delay_microseconds: 20000 }}
}}
"""
# a running sum per sequence, kept in the instance (two instances: each sequence must stay on its own)
SUMS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            if not pb_utils.get_input_tensor_by_name(request, "READY").as_numpy().ravel()[0]:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("sum", x)]))  # an empty row
                continue
            corr = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().ravel()[0])
            if pb_utils.get_input_tensor_by_name(request, "START").as_numpy().ravel()[0]:
                self.sums[corr] = 0.0
            self.sums[corr] += float(x.ravel()[0])
            out = np.array([[self.sums[corr]]], dtype=np.float32)
            if pb_utils.get_input_tensor_by_name(request, "END").as_numpy().ravel()[0]:
                del self.sums[corr]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("sum", out)]))
        return responses
'''
SUMS_CONFIG = f"""
name: "sums"
backend: "python"
max_batch_size: 4
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "sum" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
sequence_batching {{
  {CONTROLS}
  direct {{ }}
}}
"""


# a running sum per sequence keyed by request.correlation_id(), reset and dropped by request.flags()
KEYED = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            key, flags = request.correlation_id(), request.flags()
            if not key and key not in self.sums:  # Direct's empty row (no sequence), or no sequence at all
                self.sums[key] = 0.0
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.sums[key] = 0.0
            self.sums[key] += float(pb_utils.get_input_tensor_by_name(request, "x").as_numpy().ravel()[0])
            out = [pb_utils.Tensor("sum", np.array([[self.sums[key]]], dtype=np.float32)),
                   pb_utils.Tensor("flags", np.array([[flags]], dtype=np.int32)),
                   pb_utils.Tensor("key", np.array([[str(key).encode()]], dtype=np.object_))]
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                del self.sums[key]
            responses.append(pb_utils.InferenceResponse(out))
        return responses
'''
KEYED_CONFIG = """
name: "keyed"
backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "sum" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "flags" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "key" data_type: TYPE_STRING dims: [ 1 ] } ]
sequence_batching { }
"""


# Direct, two rows: answers each request with what every request of its execute showed (CORRID, READY,
# correlation_id(), flags())
SEEN = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        seen = [[int(pb_utils.get_input_tensor_by_name(r, name).as_numpy().ravel()[0]) for name in ("CORRID", "READY")]
                + [r.correlation_id(), r.flags()] for r in requests]
        out = np.array([[json.dumps(seen).encode()]], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("seen", out)]) for _ in requests]
'''
SEEN_CONFIG = f"""
name: "seen"
backend: "python"
max_batch_size: 2
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "seen" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
sequence_batching {{
  {CONTROLS}
  direct {{ }}
}}
"""


# calls `shows` without a sequence, as a model's call (BLS) does, and answers with what it got
CALLS = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="shows", requested_output_names=["y"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "x")])
            got = call.exec()
            responses.append(pb_utils.InferenceResponse([], error=got.error()) if got.has_error()
                             else pb_utils.InferenceResponse([got.output_tensors()[0]]))
        return responses
'''
CALLS_CONFIG = """
name: "calls"
backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


# implicit state: y = x + the state, and the state becomes y; ONNX (initial state 10, from a file,
# batched) and Python (initial state zeros, per request)
ACC = """
name: "acc"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  state [ { input_name: "IN_STATE" output_name: "OUT_STATE" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "ten" name: "ten" } } ]
  oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 20000 }
}
"""
PACC = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            y = (pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
                 + pb_utils.get_input_tensor_by_name(request, "IN_STATE").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", y),
                                                         pb_utils.Tensor("OUT_STATE", y)]))
        return responses
'''
PACC_CONFIG = """
name: "pacc"
backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching { state [ { input_name: "IN_STATE" output_name: "OUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] } ] }
"""


# drives a sequence of `acc` through model calls (BLS): three calls under one correlation ID
DRIVES = '''
import triton_python_backend_utils as pb_utils

START, END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x")
            for flags in (START, 0, END):
                got = pb_utils.InferenceRequest(model_name="acc", requested_output_names=["y"], inputs=[x],
                                                correlation_id=555, flags=flags).exec()
                if got.has_error():
                    break
            responses.append(pb_utils.InferenceResponse([], error=got.error()) if got.has_error()
                             else pb_utils.InferenceResponse([got.output_tensors()[0]]))
        return responses
'''


# an ensemble of both accumulators: x -> acc -> pacc; its request's sequence reaches both
CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "z" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "acc" model_version: -1 input_map { key: "x" value: "x" } output_map { key: "y" value: "y1" } },
  { model_name: "pacc" model_version: -1 input_map { key: "x" value: "y1" } output_map { key: "y" value: "z" } }
] }
"""


# the ONNX accumulator without a batch dimension (max_batch_size 0): each request runs alone
ACC0 = """
name: "acc0"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "IN_STATE" output_name: "OUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] } ]
}
"""


def build_acc(path: Path, batched: bool = True) -> None:
    def value(name: str, onnx_type: int = TensorProto.FLOAT) -> Any:
        return helper.make_tensor_value_info(name, onnx_type, ["N", 1] if batched else [1])

    inputs = [value("x"), value("IN_STATE")] + ([] if batched else [value("START", TensorProto.INT32)])
    nodes = [helper.make_node("Add", ["x", "IN_STATE"], ["y"]), helper.make_node("Identity", ["y"], ["OUT_STATE"])]
    if not batched:  # a control input the graph reads, so that it is one of the model's inputs
        nodes += [helper.make_node("Identity", ["START"], ["started"])]
    outputs = [value("y"), value("OUT_STATE")] + ([] if batched else [value("started", TensorProto.INT32)])
    graph = helper.make_graph(nodes, "acc", inputs, outputs)
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def build_shows(path: Path) -> None:
    def value(name: str, onnx_type: int) -> Any:
        return helper.make_tensor_value_info(name, onnx_type, ["N", 1])

    nodes = [helper.make_node("Cast", ["START"], ["s"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["READY"], ["r"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["s", "hundred"], ["s100"]),
             helper.make_node("Mul", ["END", "ten"], ["e10"]),
             helper.make_node("Add", ["x", "s100"], ["a"]), helper.make_node("Add", ["a", "e10"], ["b"]),
             helper.make_node("Add", ["b", "r"], ["y"]), helper.make_node("Identity", ["CORRID"], ["corr"])]
    consts = [helper.make_tensor("hundred", TensorProto.FLOAT, [], [100.0]),
              helper.make_tensor("ten", TensorProto.FLOAT, [], [10.0])]
    graph = helper.make_graph(
        nodes, "shows",
        [value("x", TensorProto.FLOAT), value("START", TensorProto.INT32), value("END", TensorProto.FLOAT),
         value("READY", TensorProto.INT32), value("CORRID", TensorProto.UINT64)],
        [value("y", TensorProto.FLOAT), value("corr", TensorProto.UINT64)], consts)
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    yield from module_server(repository, tmp_path_factory, redis_url,
                             ("shows", "sums", "keyed", "unkeyed", "calls", "acc", "pacc", "drives", "chain",
                              "acc0", "seen", "dshows"))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sequence-repo")
    build_shows(root / "shows" / "1" / "model.onnx")
    build_shows(root / "dshows" / "1" / "model.onnx")  # shows, Direct, two rows
    (root / "dshows" / "config.pbtxt").write_text(SHOWS.replace('name: "shows"', 'name: "dshows"').replace(
        "max_batch_size: 8", "max_batch_size: 2\ninstance_group [ { count: 1 kind: KIND_CPU } ]").replace(
        "oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 20000 }", "direct { }"))
    (root / "seen" / "1").mkdir(parents=True)
    (root / "seen" / "1" / "model.py").write_text(SEEN)
    (root / "seen" / "config.pbtxt").write_text(SEEN_CONFIG)
    (root / "shows" / "config.pbtxt").write_text(SHOWS)
    (root / "sums" / "1").mkdir(parents=True)
    (root / "sums" / "1" / "model.py").write_text(SUMS)
    (root / "sums" / "config.pbtxt").write_text(SUMS_CONFIG)
    (root / "keyed" / "1").mkdir(parents=True)
    (root / "keyed" / "1" / "model.py").write_text(KEYED)
    (root / "keyed" / "config.pbtxt").write_text(KEYED_CONFIG)
    (root / "unkeyed" / "1").mkdir(parents=True)  # the same model without sequence batching
    (root / "unkeyed" / "1" / "model.py").write_text(KEYED)
    (root / "unkeyed" / "config.pbtxt").write_text(
        KEYED_CONFIG.replace('name: "keyed"', 'name: "unkeyed"').replace("sequence_batching { }", ""))
    (root / "calls" / "1").mkdir(parents=True)
    (root / "calls" / "1" / "model.py").write_text(CALLS)
    (root / "calls" / "config.pbtxt").write_text(CALLS_CONFIG)
    build_acc(root / "acc" / "1" / "model.onnx")
    (root / "acc" / "config.pbtxt").write_text(ACC)
    (root / "acc" / "initial_state").mkdir()
    (root / "acc" / "initial_state" / "ten").write_bytes(np.array([10.0], np.float32).tobytes())
    (root / "pacc" / "1").mkdir(parents=True)
    (root / "pacc" / "1" / "model.py").write_text(PACC)
    (root / "pacc" / "config.pbtxt").write_text(PACC_CONFIG)
    (root / "drives" / "1").mkdir(parents=True)
    (root / "drives" / "1" / "model.py").write_text(DRIVES)
    (root / "drives" / "config.pbtxt").write_text(CALLS_CONFIG.replace('name: "calls"', 'name: "drives"'))
    build_acc(root / "acc0" / "1" / "model.onnx", batched=False)
    (root / "acc0" / "config.pbtxt").write_text(ACC0)
    (root / "chain").mkdir()
    (root / "chain" / "config.pbtxt").write_text(CHAIN)
    return root


def infer(server: Server, model: str, x: float, client: httpx.Client | None = None, **parameters: Any
          ) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}],
            "parameters": parameters}
    return (client or httpx).post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)


def out(r: httpx.Response, name: str) -> float:
    assert r.status_code == 200, r.text
    return next(o for o in r.json()["outputs"] if o["name"] == name)["data"][0]


def test_the_model_gets_each_requests_control_inputs(server: Server) -> None:
    assert out(infer(server, "shows", 1.0, sequence_id=42, sequence_start=True), "y") == 102.0  # 1+100+1
    r = infer(server, "shows", 2.0, sequence_id=42)
    assert out(r, "y") == 3.0 and out(r, "corr") == 42
    assert out(infer(server, "shows", 3.0, sequence_id=42, sequence_end=True), "y") == 14.0  # 3+10+1
    # ended: the next request must start a sequence again
    r = infer(server, "shows", 1.0, sequence_id=42)
    assert r.status_code == 400 and "START" in r.json()["error"], r.text
    assert out(infer(server, "shows", 1.0, sequence_id=42, sequence_start=True, sequence_end=True), "y") == 112


def test_a_python_model_reads_the_correlation_id_and_the_flags(server: Server) -> None:
    with httpx.Client() as client:
        got = [infer(server, "keyed", x, client, sequence_id=corr, sequence_start=start, sequence_end=end)
               for x, corr, start, end in ((1.0, "alpha", True, False), (5.0, 77, True, False),
                                           (2.0, "alpha", False, False), (3.0, "alpha", False, True),
                                           (4.0, 77, False, True))]
    assert [(out(r, "sum"), out(r, "flags"), out(r, "key")) for r in got] == \
        [(1.0, 1, "alpha"), (5.0, 1, "77"), (3.0, 0, "alpha"), (6.0, 2, "alpha"), (9.0, 2, "77")]


def test_direct_fills_the_empty_rows_below_a_sequences_row_as_triton_does(server: Server) -> None:
    """Direct: a sequence keeps one row of its instance's batches; a batch runs up to the highest row
    with a request, and the rows below without one hold a request that is not READY, CORRID 0, flags 0,
    as Triton's (seen there: a Python model gets a request per such row). The model's answers for
    those go nowhere."""
    def seen(corr: int, **flags: bool) -> list[list[int]]:
        return json.loads(out(infer(server, "seen", 1.0, sequence_id=corr, **flags), "seen"))

    assert seen(61, sequence_start=True) == [[61, 1, 61, 1]]  # row 0
    assert seen(62, sequence_start=True) == [[0, 0, 0, 0], [62, 1, 62, 1]]  # row 1: row 0 not READY
    assert seen(62) == [[0, 0, 0, 0], [62, 1, 62, 0]]
    assert seen(61, sequence_end=True) == [[61, 1, 61, 2]]
    assert seen(63, sequence_start=True) == [[63, 1, 63, 1]]  # 61's row, free again
    assert seen(62, sequence_end=True) == [[0, 0, 0, 0], [62, 1, 62, 2]]
    assert seen(63, sequence_end=True) == [[63, 1, 63, 2]]
    # an ONNX model's batch of two rows, the first a null one: the answer is the second row's
    assert out(infer(server, "dshows", 1.0, sequence_id=64, sequence_start=True), "y") == 102.0
    r = infer(server, "dshows", 1.0, sequence_id=65, sequence_start=True, sequence_end=True)
    assert (out(r, "y"), out(r, "corr")) == (112.0, 65)
    assert out(infer(server, "dshows", 1.0, sequence_id=64, sequence_end=True), "y") == 12.0


def test_a_python_model_without_sequence_batching_still_reads_the_requests_sequence(server: Server) -> None:
    """Triton hands a request's sequence_id and flags to every model (request.correlation_id() and
    .flags() of a Python model read them), not only to those with sequence_batching; an ID it cannot
    read is an error there too (Triton's is a 500, ours a 400)."""
    got = [infer(server, "unkeyed", x, sequence_id=corr, sequence_start=True, sequence_end=end)
           for x, corr, end in ((1.0, 7, True), (2.0, "abc", False))]
    assert [(out(r, "sum"), out(r, "flags"), out(r, "key")) for r in got] == [(1.0, 3, "7"), (2.0, 1, "abc")]
    # an ID of 0, or none, with flags: Triton hands on the flags, and the ID 0
    got = [infer(server, "unkeyed", 4.0, sequence_start=True, sequence_end=True, **more)
           for more in ({"sequence_id": 0}, {})]
    assert [(out(r, "sum"), out(r, "flags"), out(r, "key")) for r in got] == [(4.0, 3, "0")] * 2
    r = infer(server, "unkeyed", 1.0, sequence_id=-1)
    assert r.status_code == 400 and "sequence_id" in r.json()["error"], r.text


def test_requests_without_a_sequence_or_of_one_never_started_are_refused(server: Server) -> None:
    for params in ({}, {"sequence_id": 0}, {"sequence_id": ""}, {"sequence_start": True}):
        r = infer(server, "shows", 1.0, **params)
        assert r.status_code == 400 and "correlation ID" in r.json()["error"], (params, r.text)
    r = infer(server, "shows", 1.0, sequence_id=7)
    assert r.status_code == 400 and "sequence 7" in r.json()["error"] and "START" in r.json()["error"]
    for bad in ({"sequence_id": -3}, {"sequence_id": 2**64}, {"sequence_id": 5, "sequence_start": "yes"}):
        r = infer(server, "shows", 1.0, **bad)
        assert r.status_code == 400, (bad, r.text)
    # a string ID where the model's CORRID control is a number
    r = infer(server, "shows", 1.0, sequence_id="abc", sequence_start=True)
    assert r.status_code == 400 and "CORRID" in r.json()["error"], r.text


def test_a_request_of_several_rows_is_refused_as_triton_refuses_it(server: Server) -> None:
    """A row of a batch is one sequence's request: two rows would make two rows of state, and the next
    request of one row would get both back."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 1], "data": [1.0, 2.0]}],
            "parameters": {"sequence_id": 301, "sequence_start": True}}
    r = httpx.post(f"{server.url}/v2/models/acc/infer", json=body, timeout=30)
    assert r.status_code == 400 and "batch-size 1" in r.json()["error"], r.text
    r = infer(server, "acc", 1.0, sequence_id=301)  # and it started no sequence
    assert r.status_code == 400 and "START" in r.json()["error"], r.text


def test_implicit_state_carries_each_sequences_state_to_its_next_request(server: Server) -> None:
    """Eight sequences at once on each model: each running sum is right only if every request got its
    own sequence's state, batched with the others' (the ONNX model) or one by one (the Python one)."""
    def run(model: str, corr: int) -> list[float]:
        got = []
        with httpx.Client() as client:
            for i in range(5):
                r = infer(server, model, float(corr), client, sequence_id=corr, sequence_start=i in (0, 3),
                          sequence_end=i == 4)
                got.append(out(r, "y"))
                assert [o["name"] for o in r.json()["outputs"]] == ["y"]  # the state stays inside
        return got

    for model, initial in (("acc", 10.0), ("pacc", 0.0)):
        before = httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"][0]
        with ThreadPoolExecutor(8) as pool:
            results = dict(zip(range(1, 9), pool.map(run, [model] * 8, range(1, 9))))
        for corr, got in results.items():  # a START (requests 0 and 3) begins again from the initial state
            assert got == [initial + corr, initial + 2 * corr, initial + 3 * corr, initial + corr,
                           initial + 2 * corr], (model, corr, got)
        after = httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"][0]
        if model == "acc":
            assert after["execution_count"] - before["execution_count"] < 40  # sequences shared batches


def test_a_stateful_model_without_a_batch_dimension(server: Server) -> None:
    with httpx.Client() as client:
        got = []
        for i in range(3):
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [2.0]}],
                    "parameters": {"sequence_id": 31, "sequence_start": i == 0, "sequence_end": i == 2}}
            r = client.post(f"{server.url}/v2/models/acc0/infer", json=body, timeout=30)
            assert r.status_code == 200, r.text
            got.append(next(o for o in r.json()["outputs"] if o["name"] == "y"))
    assert [(o["shape"], o["data"]) for o in got] == [([1], [2.0]), ([1], [4.0]), ([1], [6.0])]


def test_a_sequence_with_no_free_slot_waits_for_one(server: Server) -> None:
    """acc0 has one instance and Direct's one slot (max_batch_size 0): a second sequence waits, its
    requests queued, until the first ends; then it runs from its own initial state."""
    def send(client: httpx.Client, corr: int, x: float, **flags: bool) -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [x]}],
                "parameters": {"sequence_id": corr, **flags}}
        return client.post(f"{server.url}/v2/models/acc0/infer", json=body, timeout=30)

    with httpx.Client() as first, httpx.Client() as second, ThreadPoolExecutor(1) as pool:
        assert send(first, 41, 1.0, sequence_start=True).status_code == 200
        waiting = pool.submit(send, second, 42, 5.0, sequence_start=True)
        time.sleep(0.4)
        assert not waiting.done()  # no slot: sequence 41 holds it
        r = send(first, 41, 1.0, sequence_end=True)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0]
        r = waiting.result(timeout=10)
        assert r.status_code == 200 and next(o for o in r.json()["outputs"] if o["name"] == "y")["data"] == [5.0]
        assert send(second, 42, 1.0, sequence_end=True).json()["outputs"][0]["data"] == [6.0]


def test_a_sequence_waiting_for_a_slot_past_its_requests_timeout_is_refused(server: Server) -> None:
    """As Triton's backlog: a sequence that waits for a slot longer than a request's `timeout` is
    refused, as Triton refuses it (UNAVAILABLE, 503, "timeout of the corresponding sequence has been
    expired"), and is then unknown (its next request must start it again)."""
    def send(client: httpx.Client, corr: int, x: float, **parameters: Any) -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [x]}],
                "parameters": {"sequence_id": corr, **parameters}}
        return client.post(f"{server.url}/v2/models/acc0/infer", json=body, timeout=30)

    with httpx.Client() as first, httpx.Client() as second:
        assert send(first, 51, 1.0, sequence_start=True).status_code == 200  # holds acc0's one slot
        began = time.monotonic()
        r = send(second, 52, 5.0, sequence_start=True, timeout=100_000)  # 100 ms
        assert r.status_code == 503, r.text
        assert r.json()["error"].startswith("model 'acc0': timeout of the corresponding sequence has been "
                                            "expired (") and "sequence slot" in r.json()["error"], r.text
        assert time.monotonic() - began < 0.8  # not when sequence 51 idles out (1 s) and frees the slot
        r = send(second, 52, 1.0)
        assert r.status_code == 400 and "START" in r.json()["error"], r.text
        assert send(first, 51, 1.0, sequence_end=True).json()["outputs"][0]["data"] == [2.0]


def test_a_call_without_a_sequence_gets_a_clear_error(server: Server) -> None:
    r = infer(server, "calls", 1.0)
    assert r.status_code != 200 and "correlation ID" in r.json()["error"], r.text


def run_chain(url: str, corr: int) -> list[float]:
    got = []
    with httpx.Client() as client:
        for i in range(3):
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
                    "parameters": {"sequence_id": corr, "sequence_start": i == 0, "sequence_end": i == 2}}
            r = client.post(f"{url}/v2/models/chain/infer", json=body, timeout=30)
            assert r.status_code == 200, r.text
            got.append(r.json()["outputs"][0]["data"][0])
    return got


def test_an_ensembles_sequence_reaches_the_stateful_models_it_calls(server: Server, serve,
                                                                    repository: Path) -> None:
    # acc: 10 + 1, + 1, + 1 = 11, 12, 13; pacc sums those: 11, 23, 36
    assert run_chain(server.url, 777) == [11.0, 23.0, 36.0]  # the worker runs the ensemble
    r = httpx.post(f"{server.url}/v2/models/chain/infer", timeout=30,
                   json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]})
    assert r.status_code == 400 and "correlation ID" in r.json()["error"], r.text
    # and where the gateway runs it, step by step
    gateway_runs = serve(repository, env={"DESPINA_HOST_ENSEMBLES": "false"}, wait_models=("chain",))
    assert run_chain(gateway_runs.url, 778) == [11.0, 23.0, 36.0]


def test_fn_refuses_an_ensemble_with_a_stateful_step_with_where_to_call_it(server: Server) -> None:
    # /fn names no sequence: its request reached the worker's step, which answered that "an ensemble's
    # step ... of a stateful model cannot yet", though a V2 request with 'sequence_id' runs it
    r = httpx.post(f"{server.url}/fn/chain", content=b"[1.0]", timeout=30)
    assert r.status_code == 400
    assert r.json()["error"] == ("ensemble 'chain' calls model 'acc', which is stateful (sequence batching): "
                                 "call it through /v2/models/chain/infer or .../generate with the parameter "
                                 "'sequence_id'"), r.text
    assert httpx.post(f"{server.url}/fn/shows", content=b"[1.0]", timeout=30).status_code == 400


def catalog_model(text: str) -> Model:
    name = text.split('"')[1]  # (the configs begin with their name)
    config = to_dict(normalize(name, parse_text(name, text)))
    ensemble = Ensemble.from_config(config) if is_ensemble(config) else None
    return Model(CatalogEntry(config["name"], "", config, (1,)), ModelSpec.from_config(config), ensemble)


def test_fn_finds_a_stateful_model_in_an_ensemble_an_ensemble_calls() -> None:
    outer = CHAIN.replace('name: "chain"', 'name: "outer"').replace('"acc"', '"chain"').replace(
        'key: "y" value: "y1"', 'key: "z" value: "y1"')
    models = {m.spec.name: m for m in map(catalog_model, (CHAIN, outer, ACC))}
    with pytest.raises(InvalidArgument, match="ensemble 'outer' calls model 'acc', which is stateful"):
        refuse_stateful(models, models["outer"])
    del models["acc"]  # not in the catalog (or not READY): nothing is known of it, the worker will say
    refuse_stateful(models, models["outer"])


def test_a_stateful_step_without_a_sequence_is_told_how_to_name_one(server: Server) -> None:
    # an ensemble's V2 request without 'sequence_id', and a model's call without correlation_id: the
    # stateful model's refusal says how each names a sequence, not that neither can
    for r in (infer(server, "chain", 1.0), infer(server, "calls", 1.0)):
        error = r.json()["error"]
        assert r.status_code == 400 and "correlation ID" in error, r.text
        assert "cannot yet" not in error and "'sequence_id'" in error and "correlation_id" in error, error


def test_a_model_drives_a_sequence_through_its_calls(server: Server) -> None:
    # correlation_id and flags of pb_utils.InferenceRequest reach the called model: 10 + 2 + 2 + 2
    assert out(infer(server, "drives", 2.0), "y") == 16.0
    assert out(infer(server, "drives", 1.0), "y") == 13.0  # ended: the next START begins from 10 again


def test_a_sequence_idle_past_its_limit_is_released(server: Server) -> None:
    assert infer(server, "shows", 1.0, sequence_id=99, sequence_start=True).status_code == 200
    time.sleep(1.2)  # max_sequence_idle_microseconds: 500 ms
    r = infer(server, "shows", 1.0, sequence_id=99)
    assert r.status_code == 400 and "START" in r.json()["error"]


def test_many_sequences_at_once_keep_their_order_and_their_instance(server: Server) -> None:
    """Twelve sequences of six requests, each sent as soon as the one before is answered, all at once:
    each running sum is right only if every request ran in order on the instance that holds its sum."""
    def run(corr: int) -> list[float]:
        sums = []
        with httpx.Client() as client:  # one connection each, as a streaming client keeps
            for i in range(6):
                r = infer(server, "sums", float(corr * 10 + i), client, sequence_id=corr,
                          sequence_start=i == 0, sequence_end=i == 5)
                sums.append(out(r, "sum"))
        return sums

    with ThreadPoolExecutor(12) as pool:
        got = dict(zip(range(1, 13), pool.map(run, range(1, 13))))
    for corr, sums in got.items():
        values = [corr * 10 + i for i in range(6)]
        assert sums == [float(sum(values[:i + 1])) for i in range(6)], (corr, sums)
    # and an ONNX model's requests of several sequences share batches
    def shows(corr: int) -> None:
        with httpx.Client() as client:
            for i in range(4):
                out(infer(server, "shows", 1.0, client, sequence_id=1000 + corr, sequence_start=i == 0,
                          sequence_end=i == 3), "y")

    before = httpx.get(f"{server.url}/v2/models/shows/stats").json()["model_stats"][0]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(shows, range(8)))
    after = httpx.get(f"{server.url}/v2/models/shows/stats").json()["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 32
    assert after["execution_count"] - before["execution_count"] < 32


def spec(sequence: str, extra: str = "") -> ModelSpec:
    config = normalize("m", parse_text("m", f'name: "m"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'
                                            f'input [{{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }}]\n'
                                            f'{extra}sequence_batching {{ {sequence} }}\n'))
    validate(config)
    return ModelSpec.from_config(to_dict(config))


def test_sequence_batching_configs_are_checked_at_load() -> None:
    s = spec(CONTROLS + "oldest { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 50 }")
    assert s.sequence is not None and s.sequence.oldest and s.sequence.preferred == (2,)
    assert s.sequence.idle_us == 1_000_000 and [c.kind for c in s.sequence.controls] == \
        ["START", "END", "READY", "CORRID"]
    assert s.sequence.slots == 4  # Oldest without max_candidate_sequences: a slot per row, as Triton's
    assert spec("direct { }").sequence.slots == 4  # Direct: a slot per row of a batch
    assert spec("oldest { max_candidate_sequences: 3 }").sequence.slots == 3
    assert spec("").sequence.controls == ()  # no controls: the model keys nothing, fine
    states = spec('state [ { input_name: "S" output_name: "T" data_type: TYPE_INT32 dims: [ -1, 2 ] } ]')
    assert [(st.input, st.output, st.datatype, st.dims) for st in states.sequence.states] == \
        [("S", "T", "INT32", (-1, 2))]
    for bad, why in (
            ('state [ { input_name: "S" data_type: TYPE_FP32 dims: [ 1 ] } ]', "output_name"),
            ('state [ { input_name: "x" output_name: "T" data_type: TYPE_FP32 dims: [ 1 ] } ]', "named twice"),
            ('state [ { input_name: "S" output_name: "T" data_type: TYPE_FP32 dims: [ 1 ] '
             'initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ]', "data_type"),
            ('state [ { input_name: "S" output_name: "T" data_type: TYPE_FP32 dims: [ 1 ] '
             'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "../x" } } ]', "initial_state/"),
            ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]', "exactly one of"),
            ('control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]',
             "CORRID"),
            ('control_input [ { name: "x" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] } ]',
             "named twice"),
            ("oldest { preferred_batch_size: [ 9 ] }", "preferred_batch_size")):
        with pytest.raises(ConfigError, match=why):
            spec(bad)


def test_request_records_carry_the_sequence_and_older_ones_still_decode() -> None:
    from despina.contract import records
    from despina.contract.errors import InvalidArgument
    from despina.contract.records import InferRequest

    req = InferRequest("1", "r", 1.0, (), sequence=(42, 3))
    assert records.decode_requests(records.encode([req]))[0].sequence == (42, 3)
    named = InferRequest("1", "r", 1.0, (), sequence=("abc", 1))
    assert records.decode_requests(records.encode([named]))[0].sequence == ("abc", 1)
    plain = records.decode_requests(records.encode([InferRequest("1", "r", 1.0, ())]))[0]
    assert plain.sequence is None
    for bad in ([1.5, 1], ["a", 9], ["a"]):
        raw = req.pack()
        raw[11] = bad
        with pytest.raises(InvalidArgument):
            InferRequest.unpack(raw)


def test_a_correlation_id_wider_than_its_corrid_control_gets_its_low_bytes_as_in_triton() -> None:
    """Triton copies the ID's low bytes into a narrower CORRID control; a number that did not fit its
    datatype raised here, outside the request, and the model's reader stopped: every request hung."""
    from despina.contract.sequence import START
    from despina.workers.sequences import control_tensors

    for datatype, correlation, value in (("TYPE_UINT32", 2**40 + 5, 5), ("TYPE_INT32", 2**32 - 1, -1),
                                         ("TYPE_INT64", 2**64 - 1, -1), ("TYPE_UINT64", 2**64 - 1, 2**64 - 1)):
        policy = spec(f'control_input [ {{ name: "C" control [ {{ kind: CONTROL_SEQUENCE_CORRID '
                      f'data_type: {datatype} }} ] }} ]').sequence
        got = control_tensors(policy, True, 1, correlation, START)["C"]
        assert got.shape == (1, 1) and got[0, 0] == value, (datatype, got)


def test_an_initial_state_file_longer_than_the_state_is_read_as_far_as_it_goes(tmp_path: Path) -> None:
    """Triton reads an initial_state data_file as far as the state needs and refuses only a short one; a
    repository whose file has more (a trailing newline, say) loads there, so it must here."""
    from despina.contract.sequence import State
    from despina.workers.sequences import initial_state

    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "long").write_bytes(np.array([1, 2, 3], np.int32).tobytes() + b"\n")
    (tmp_path / "initial_state" / "short").write_bytes(np.array([1, 2], np.int32).tobytes())
    state = State("S", "T", "INT32", (3,), (3,), "long")
    assert initial_state("m", state, tmp_path).tolist() == [1, 2, 3]
    with pytest.raises(ConfigError, match="holds 8 bytes"):
        initial_state("m", State("S", "T", "INT32", (3,), (3,), "short"), tmp_path)


def test_a_sequence_waiting_for_a_slot_is_refused_when_its_timer_fires_early() -> None:
    """uvloop's timers count whole milliseconds and fire up to one early: a waiting sequence whose timer
    fired before the clock reached its timeout was left waiting, and ran once another sequence idled
    out a second later (test_a_sequence_waiting_for_a_slot_past_its_requests_timeout_is_refused failed
    so about one time in ten). Here every timer fires 2 ms early."""
    from types import SimpleNamespace

    from despina.contract.sequence import START
    from despina.workers.batcher import Item
    from despina.workers.sequences import SLOT_TIMED_OUT, SequenceBatcher

    refused: list[tuple[int, str]] = []

    async def execute(batch: list[Item], instance: int) -> None:
        return None

    def item(correlation: int, timeout_us: int = 0) -> Item:
        request = SimpleNamespace(sequence=(correlation, START))
        return Item(1, (), SimpleNamespace(request=request, inputs={}), timeout_us=timeout_us)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        on_time = loop.call_later
        loop.call_later = lambda delay, *args: on_time(max(0.0, delay - 0.002), *args)  # type: ignore[method-assign]
        batcher = SequenceBatcher(spec("oldest { max_candidate_sequences: 1 }"), execute, 1,
                                  lambda it, why: refused.append((it.payload.request.sequence[0], why)))
        running = asyncio.create_task(batcher.run())
        batcher.put(item(1))  # takes the one slot, and keeps it (idles out after 1 s)
        batcher.put(item(2, timeout_us=50_000))
        await asyncio.sleep(0.3)
        batcher.close()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())
    assert refused == [(2, SLOT_TIMED_OUT)]


def test_a_request_past_its_sequences_idle_limit_finds_it_ended_though_the_reaper_has_not_come() -> None:
    """The reaper looked every quarter of max_sequence_idle_microseconds (here 0.25 s of 1 s): a request
    1.1 s after its sequence's last one was taken into the sequence when the reaper's last look came
    before the limit (put() now asks itself; the reaper, since, also wakes when a sequence is due) (by hand, with a limit of 0.3 s, a request 0.33 s after the last: 1 in 8) (Triton's reaper wakes at the limit itself: a request past it is always refused)."""
    from types import SimpleNamespace

    from despina.contract.sequence import START
    from despina.workers.batcher import Item
    from despina.workers.sequences import SequenceBatcher

    ran: list[int] = []

    async def execute(batch: list[Item], instance: int) -> None:
        ran.extend(item.payload.request.sequence[1] for item in batch)

    def item(flags: int) -> Item:
        return Item(1, (), SimpleNamespace(request=SimpleNamespace(sequence=(7, flags)), inputs={}))

    async def main() -> None:
        batcher = SequenceBatcher(spec("oldest { }"), execute, 1, lambda it, why: None)
        running = asyncio.create_task(batcher.run())  # its reaper looked at 0.25, 0.5, 0.75, 1.0, 1.25 s
        await asyncio.sleep(0.1)
        batcher.put(item(START))  # runs at once: the reaper's look at 1.0 s comes 0.9 s after it
        await asyncio.sleep(1.1)
        try:
            with pytest.raises(InvalidArgument, match="must specify the START flag"):
                batcher.put(item(0))
        finally:
            batcher.close()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())
    assert ran == [START]


def test_a_sequence_waiting_for_a_slot_gets_it_when_the_one_there_idles_out_not_at_the_reapers_next_look() -> None:
    """Triton's reaper wakes when the earliest idle sequence is due; Despina's looked every quarter of the
    limit (here 0.5 s of 2 s), so a sequence waiting for the slot of one that idled out 0.1 s after a
    look waited 0.4 s more (by hand, a backlog sequence ran at 3.2 s where it was due at 3.0 s)."""
    from types import SimpleNamespace

    from despina.contract.sequence import START
    from despina.workers.batcher import Item
    from despina.workers.sequences import SequenceBatcher

    ran: dict[int, float] = {}

    async def execute(batch: list[Item], instance: int) -> None:
        for item in batch:
            ran[item.payload.request.sequence[0]] = time.monotonic()

    def item(correlation: int) -> Item:
        return Item(1, (), SimpleNamespace(request=SimpleNamespace(sequence=(correlation, START)), inputs={}))

    async def main() -> None:
        batcher = SequenceBatcher(spec("max_sequence_idle_microseconds: 2000000 "
                                       "oldest { max_candidate_sequences: 1 }"), execute, 1, lambda it, why: None)
        running = asyncio.create_task(batcher.run())  # its reaper looked at 0.5, 1.0, ... 2.0, 2.5 s
        await asyncio.sleep(0.1)
        batcher.put(item(1))  # takes the one slot; idle from 0.1 s, due at 2.1 s
        batcher.put(item(2))  # waits for it
        await asyncio.sleep(2.6)
        batcher.close()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())
    assert 1.95 <= ran[2] - ran[1] < 2.25, ran
