"""An ONNX model whose tensor has no shape at all (unknown rank: onnxruntime reports its shape as [], as it
does a scalar's): only a config that declares it as a scalar (dims [1], no batching, Triton's way) has its
one-element requests fed as a scalar; under any other dims a request's shape reaches the model as it is.
onnx's checker refuses such a graph input; onnxruntime runs it, and some converters write it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.workers.backends import Instance, backend_class


def identity(tmp_path: Path, config: str) -> Any:
    """An Identity whose input and output have no shape, under `config`, loaded."""
    folder = tmp_path / "m"
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    (folder / "1").mkdir(parents=True)  # onnx's checker wants a shape; onnxruntime runs it without one
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text('name: "m"\nbackend: "onnxruntime"\n' + config)
    backend = backend_class("onnxruntime")(ModelSpec.from_config(load_model(folder).config), folder / "1",
                                           Instance("m_0"))
    backend.load()
    return backend


TENSORS = 'input [{{ name: "x" data_type: TYPE_FP32 dims: {0} }}]\noutput [{{ name: "y" data_type: TYPE_FP32 dims: {0} }}]\n'


@pytest.mark.parametrize(("config", "shape"), [
    ("max_batch_size: 4\n" + TENSORS.format("[ -1 ]"), (1, 1)),  # a batch of one row of one element
    ("max_batch_size: 0\n" + TENSORS.format("[ -1, -1 ]"), (1, 1)),
    ("max_batch_size: 0\n" + TENSORS.format("[ -1 ]"), (1,)),
])
def test_a_one_element_request_keeps_its_shape(tmp_path: Path, config: str, shape: tuple[int, ...]) -> None:
    x = np.full(shape, 7, np.float32)
    out = identity(tmp_path, config).execute({"x": x}, ["y"])["y"]
    assert out.shape == shape and out.tolist() == x.tolist()


def test_declared_as_a_scalar_it_is_fed_one(tmp_path: Path) -> None:
    backend = identity(tmp_path, TENSORS.format("[ 1 ]"))
    assert backend.execute({"x": np.full((1,), 7, np.float32)}, ["y"])["y"].shape == (1,)
