"""Triton's ragged batching (workers/ragged.py): inputs with allow_ragged_batch batch whatever their shapes
and reach the model flat, end to end; batch inputs tell the model where each request's part lies; batch
outputs are cut back by the requests' shapes. The pieces alone, the config's checks, and a real `despina
serve` of an ONNX model that sums each request's part of a ragged input."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from onnx import TensorProto, helper

from despina.contract.errors import BackendError, ConfigError, InvalidArgument
from despina.contract.modelconfig import normalize, parse_text, to_dict, validate
from despina.contract.modelspec import ModelSpec
from despina.examples import save_onnx
from despina.workers.ragged import BatchIO, scatter

from .conftest import FULL_QUEUE_DELAY, Server, module_server, settled_stats

# The model: x is ragged (each request [1, n], given flat); from the batch inputs it returns each request's
# sum, its element count, its running total, the batch's largest count and each row's item shape, and x
# doubled as a batch output (each request gets [1, n] back)
RAGGED = """
name: "ragged"
backend: "onnxruntime"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 2000000 }
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
batch_input [
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "starts" data_type: TYPE_INT32 source_input: "x" },
  { kind: BATCH_ELEMENT_COUNT target_name: "count" data_type: TYPE_FP32 source_input: "x" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ends" data_type: TYPE_INT32 source_input: "x" },
  { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "longest" data_type: TYPE_FP32 source_input: "x" },
  { kind: BATCH_ITEM_SHAPE target_name: "item" data_type: TYPE_INT32 source_input: "x" }
]
output [
  { name: "sum" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "n" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "end" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "max" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "shape" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "doubled" data_type: TYPE_FP32 dims: [ -1 ] }
]
batch_output [ { target_name: "doubled" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "x" } ]
model_warmup [ { name: "one" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]
"""


def build_ragged(path: Path) -> None:
    def const(name: str, values: list[int]) -> TensorProto:
        return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)

    nodes = [
        # each request's sum: the prefix sums of x, with a 0 in front, read at the requests' starts
        helper.make_node("Constant", [], ["axis0"], value=helper.make_tensor("a", TensorProto.INT64, [], [0])),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("CumSum", ["x", "axis0"], ["prefix"]),
        helper.make_node("Concat", ["zero", "prefix"], ["prefix0"], axis=0),
        helper.make_node("Gather", ["prefix0", "starts"], ["at"], axis=0),
        helper.make_node("Constant", [], ["one"], value=const("one", [1])),
        helper.make_node("Constant", [], ["minus1"], value=const("m1", [-1])),
        helper.make_node("Constant", [], ["zero_i"], value=const("z0", [0])),
        helper.make_node("Constant", [], ["big"], value=const("big", [1 << 30])),
        helper.make_node("Slice", ["at", "one", "big"], ["upper"]),
        helper.make_node("Slice", ["at", "zero_i", "minus1"], ["lower"]),
        helper.make_node("Sub", ["upper", "lower"], ["sums"]),
        helper.make_node("Unsqueeze", ["sums", "one"], ["sum"]),
        helper.make_node("Unsqueeze", ["count", "one"], ["n"]),
        helper.make_node("Unsqueeze", ["ends", "one"], ["end"]),
        # the largest count: longest's length, one per request
        helper.make_node("Shape", ["longest"], ["longest_shape"]),
        helper.make_node("Shape", ["count"], ["requests"]),
        helper.make_node("Concat", ["requests", "one"], ["rows_by_1"], axis=0),
        helper.make_node("Unsqueeze", ["longest_shape", "zero_i"], ["longest_2d"]),
        helper.make_node("Expand", ["longest_2d", "rows_by_1"], ["max"]),
        helper.make_node("Identity", ["item"], ["shape"]),
        helper.make_node("Add", ["x", "x"], ["doubled"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"]),
              helper.make_tensor_value_info("starts", TensorProto.INT32, ["B1"]),
              helper.make_tensor_value_info("count", TensorProto.FLOAT, ["B"]),
              helper.make_tensor_value_info("ends", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("longest", TensorProto.FLOAT, ["L"]),
              helper.make_tensor_value_info("item", TensorProto.INT32, ["B", 1])]
    outputs = [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["B", 1]),
               helper.make_tensor_value_info("n", TensorProto.FLOAT, ["B", 1]),
               helper.make_tensor_value_info("end", TensorProto.INT32, ["B", 1]),
               helper.make_tensor_value_info("max", TensorProto.INT64, ["B", 1]),
               helper.make_tensor_value_info("shape", TensorProto.INT32, ["B", 1]),
               helper.make_tensor_value_info("doubled", TensorProto.FLOAT, ["N"])]
    graph = helper.make_graph(nodes, "ragged", inputs, outputs)
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path / "1" / "model.onnx")
    (path / "config.pbtxt").write_text(RAGGED)


def spec_of(text: str) -> ModelSpec:
    config = normalize("m", parse_text("m", text))
    validate(config)
    return ModelSpec.from_config(to_dict(config))


# -- the pieces ------------------------------------------------------------------------------------

BATCH_INPUTS = """
name: "m"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, -1 ] allow_ragged_batch: true },
        { name: "w" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
batch_input [
  { kind: BATCH_ELEMENT_COUNT target_name: "count" data_type: TYPE_INT32 source_input: "x" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: [ "ends", "ends_too" ] data_type: TYPE_INT32 source_input: "x" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "starts" data_type: TYPE_FP32 source_input: "x" },
  { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "longest" data_type: TYPE_INT32 source_input: "x" },
  { kind: BATCH_ITEM_SHAPE target_name: "item" data_type: TYPE_INT32 source_input: "x" },
  { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: "item_flat" data_type: TYPE_INT32 source_input: "x" }
]
batch_output [ { target_name: "y" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "x" } ]
"""


def test_a_batch_is_the_ragged_inputs_end_to_end_and_the_batch_inputs_triton_makes() -> None:
    io = BatchIO.of(spec_of(BATCH_INPUTS))
    assert io is not None
    # a batch-2 request of [3, 1] and a batch-1 request of [2, 2], as in Triton's BATCH_ITEM_SHAPE example
    first = {"x": np.arange(6, dtype=np.float32).reshape(2, 3, 1), "w": np.ones((2, 2), np.float32)}
    second = {"x": np.arange(4, dtype=np.float32).reshape(1, 2, 2) + 10, "w": np.zeros((1, 2), np.float32)}
    batch = io.assemble([first, second])
    np.testing.assert_array_equal(batch["x"], [0, 1, 2, 3, 4, 5, 10, 11, 12, 13])  # flat, end to end
    np.testing.assert_array_equal(batch["w"], [[1, 1], [1, 1], [0, 0]])            # by rows, as always
    assert batch["count"].dtype == np.int32 and batch["count"].tolist() == [6, 4]
    assert batch["ends"].tolist() == [6, 10] and batch["ends_too"] is batch["ends"]
    assert batch["starts"].dtype == np.float32 and batch["starts"].tolist() == [0, 6, 10]
    assert batch["longest"].shape == (6,)
    assert batch["item"].tolist() == [[3, 1], [3, 1], [2, 2]]
    assert batch["item_flat"].tolist() == [3, 1, 3, 1, 2, 2]
    # the batch output: each request's part has its own input's shape
    shapes = io.shapes([first, second])
    assert shapes == {"y": [(2, 3, 1), (1, 2, 2)]}
    parts = scatter("m", "y", batch["x"] * 2, shapes["y"])
    np.testing.assert_array_equal(parts[0], first["x"] * 2)
    np.testing.assert_array_equal(parts[1], second["x"] * 2)


def test_a_single_request_reaches_the_model_flat_too() -> None:
    io = BatchIO.of(spec_of(BATCH_INPUTS))
    assert io is not None
    alone = io.assemble([{"x": np.ones((1, 2, 3), np.float32), "w": np.ones((1, 2), np.float32)}])
    assert alone["x"].shape == (6,) and alone["w"].shape == (1, 2)
    assert alone["starts"].tolist() == [0, 6] and alone["item"].tolist() == [[2, 3]]


def test_a_batch_output_of_the_wrong_size_is_the_models_error() -> None:
    with pytest.raises(BackendError, match="returned y with 5 elements.*need 6"):
        scatter("m", "y", np.zeros(5, np.float32), [(1, 2), (1, 4)])


def test_a_model_without_ragged_inputs_or_batch_io_takes_the_usual_path() -> None:
    plain = spec_of('backend: "onnxruntime" max_batch_size: 4 input [{ name: "x" data_type: TYPE_FP32 dims: [ 2 ] }] '
                    'output [{ name: "y" data_type: TYPE_FP32 dims: [ 2 ] }]')
    assert BatchIO.of(plain) is None


def test_a_missing_source_input_is_the_requests_error() -> None:
    spec = spec_of(BATCH_INPUTS.replace('dims: [ -1, -1 ] allow_ragged_batch: true }',
                                        'dims: [ -1, -1 ] allow_ragged_batch: true optional: true }'))
    io = BatchIO.of(spec)
    assert io is not None
    with pytest.raises(InvalidArgument, match="made from input 'x', which the request does not give"):
        io.assemble([{"w": np.ones((1, 2), np.float32)}])


# -- the config's checks ---------------------------------------------------------------------------

BASE = """
name: "m"
backend: "{backend}"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true {reshape} }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{extra}
"""


@pytest.mark.parametrize(("extra", "message"), [
    ('batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 source_input: [ "x", "x" ] }]',
     "BATCH_ELEMENT_COUNT: expects 1 source input, got 2"),
    ('batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 source_input: "z" }]',
     "unknown source input name 'z'"),
    ('batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_FP64 source_input: "x" }]',
     "'data_type' must be TYPE_INT32 or TYPE_FP32, got TYPE_FP64"),
    ('batch_input [{ kind: BATCH_ELEMENT_COUNT data_type: TYPE_INT32 source_input: "x" }]',
     "field 'target_name' is empty"),
    ('batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "x" data_type: TYPE_INT32 source_input: "x" }]',
     "target name 'x' is one of the config's inputs"),
    ('batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 source_input: "x" },'
     '{ kind: BATCH_ITEM_SHAPE target_name: "n" data_type: TYPE_INT32 source_input: "x" }]',
     "target name 'n' is given by two batch inputs"),
    ('batch_output [{ target_name: "z" source_input: "x" }]', "unknown target output name 'z'"),
    ('batch_output [{ target_name: "y" source_input: "w" }]', "unknown source input name 'w'"),
    ('batch_output [{ target_name: [ "y", "y" ] source_input: "x" }]', "'y' can only be specified once"),
])
def test_batch_inputs_and_outputs_are_checked_as_triton_checks_them(extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec_of(BASE.format(backend="onnxruntime", reshape="", extra=extra))


@pytest.mark.parametrize(("backend", "reshape", "extra", "message"), [
    ("python", "", 'batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 '
     'source_input: "x" }]', "needs a backend that batches tensors"),
    ("onnxruntime", "reshape: { shape: [ -1, 1 ] }", "", "allow_ragged_batch with a reshape is not supported"),
    ("onnxruntime", "", "sequence_batching { }", "with sequence_batching is not supported"),
])
def test_what_despina_cannot_make_is_refused_at_load(backend: str, reshape: str, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec_of(BASE.format(backend=backend, reshape=reshape, extra=extra))


def test_a_python_model_takes_ragged_inputs_as_each_requests_own() -> None:
    spec = spec_of(BASE.format(backend="python", reshape="", extra=""))
    assert spec.inputs[0].ragged and not spec.batch_inputs


# -- served ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("ragged-repo")
    build_ragged(repo / "ragged")
    yield from module_server(repo, tmp_path_factory, redis_url, ("ragged",), env=FULL_QUEUE_DELAY)


def infer(server: Server, x: list[float], **extra: object) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, len(x)], "datatype": "FP32", "data": x}], **extra}
    return httpx.post(f"{server.url}/v2/models/ragged/infer", json=body, timeout=30)


def outputs(r: httpx.Response) -> dict[str, tuple[list[int], list]]:
    assert r.status_code == 200, r.text
    return {o["name"]: (o["shape"], o["data"]) for o in r.json()["outputs"]}


def test_requests_of_different_lengths_run_as_one_batch_and_each_gets_its_own_part(server: Server) -> None:
    before = settled_stats(server.url, "ragged")
    xs = [[1.0, 2.0, 3.0], [10.0, 20.0, 30.0, 40.0], [0.5] * 5]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = [outputs(r) for r in pool.map(lambda x: infer(server, x), xs)]
    after = settled_stats(server.url, "ragged")
    assert after["inference_count"] - before["inference_count"] == 3
    assert after["execution_count"] - before["execution_count"] == 1  # one batch, three shapes
    ends = []
    for x, reply in zip(xs, replies, strict=True):
        assert reply["sum"] == ([1, 1], [pytest.approx(sum(x))])
        assert reply["n"] == ([1, 1], [len(x)])
        assert reply["max"] == ([1, 1], [5])               # the batch's longest request
        assert reply["shape"] == ([1, 1], [len(x)])        # its row's shape past the batch dimension
        assert reply["doubled"] == ([1, len(x)], [2 * v for v in x])  # a batch output: its own shape back
        ends.append(reply["end"][1][0])
    # the running totals, in whatever order the batch took the requests: the parts lie end to end
    parts = sorted((end - len(x), end) for x, end in zip(xs, ends, strict=True))
    assert [start for start, _ in parts] == [0, *(end for _, end in parts[:-1])] and parts[-1][1] == 12


def answers_of_one_batch(server: Server, model: str, xs: list[list[float]]) -> list[list]:
    """Requests of model's ragged input x, one per list, sent at once: each one's first output, checking
    that they ran as one execution (the model batches them, FULL_QUEUE_DELAY and a preferred size)."""
    before = settled_stats(server.url, model)

    def infer(x: list[float]) -> httpx.Response:
        body = {"inputs": [{"name": "x", "shape": [1, len(x)], "datatype": "FP32", "data": x}]}
        return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)

    with concurrent.futures.ThreadPoolExecutor(len(xs)) as pool:
        replies = list(pool.map(infer, xs))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    after = settled_stats(server.url, model)
    assert after["execution_count"] - before["execution_count"] == 1  # several lengths, one batch
    return [r.json()["outputs"][0]["data"] for r in replies]


def test_a_request_alone_is_served_the_same_way(server: Server) -> None:
    reply = outputs(infer(server, [4.0, 5.0], outputs=[{"name": "sum"}, {"name": "doubled"}]))
    assert reply == {"sum": ([1, 1], [9.0]), "doubled": ([1, 2], [8.0, 10.0])}


def test_the_served_config_keeps_the_batch_inputs_and_outputs(server: Server) -> None:
    config = httpx.get(f"{server.url}/v2/models/ragged/config", timeout=10).json()
    assert config["input"][0]["allow_ragged_batch"] is True
    assert [b["target_name"] for b in config["batch_input"]] == [["starts"], ["count"], ["ends"], ["longest"],
                                                                  ["item"]]
    assert config["batch_output"][0]["kind"] == "BATCH_SCATTER_WITH_INPUT_SHAPE"
    meta = httpx.get(f"{server.url}/v2/models/ragged", timeout=10).json()
    assert [t["name"] for t in meta["inputs"]] == ["x"]  # a client gives x alone: the rest is made per batch
