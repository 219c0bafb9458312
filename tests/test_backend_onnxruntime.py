"""The onnxruntime backend's session options from the config, as Triton's onnxruntime backend reads them:
optimization { graph { level } } and the parameters execution_mode, intra_op_thread_count,
inter_op_thread_count, enable_mem_arena and enable_mem_pattern; what onnxruntime cannot take is the
model's load error. The config goes through the control plane's reading (load_model), as a worker gets it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from despina.contract.errors import ConfigError
from despina.contract.modelconfig import ModelSpec
from despina.control.repository import load_model
from despina.examples import build_mlp, mlp_numpy
from despina.workers.backends import Instance, backend_class

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
