"""Triton's classification extension on a real `despina serve`: an output asked for with
`classification: k` (tritonclient's class_count) comes back as its top k "value:index[:label]" strings,
labels from the output's label_filename; and the errors for what cannot be classified."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from despina.contract.errors import InvalidArgument
from despina.contract.modelconfig import normalize, parse_text, to_dict, validate
from despina.contract.modelspec import ModelSpec
from despina.contract.records import Tensor
from despina.examples import save_onnx
from despina.gateway.classification import classify
from despina.gateway.v2_fields import classification_count

from .conftest import Server, module_server

# scores: y = x (FP32, labelled), n = x as INT32 (no labels), text: a BYTES output
SCORES = """
name: "scores"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "y" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" },
  { name: "n" data_type: TYPE_INT32 dims: [ 4 ] }
]
"""
LABELS = "cat\ndog\nfish\nbird\n"


def build(root: Path) -> None:
    nodes = [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Cast", ["x"], ["n"], to=TensorProto.INT32)]
    graph = helper.make_graph(nodes, "scores", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
                               helper.make_tensor_value_info("n", TensorProto.INT32, ["N", 4])])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / "scores" / "1" / "model.onnx")
    (root / "scores" / "config.pbtxt").write_text(SCORES)
    (root / "scores" / "labels.txt").write_text(LABELS)
    # the same model naming a label file it does not have: it cannot load
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / "nolabels" / "1" / "model.onnx")
    (root / "nolabels" / "config.pbtxt").write_text(SCORES.replace('"scores"', '"nolabels"'))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("classification-repo")
    build(root)
    yield from module_server(root, tmp_path_factory, redis_url, ("scores",))


X = np.array([[0.5, 3.25, -1.0, 2.0], [4.0, 1.0, 4.0, 0.0]], dtype=np.float32)


def test_tritonclients_class_count_gets_the_top_classes_with_labels(server: Server) -> None:
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        assert "classification" in client.get_server_metadata()["extensions"]
        x = httpclient.InferInput("x", list(X.shape), "FP32")
        x.set_data_from_numpy(X)
        result = client.infer("scores", [x], outputs=[httpclient.InferRequestedOutput("y", class_count=2),
                                                      httpclient.InferRequestedOutput("n", class_count=3)])
    finally:
        client.close()
    y = result.as_numpy("y")
    assert y.shape == (2, 2)
    # highest first, six decimals as Triton's std::to_string prints a float; equal values (4.0 twice) in index order
    assert y.tolist() == [[b"3.250000:1:dog", b"2.000000:3:bird"], [b"4.000000:0:cat", b"4.000000:2:fish"]]
    assert result.as_numpy("n").tolist() == [[b"3:1", b"2:3", b"0:0"], [b"4:0", b"4:2", b"1:1"]]  # no labels


def test_json_classification_and_a_count_past_the_classes(server: Server) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": X[0].tolist()}],
            "outputs": [{"name": "y", "parameters": {"classification": 10}}, {"name": "n"}]}
    r = httpx.post(f"{server.url}/v2/models/scores/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["y"]["datatype"] == "BYTES" and out["y"]["shape"] == [1, 4]  # at most as many as there are
    assert out["y"]["data"] == ["3.250000:1:dog", "2.000000:3:bird", "0.500000:0:cat",
                                "-1.000000:2:fish"]
    assert out["n"]["datatype"] == "INT32" and out["n"]["data"] == [0, 3, -1, 2]  # not asked: the tensor


def test_a_count_of_0_answers_the_tensor_as_triton_does(server: Server) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": X[0].tolist()}],
            "outputs": [{"name": "y", "parameters": {"classification": 0}}]}
    r = httpx.post(f"{server.url}/v2/models/scores/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["datatype"] == "FP32" and r.json()["outputs"][0]["data"] == X[0].tolist()


@pytest.mark.parametrize(("count", "message"), [
    (-1, "parameter 'classification' must be a non-negative integer"),
    (True, "parameter 'classification' must be a non-negative integer"),
    ("2", "parameter 'classification' must be a non-negative integer"),
])
def test_a_bad_count_is_a_400(server: Server, count: object, message: str) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": X[0].tolist()}],
            "outputs": [{"name": "y", "parameters": {"classification": count}}]}
    r = httpx.post(f"{server.url}/v2/models/scores/infer", json=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_a_label_file_the_folder_lacks_keeps_the_model_from_loading(server: Server) -> None:
    r = httpx.get(f"{server.url}/v2/models/nolabels", timeout=10)
    assert r.status_code == 503
    assert "output 'y': label_filename 'labels.txt' is not in the model's folder" in r.json()["error"]


def test_an_output_that_is_not_numeric_cannot_be_classified() -> None:
    config = normalize("m", parse_text("m", 'backend: "python" max_batch_size: 0 '
                                            'input [{ name: "x" data_type: TYPE_FP32 dims: [ 2 ] }] '
                                            'output [{ name: "t" data_type: TYPE_STRING dims: [ 2 ] }]'))
    validate(config)
    spec = ModelSpec.from_config(to_dict(config))
    with pytest.raises(InvalidArgument, match="class result not available for output due to unsupported type 'BYTES'"):
        classification_count(spec, "t", 1)
    # a model without a batch dimension: [k]
    plain = normalize("p", parse_text("p", 'backend: "python" max_batch_size: 0 '
                                           'input [{ name: "x" data_type: TYPE_FP32 dims: [ 3 ] }] '
                                           'output [{ name: "s" data_type: TYPE_INT64 dims: [ 3 ] }]'))
    validate(plain)
    scores = Tensor("s", "INT64", (3,), np.array([7, 9, 8], np.int64).tobytes())
    (out,) = classify(ModelSpec.from_config(to_dict(plain)), [scores], {"s": 2}, {"s": ["a", "b"]})
    assert out.shape == (2,) and out.numpy().tolist() == [b"9:1:b", b"8:2"]
