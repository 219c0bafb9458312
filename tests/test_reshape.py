"""Triton's `reshape` (workers/reshape.py): clients send and get the config's dims, the model takes and
gives the reshape's shape; a real `despina serve` of ONNX models whose tensors differ from their dims."""
from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from despina.contract.errors import ConfigError, InvalidArgument
from despina.contract.modelconfig import normalize, parse_text, to_dict, validate
from despina.contract.modelspec import ModelSpec, check_shape, reshaped
from despina.examples import save_onnx
from despina.workers.reshape import Reshapes

from .conftest import Server

# `double`: x [N] -> y = 2x [N]; clients see [N, 1] both ways (Triton's scalar-per-row idiom)
DOUBLE = """
name: "double"
backend: "onnxruntime"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 }
input [{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } }]
output [{ name: "y" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } }]
model_warmup [{ name: "zeros" batch_size: 2 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } }]
"""
# `pairs`: x [N, M, 2, 2] -> y, the same; clients send and get [N, M, 4]
PAIRS = """
name: "pairs"
backend: "onnxruntime"
max_batch_size: 4
input [{ name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] reshape: { shape: [ -1, 2, 2 ] } }]
output [{ name: "y" data_type: TYPE_FP32 dims: [ -1, 4 ] reshape: { shape: [ -1, 2, 2 ] } }]
"""


def build(repo: Path, name: str, config: str, shape: list[str | int], op: str) -> None:
    nodes = [helper.make_node("Add", ["x", "x"], ["y"])] if op == "double" else \
        [helper.make_node("Identity", ["x"], ["y"])]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), repo / name / "1" / "model.onnx")
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture
def server(serve, tmp_path: Path) -> Server:
    repo = tmp_path / "repo"
    build(repo, "double", DOUBLE, ["N"], "double")
    build(repo, "pairs", PAIRS, ["N", "M", 2, 2], "identity")
    return serve(repo, wait_models=("double", "pairs"))


def infer(url: str, model: str, x: list, shape: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{model}/infer", timeout=30,
                      json={"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": x}]})


def test_clients_use_the_configs_dims_and_the_model_its_reshape(server: Server) -> None:
    r = infer(server.url, "double", [1.0, 2.5], [2, 1])
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [2, 1] and r.json()["outputs"][0]["data"] == [2.0, 5.0]
    # the metadata shows what clients send: the dims
    meta = httpx.get(f"{server.url}/v2/models/double").json()
    assert meta["inputs"][0]["shape"] == [-1, 1] and meta["outputs"][0]["shape"] == [-1, 1]

    # requests batched together come back each with its own rows, in its dims (binary tensors too)
    # (tritonclient's HTTP client is gevent's: its calls in flight together are async_infer's, never
    # calls from several threads, which once failed with "Cannot switch to a different thread")
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"), concurrency=4)
    try:
        def one(i: int) -> httpclient.InferAsyncRequest:
            x = httpclient.InferInput("x", [1, 1], "FP32")
            x.set_data_from_numpy(np.array([[float(i)]], np.float32), binary_data=True)
            return client.async_infer("double", [x])
        got = [request.get_result().as_numpy("y") for request in [one(i) for i in range(8)]]
    finally:
        client.close()
    for i, y in enumerate(got):
        np.testing.assert_array_equal(y, [[2.0 * i]])
    stats = httpx.get(f"{server.url}/v2/models/double/stats").json()["model_stats"][0]
    assert stats["inference_count"] > stats["execution_count"]  # some were batched together

    # open sizes: [1, 2, 4] goes in as [1, 2, 2, 2] and comes back as [1, 2, 4]
    r = infer(server.url, "pairs", list(range(8)), [1, 2, 4])
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [1, 2, 4] and r.json()["outputs"][0]["data"] == list(range(8))
    r = infer(server.url, "pairs", [0, 1, 2], [1, 3])  # not the dims: a clear 400, never the backend's 500
    assert r.status_code == 400, r.text
    r = infer(server.url, "double", [1.0, 2.0], [1, 2])  # the dims still rule
    assert r.status_code == 400


def test_reshape_is_checked_against_the_dims() -> None:
    def spec(tensor: str) -> ModelSpec:
        config = parse_text("m", f'name: "m"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'
                                 f'input [{tensor}]\noutput [{{ name: "y" data_type: TYPE_FP32 dims: [ 1 ] }}]\n')
        config = normalize("m", config)
        validate(config)
        return ModelSpec.from_config(to_dict(config))

    for bad, why in (('dims: [ 4 ] reshape: { shape: [ 3 ] }', "different size"),
                     ('dims: [ -1 ] reshape: { shape: [ -1, 2 ] }', "different size"),  # Triton's rule too
                     ('dims: [ -1 ] reshape: { shape: [ 2, 2 ] }', "open"),
                     ('dims: [ 4 ] reshape: { shape: [ 0, 2 ] }', "positive")):
        with pytest.raises(ConfigError, match=why):
            spec(f'{{ name: "x" data_type: TYPE_FP32 {bad} }}')
    s = spec('{ name: "x" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape: { shape: [ 4 ] } }')
    assert s.inputs[0].reshape == (4,) and s.outputs[0].reshape is None
    assert Reshapes.of(s).to_model({"x": np.zeros((3, 2, 2))})["x"].shape == (3, 4)
    plain = spec('{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }')
    assert Reshapes.of(plain) is None  # nothing to do, nothing paid
    # several open sizes take the request's in order
    assert reshaped((5, 6), (-1, -1), (-1, 1, -1)) == (5, 1, 6)
    assert reshaped((3,), (-1,), (-1, 1)) == (-1, 1)  # a lone one is numpy's to work out
    pairs = spec('{ name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] reshape: { shape: [ -1, 2, 2 ] } }')
    check_shape(pairs, pairs.inputs[0], [1, 3, 4])
    with pytest.raises(InvalidArgument):
        check_shape(pairs, pairs.inputs[0], [1, 5])
