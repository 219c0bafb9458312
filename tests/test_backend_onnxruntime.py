"""The onnxruntime backend's session options from the config, as Triton's onnxruntime backend reads them:
optimization { graph { level } } and the parameters execution_mode, intra_op_thread_count,
inter_op_thread_count, enable_mem_arena and enable_mem_pattern; what onnxruntime cannot take is the
model's load error. The config goes through the control plane's reading (load_model), as a worker gets it;
that reading checks the config against the model's tensors, as Triton's onnxruntime backend does at load."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import orjson
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from despina.contract.errors import ConfigError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.examples import build_add_sub, build_mlp, mlp_numpy, save_onnx
from despina.workers.backends import Instance, backend_class
from despina.workers.backends.onnxruntime import has_tf32_option
from despina.workers.backends.ort_providers import CPU, CUDA, OPENVINO, TENSORRT, providers

from .conftest import Server

CONFIG = """
name: "m"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] } ]
"""


def loaded(tmp_path: Path, extra: str, threads: int = 1) -> ort.SessionOptions:
    folder = tmp_path / "m"
    build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(CONFIG + extra)
    spec = ModelSpec.from_config(load_model(folder).config)
    backend = backend_class("onnxruntime")(spec, folder / "1", Instance("m_0", threads=threads))
    backend.load()
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_allclose(backend.execute({"x": x}, ["y"])["y"], mlp_numpy(x), rtol=1e-4, atol=1e-5)
    return backend.session.get_session_options()


def test_without_settings_the_worker_chooses(tmp_path: Path) -> None:
    options = loaded(tmp_path, "", threads=2)
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (2, 1)
    assert options.enable_cpu_mem_arena and options.enable_mem_pattern


# The smallest custom-operation library onnxruntime takes: its RegisterCustomOps adds no operation, and
# writes down that it was called
OPS_LIBRARY = r"""
#include <stdio.h>
void *RegisterCustomOps(void *options, const void *api) {
    FILE *mark = fopen(MARK, "a");
    if (mark) { fputs("registered\n", mark); fclose(mark); }
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the library")
def test_model_operations_libraries_are_registered_with_the_session(tmp_path: Path) -> None:
    """Triton's onnxruntime backend registers each model_operations.op_library_filename with the session
    (its custom operations); one that onnxruntime cannot take is the model's load error."""
    source, library, mark = tmp_path / "ops.c", tmp_path / "libops.so", tmp_path / "mark"
    source.write_text(OPS_LIBRARY)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARK="{mark}"', "-o", str(library), str(source)], check=True)
    loaded(tmp_path, f'model_operations {{ op_library_filename: "{library}" }}')
    assert mark.read_text().split() == ["registered"]  # by the worker's session
    missing = tmp_path / "libmissing.so"
    with pytest.raises(ConfigError, match=f"model_operations: onnxruntime cannot load '{missing}'"):
        loaded(tmp_path / "again", f'model_operations {{ op_library_filename: "{missing}" }}')


@pytest.mark.parametrize(("level", "expected"), [
    (-1, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC), (1, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
    (2, ort.GraphOptimizationLevel.ORT_DISABLE_ALL), (0, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)])
def test_the_graph_level_is_tritons(tmp_path: Path, level: int, expected: object) -> None:
    options = loaded(tmp_path, f"optimization {{ graph {{ level: {level} }} }}")
    assert options.graph_optimization_level == expected


def test_the_parameters_reach_the_session(tmp_path: Path) -> None:
    options = loaded(tmp_path, """parameters [
      { key: "execution_mode" value: { string_value: "1" } },
      { key: "intra_op_thread_count" value: { string_value: "3" } },
      { key: "inter_op_thread_count" value: { string_value: "2" } },
      { key: "enable_mem_arena" value: { string_value: "false" } },
      { key: "enable_mem_pattern" value: { string_value: "0" } },
      { key: "session.use_device_allocator_for_initializers" value: { string_value: "1" } }
    ]""")
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 2)
    assert not options.enable_cpu_mem_arena and not options.enable_mem_pattern
    assert options.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"


@pytest.mark.parametrize(("extra", "message"), [
    ('parameters { key: "execution_mode" value: { string_value: "2" } }',
     "execution_mode must be 0 \\(sequential\\) or 1 \\(parallel\\), got 2"),
    ('parameters { key: "intra_op_thread_count" value: { string_value: "four" } }',
     "intra_op_thread_count must be an integer, got 'four'"),
    ('parameters { key: "inter_op_thread_count" value: { string_value: "-1" } }',
     "inter_op_thread_count must be >= 0, got -1"),
    ('parameters { key: "enable_mem_arena" value: { string_value: "maybe" } }',
     "enable_mem_arena must be true or false, got 'maybe'"),
])
def test_a_value_onnxruntime_cannot_take_is_the_load_error(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"model 'm': parameter {message}"):
        loaded(tmp_path, extra)


# -- the config against the model: a disagreement fails the load, not every request --------------------------


@pytest.mark.parametrize(("config", "message"), [
    (CONFIG.replace('name: "x"', 'name: "zzz"'), "input 'zzz' is not one of the model's; allowed inputs are: x"),
    (CONFIG.replace("dims: [ 256 ]", "dims: [ 100 ]"),
     r"input 'x': the model's shape \[-1, 256\] does not match the config's \[-1, 100\] \(max_batch_size > 0"),
    (CONFIG.replace("max_batch_size: 8", "max_batch_size: 0").replace("dims: [ 10 ]", "dims: [ -1, 10 ]"),
     "the config's dims contradict each other on whether the model batches"),
    (CONFIG.replace("dims: [ 10 ]", "dims: [ 7 ]"), r"output 'y': the model's shape \[-1, 10\] does not match"),
    (CONFIG.replace('name: "y"', 'name: "z"'), "output 'z' is not one of the model's; allowed outputs are: y"),
    (CONFIG.replace("TYPE_FP32 dims: [ 256 ]", "TYPE_FP16 dims: [ 256 ]"),
     "input 'x': the config says TYPE_FP16, the model TYPE_FP32"),
])
def test_a_config_the_model_disagrees_with_fails_its_load(tmp_path: Path, config: str, message: str) -> None:
    folder = tmp_path / "m"
    build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(config)
    with pytest.raises(ConfigError, match=f"model 'm': {message}"):
        load_model(folder)


def test_each_model_input_is_declared_or_made_by_the_server(tmp_path: Path) -> None:
    """onnxruntime needs every input: one the config leaves out fails the load unless the server makes it
    (here a batch input)."""
    folder = tmp_path / "m"
    build_add_sub(folder / "1" / "model.onnx")
    one = ('backend: "onnxruntime" max_batch_size: 8 input [ { name: "a" data_type: TYPE_FP32 dims: [ 4 ] } ] '
           'output [ { name: "sum" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    (folder / "config.pbtxt").write_text(one)
    with pytest.raises(ConfigError, match=r"model 'm': the model's input b is not in the config \(declared: a\)"):
        load_model(folder)
    (folder / "config.pbtxt").write_text(one + 'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "b" '
                                               'data_type: TYPE_FP32 source_input: "a" } ]')
    assert load_model(folder).state == "READY"


def test_a_model_with_a_fixed_first_dimension_batches_only_one_row(tmp_path: Path) -> None:
    """max_batch_size > 0 puts a batch dimension before dims; a model whose first size is fixed takes only
    batches of that size, so the batcher may give it one row at most."""
    folder = tmp_path / "m"
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "fixed",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")

    def config(max_batch_size: int, dims: str) -> str:
        return (f'backend: "onnxruntime" max_batch_size: {max_batch_size} '
                f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {dims} ] }} ] '
                f'output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {dims} ] }} ]')

    (folder / "config.pbtxt").write_text(config(8, "4"))
    with pytest.raises(ConfigError, match=r"model 'm': input 'x': the model's shape \[1, 4\] has a fixed first "
                                          "dimension, and max_batch_size > 0 needs it open"):
        load_model(folder)
    for max_batch_size, dims in ((1, "4"), (0, "1, 4")):
        (folder / "config.pbtxt").write_text(config(max_batch_size, dims))
        assert load_model(folder).state == "READY"
    # the config may not leave open what the model fixes (as in Triton's backends): requests of other sizes
    # would pass the gateway's checks and fail in onnxruntime
    for max_batch_size, dims in ((0, "-1, 4"), (0, "1, -1"), (1, "-1")):
        (folder / "config.pbtxt").write_text(config(max_batch_size, dims))
        with pytest.raises(ConfigError, match=r"the model's shape \[1, 4\] does not match the config's .*"
                                              "-1 only where the model's is open"):
            load_model(folder)


def test_a_load_the_model_disagrees_with_is_refused_and_the_loaded_config_serves(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """Through the repository API: the load answers 400 with the reason; what was loaded keeps serving."""
    folder = tmp_path / "repo" / "m"
    build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(CONFIG)
    server = serve(tmp_path / "repo", "--model-control-mode", "explicit", "--load-model", "m", wait_models=("m",))
    config = {"backend": "onnxruntime", "max_batch_size": 8,
              "input": [{"name": "zzz", "data_type": "TYPE_FP32", "dims": [256]}],
              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [10]}]}
    r = httpx.post(f"{server.url}/v2/repository/models/m/load",
                   json={"parameters": {"config": orjson.dumps(config).decode()}})
    assert r.status_code == 400
    assert r.json()["error"] == "model 'm': input 'zzz' is not one of the model's; allowed inputs are: x"
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    r = httpx.post(f"{server.url}/v2/models/m/infer", json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 256], "data": x.ravel().tolist()}]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]), mlp_numpy(x)[0], rtol=1e-4, atol=1e-5)


def test_a_model_onnx_folder_holds_the_model_beside_its_external_data(tmp_path: Path) -> None:
    """Triton's layout for a model past 2 GB: <version>/model.onnx/ is a folder holding model.onnx and the
    weights it names; the config is completed from it and the model serves."""
    build_mlp(tmp_path / "plain.onnx")
    folder = tmp_path / "m"
    (folder / "1" / "model.onnx").mkdir(parents=True)
    onnx.save_model(onnx.load(str(tmp_path / "plain.onnx")), str(folder / "1" / "model.onnx" / "model.onnx"),
                    save_as_external_data=True, location="weights.bin", size_threshold=0)
    assert (folder / "1" / "model.onnx" / "weights.bin").stat().st_size > 1_000_000
    entry = load_model(folder)
    assert entry.state == "READY", entry.reason
    assert [(t["name"], t["dims"]) for t in entry.config["input"]] == [("x", [256])]
    spec = ModelSpec.from_config(entry.config)
    backend = backend_class("onnxruntime")(spec, folder / "1", Instance("m_0"))
    backend.load()
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_allclose(backend.execute({"x": x}, ["y"])["y"], mlp_numpy(x), rtol=1e-4, atol=1e-5)


def test_a_tensor_of_the_batch_dimension_alone_is_completed_as_triton_does(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """A model of shape [N] and no config.pbtxt: Triton fills dims [1] with an empty reshape, so clients
    see [-1, 1] and send [n, 1], which the model gets as [n]."""
    folder = tmp_path / "repo" / "m"
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")
    server = serve(tmp_path / "repo", wait_models=("m",))
    meta = httpx.get(f"{server.url}/v2/models/m").json()
    assert [t["shape"] for t in (*meta["inputs"], *meta["outputs"])] == [[-1, 1], [-1, 1]]
    r = httpx.post(f"{server.url}/v2/models/m/infer", json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [3, 1], "data": [1, 2, 3]}]})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [3, 1]
    assert r.json()["outputs"][0]["data"] == [-1, -2, -3]


def test_an_initializer_the_model_takes_as_an_input_may_be_an_optional_input(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """An ONNX graph input with an initializer is one the model may be given and otherwise takes its
    initializer for; Triton's onnxruntime backend lets the config declare it (optional: true)."""
    folder = tmp_path / "repo" / "m"
    bias = numpy_helper.from_array(np.array([10, 20], np.float32), "b")
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 2]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], initializer=[bias])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        'backend: "onnxruntime" max_batch_size: 0 input [ { name: "a" data_type: TYPE_FP32 dims: [ -1, 2 ] }, '
        '{ name: "b" data_type: TYPE_FP32 dims: [ 2 ] optional: true } ] '
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]')
    server = serve(tmp_path / "repo", "--model-control-mode", "explicit", "--load-model", "m", wait_models=("m",))
    a = {"name": "a", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}
    b = {"name": "b", "datatype": "FP32", "shape": [2], "data": [100, 200]}
    for inputs, expected in (([a], [11, 22]), ([a, b], [101, 202])):
        r = httpx.post(f"{server.url}/v2/models/m/infer", json={"inputs": inputs})
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == expected
    (folder / "config.pbtxt").write_text((folder / "config.pbtxt").read_text().replace("TYPE_FP32 dims: [ 2 ]",
                                                                                      "TYPE_INT32 dims: [ 2 ]"))
    r = httpx.post(f"{server.url}/v2/repository/models/m/load")
    assert r.status_code == 400
    assert r.json()["error"] == "model 'm': input 'b': the config says TYPE_INT32, the model TYPE_FP32"


def test_a_scalar_output_declared_as_dims_1_comes_back_in_those_dims(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """Triton declares a model's scalar (rank 0) output as dims [1] in a config without batching, and
    answers it in that shape, as the model's metadata says."""
    folder = tmp_path / "repo" / "m"
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "sum",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        'backend: "onnxruntime" max_batch_size: 0 input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ] '
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]')
    server = serve(tmp_path / "repo", wait_models=("m",))
    assert httpx.get(f"{server.url}/v2/models/m").json()["outputs"][0]["shape"] == [1]
    r = httpx.post(f"{server.url}/v2/models/m/infer", json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}]})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [1]
    assert r.json()["outputs"][0]["data"] == [6]


def test_a_scalar_model_is_completed_as_dims_1_and_served_in_them(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """Triton's onnxruntime auto-complete fills a rank-0 tensor of a model without batching as dims [1]
    (no reshape); a request of shape [1] is fed to onnxruntime as a scalar and answered in shape [1]."""
    folder = tmp_path / "repo" / "m"
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "square",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text('backend: "onnxruntime"')
    server = serve(tmp_path / "repo", wait_models=("m",))
    config = httpx.get(f"{server.url}/v2/models/m/config").json()
    assert [(t["dims"], "reshape" in t) for t in (*config["input"], *config["output"])] == [([1], False)] * 2
    r = httpx.post(f"{server.url}/v2/models/m/infer", json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1], "data": [3]}]})
    assert r.status_code == 200, r.text
    assert (r.json()["outputs"][0]["shape"], r.json()["outputs"][0]["data"]) == ([1], [9])


# -- execution providers: optimization { execution_accelerators }, as Triton's onnxruntime backend --------

ACCELERATED = """
optimization { execution_accelerators {
  gpu_execution_accelerator [
    { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" }
      parameters { key: "max_workspace_size_bytes" value: "1073741824" }
      parameters { key: "trt_engine_cache_enable" value: "true" }
      parameters { key: "trt_engine_cache_path" value: "/tmp/engines" } },
    { name: "cuda" parameters { key: "do_copy_in_default_stream" value: "false" }
      parameters { key: "cudnn_conv_use_max_workspace" value: "1" } } ] } }
parameters { key: "cudnn_conv_algo_search" value: { string_value: "1" } }
parameters { key: "arena_extend_strategy" value: { string_value: "1" } }
parameters { key: "do_copy_in_default_stream" value: { string_value: "1" } }
"""
EVERY = [TENSORRT, CUDA, OPENVINO, CPU]


def config_of(tmp_path: Path, extra: str) -> dict[str, object]:
    folder = tmp_path / "m"
    if not (folder / "1" / "model.onnx").exists():
        build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(CONFIG + extra)
    return ModelSpec.from_config(load_model(folder).config).config


def test_gpu_accelerators_become_providers_in_tritons_order(tmp_path: Path) -> None:
    config = config_of(tmp_path, ACCELERATED)
    assert providers("m", config, "GPU", 1, EVERY) == [
        (TENSORRT, {"trt_fp16_enable": "True", "trt_max_workspace_size": "1073741824",
                    "trt_engine_cache_enable": "True", "trt_engine_cache_path": "/tmp/engines",
                    "device_id": "1"}),
        # the model's own parameters, then the "cuda" accelerator's, which win
        (CUDA, {"device_id": "1", "use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC",
                "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": "0",
                "cudnn_conv_use_max_workspace": "1"}),
        (CPU, {})]
    assert providers("m", config_of(tmp_path, ""), "GPU", 0, EVERY) == [
        (CUDA, {"device_id": "0", "use_tf32": "0"}), (CPU, {})]


def test_float32_keeps_its_precision_on_the_gpu_unless_the_config_takes_tf32(tmp_path: Path) -> None:
    """The CUDA provider's TF32 is off unless the "cuda" accelerator turns it on; an onnxruntime older
    than use_tf32 (1.18) is not given the option, which it would refuse."""
    def cuda(extra: str, tf32_option: bool = True) -> dict[str, str]:
        return providers("m", config_of(tmp_path, extra), "GPU", 0, EVERY, tf32_option)[0][1]

    take = ('optimization { execution_accelerators { gpu_execution_accelerator [ '
            '{ name: "cuda" parameters { key: "use_tf32" value: "%s" } } ] } }')
    assert cuda("")["use_tf32"] == "0"
    assert cuda(take % "true")["use_tf32"] == "1"
    assert cuda(take % "0")["use_tf32"] == "0"
    assert "use_tf32" not in cuda("", tf32_option=False)
    with pytest.raises(ConfigError, match="use_tf32 must be true or false"):
        cuda(take % "fast")
    assert [has_tf32_option(v) for v in ("1.17.3", "1.18.0", "1.32.0", "2.0.0", "main")] == \
        [False, True, True, True, True]


def test_a_cpu_instance_does_not_consult_the_gpu_accelerators(tmp_path: Path) -> None:
    """As Triton: the model loads on onnxruntime's CPU provider and answers."""
    options = loaded(tmp_path, ACCELERATED)
    assert options.intra_op_num_threads == 1
    assert providers("m", config_of(tmp_path, ACCELERATED), "CPU", 0, [CPU]) == [(CPU, {})]


def test_openvino_comes_before_the_cpu_provider(tmp_path: Path) -> None:
    config = config_of(tmp_path, 'optimization { execution_accelerators { cpu_execution_accelerator [ '
                                 '{ name: "openvino" parameters { key: "num_of_threads" value: "2" } } ] } }')
    assert providers("m", config, "CPU", 0, EVERY) == [
        (OPENVINO, {"device_type": "CPU", "num_of_threads": "2"}), (CPU, {})]
    assert providers("m", config, "GPU", 0, EVERY) == [
        (CUDA, {"device_id": "0", "use_tf32": "0"}), (OPENVINO, {"device_type": "CPU", "num_of_threads": "2"}),
        (CPU, {})]


@pytest.mark.skipif("OpenVINOExecutionProvider" in ort.get_available_providers(), reason="it has OpenVINO")
def test_an_accelerator_this_onnxruntime_lacks_is_the_load_error(tmp_path: Path) -> None:
    """Not a silent run on the CPU provider: the load fails, naming what to install."""
    with pytest.raises(ConfigError, match="OpenVINOExecutionProvider is asked for .* but this onnxruntime has "
                                          "only .*CPUExecutionProvider.*; install onnxruntime-openvino"):
        loaded(tmp_path, 'optimization { execution_accelerators { cpu_execution_accelerator [ '
                         '{ name: "openvino" } ] } }')


@pytest.mark.parametrize(("kind", "extra", "message"), [
    ("CPU", 'optimization { execution_accelerators { cpu_execution_accelerator [ { name: "mkl" } ] } }',
     "unknown Execution Accelerator 'mkl' is requested"),
    ("GPU", 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "gpu_io" } ] } }',
     "unknown Execution Accelerator 'gpu_io' is requested"),
    ("GPU", 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" '
            'parameters { key: "segment_size" value: "3" } } ] } }',
     "unknown parameter 'segment_size' is provided for TensorRT Execution Accelerator"),
    ("GPU", 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" '
            'parameters { key: "precision_mode" value: "FP8" } } ] } }',
     "unsupported precision mode 'FP8' is requested"),
    ("GPU", 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" '
            'parameters { key: "max_workspace_size_bytes" value: "abc" } } ] } }',
     "parameter max_workspace_size_bytes must be an integer, got 'abc'"),
    ("GPU", 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" '
            'parameters { key: "trt_engine_cache_enable" value: "sometimes" } } ] } }',
     "parameter trt_engine_cache_enable must be true or false, got 'sometimes'"),
    ("GPU", 'parameters { key: "cudnn_conv_algo_search" value: { string_value: "3" } }',
     "unsupported cudnn_conv_algo_search value '3' is requested"),
])
def test_what_triton_would_refuse_is_the_load_error(tmp_path: Path, kind: str, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"model 'm': {message}"):
        providers("m", config_of(tmp_path, extra), kind, 0, EVERY)


def test_a_load_that_asks_for_a_missing_provider_says_so(serve: Callable[..., Server], tmp_path: Path) -> None:
    """Through the repository API with a config override (its JSON form): the reason reaches the client."""
    if "OpenVINOExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has OpenVINO")
    folder = tmp_path / "repo" / "m"
    build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(CONFIG)
    server = serve(tmp_path / "repo", "--model-control-mode", "explicit")
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        config = {"name": "m", "backend": "onnxruntime", "max_batch_size": 8,
                  "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [256]}],
                  "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [10]}],
                  "optimization": {"execution_accelerators": {"cpu_execution_accelerator": [{"name": "openvino"}]}}}
        with pytest.raises(InferenceServerException, match="OpenVINOExecutionProvider .*onnxruntime-openvino"):
            client.load_model("m", config=orjson.dumps(config).decode())
        assert not client.is_model_ready("m")
        client.load_model("m")  # the repository's own config has no accelerator
        assert client.is_model_ready("m")
    finally:
        client.close()


def test_the_cuda_libraries_preload_once_and_what_it_prints_is_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """onnxruntime-gpu's preload_dlls prints what it could not load; a server logs it instead. Its own
    behaviour needs a GPU (tests/test_gpu.py); here, a stand-in that prints and then raises."""
    from despina.workers.backends import onnxruntime as backend

    calls = []

    def preload() -> None:
        calls.append(1)
        print("Failed to load libcudnn.so.9: not found")
        raise RuntimeError("no CUDA version recorded")

    monkeypatch.setattr(ort, "preload_dlls", preload, raising=False)
    backend.preload_cuda_libraries.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="despina.backends.onnxruntime"):
            backend.preload_cuda_libraries()
            backend.preload_cuda_libraries()
    finally:
        backend.preload_cuda_libraries.cache_clear()
    assert calls == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "onnxruntime could not preload the CUDA libraries: no CUDA version recorded",
        "onnxruntime: Failed to load libcudnn.so.9: not found"]


# what onnxruntime's telemetry takes for a CI run, where it stays quiet by itself
CI_MARKS = ("CI", "TF_BUILD", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "BUILD_BUILDID", "TEAMCITY_VERSION",
            "TRAVIS", "CIRCLECI", "BUILDKITE", "CODEBUILD_BUILD_ID", "APPVEYOR", "ORT_RUNNING_UNIT_TESTS")


def telemetry_files(tmp_path: Path, code: str, **env: str) -> list[str]:
    """The files a fresh process leaves under its home's cache after it runs `code` and a session of
    the MLP, as on a user's machine (no CI marks, no opt-out of its own unless `env` gives one)."""
    home = tmp_path / "home"
    home.mkdir(parents=True)
    build_mlp(tmp_path / "model.onnx")
    clean = {k: v for k, v in os.environ.items()
             if k not in CI_MARKS and not k.startswith("ORT_") and k != "XDG_CACHE_HOME"}
    script = f"{code}\nimport onnxruntime\nonnxruntime.InferenceSession({str(tmp_path / 'model.onnx')!r})\n"
    subprocess.run([sys.executable, "-c", script], env={**clean, "HOME": str(home), **env}, check=True,
                   timeout=60)
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())


def test_onnxruntime_telemetry_is_off_in_despinas_processes(tmp_path: Path) -> None:
    """onnxruntime 1.29+ keeps a device id and an upload queue under ~/.cache/Microsoft and sends to
    Microsoft from Linux too; a process that imported despina first (every Despina process does) and the
    processes it starts leave nothing there. A user's own setting of the variable stands."""
    alone = telemetry_files(tmp_path / "alone", "")
    if not alone:
        pytest.skip(f"onnxruntime {ort.__version__} keeps no telemetry files here")
    assert any("Microsoft" in f for f in alone), alone
    assert telemetry_files(tmp_path / "despina", "import despina") == []
    inner = f"import onnxruntime; onnxruntime.InferenceSession({str(tmp_path / 'child' / 'model.onnx')!r})"
    child = f"import despina, subprocess, sys\nsubprocess.run([sys.executable, '-c', {inner!r}], check=True)"
    assert telemetry_files(tmp_path / "child", child) == []
    assert telemetry_files(tmp_path / "asked", "import despina", ORT_DISABLE_TELEMETRY="0") == alone


def test_the_examples_script_answers_help_and_builds_nothing(tmp_path: Path) -> None:
    # it took any first argument for the folder: `--help` built every example into ./--help
    source = str(Path(__file__).resolve().parents[1])  # this checkout's despina, from any folder
    r = subprocess.run([sys.executable, "-m", "despina.examples", "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": source})
    assert r.returncode == 0 and "usage: python -m despina.examples" in r.stdout, r.stderr
    assert list(tmp_path.iterdir()) == []
