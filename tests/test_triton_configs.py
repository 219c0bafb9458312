"""Real config.pbtxt files from Triton's repositories, loaded unchanged: each serves, or is refused at load
with a message that names what Despina does not do. License headers are left out; each names its source."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from despina.contract.errors import ConfigError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.examples import save_onnx

PYTHON_MODEL = """
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""


def folder(root: Path, name: str, config: str, model_py: bool = True) -> Path:
    path = root / name
    (path / "1").mkdir(parents=True)
    (path / "config.pbtxt").write_text(config)
    if model_py:
        (path / "1" / "model.py").write_text(PYTHON_MODEL)
    return path


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_model(path)
    return caught.value.message


# -- configs that load ---------------------------------------------------------------------------------

# triton-inference-server/server docs/examples/model_repository/densenet_onnx/config.pbtxt
DENSENET = """
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 1
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]"""


def test_densenet_example_keeps_format_reshape_and_labels(tmp_path: Path) -> None:
    path = folder(tmp_path, "densenet_onnx", DENSENET, model_py=False)
    (path / "densenet_labels.txt").write_text("\n".join(f"class{i}" for i in range(1000)))
    pool = helper.make_node("GlobalAveragePool", ["data_0"], ["pooled"])
    conv = helper.make_node("Conv", ["pooled", "w"], ["fc6_1"])
    graph = helper.make_graph(
        [pool, conv], "densenet_like",
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, ["N", 1000, 1, 1])],
        [numpy_helper.from_array(np.ones((1000, 3, 1, 1), np.float32), "w")])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path / "1" / "model.onnx")
    entry = load_model(path)
    spec = ModelSpec.from_config(entry.config)
    assert entry.config["input"][0]["format"] == "FORMAT_NCHW"
    assert spec.outputs[0].dims == (1000,) and spec.outputs[0].reshape == (1000, 1, 1)
    assert entry.labels["fc6_1"][999] == "class999"


# triton-inference-server/tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt
# (a few of its inputs; ${...} filled in as its fill_template.py would)
TRTLLM_BLS = """
name: "tensorrt_llm_bls"
backend: "python"
max_batch_size: 64
model_transaction_policy {
  decoupled: true
}
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "random_seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true },
  { name: "return_log_probs" data_type: TYPE_BOOL dims: [ 1 ] reshape: { shape: [ ] } optional: true },
  { name: "prompt_embedding_table" data_type: TYPE_FP16 dims: [ -1, -1 ] optional: true },
  { name: "num_draft_tokens", data_type: TYPE_INT32, dims: [ 1 ] optional: true }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "generation_logits" data_type: TYPE_FP32 dims: [ -1, -1, -1 ] }
]
parameters: {
  key: "accumulate_tokens"
  value: {
    string_value: "False"
  }
}
instance_group [
  {
    count: 1
    kind : KIND_CPU
  }
]
"""


def test_trtllm_bls_optional_inputs_and_decoupled(tmp_path: Path) -> None:
    spec = ModelSpec.from_config(load_model(folder(tmp_path, "tensorrt_llm_bls", TRTLLM_BLS)).config)
    assert spec.decoupled
    assert [t.name for t in spec.inputs if not t.optional] == ["text_input", "max_tokens"]
    assert spec.input("return_log_probs").reshape == ()
    assert spec.config["parameters"]["accumulate_tokens"] == {"string_value": "False"}


# triton-inference-server/server docs/examples/model_repository/simple_dyna_sequence/config.pbtxt, as a
# Python model (platform "custom" there: a shared library)
DYNA_SEQUENCE = """
name: "simple_dyna_sequence"
backend: "python"
max_batch_size: 8
sequence_batching {
    max_sequence_idle_microseconds: 10000000
    oldest {
      max_candidate_sequences: 1024
      max_queue_delay_microseconds: 10000
    }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters [ { key: "execute_delay_ms" value: { string_value: "3" } } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# triton-inference-server/server qa/L0_implicit_state/models/growable_memory/config.pbtxt, as a Python
# model (backend "implicit_state" there)
GROWABLE_MEMORY = """
name: "growable_memory"
backend: "python"
max_batch_size: 0
sequence_batching {
  max_sequence_idle_microseconds: 10000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] }
  ]
  state [
    {
        input_name: "INPUT_STATE"
        output_name: "OUTPUT_STATE"
        data_type: TYPE_INT8
        dims: [1024, 1024]
        use_same_buffer_for_input_output: true
        use_growable_memory: true
    }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "TEST_CASE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "OUTPUT_STATE" data_type: TYPE_INT8 dims: [ 1 ] } ]
instance_group [ { count: 1 kind : KIND_CPU } ]
"""


def test_sequence_configs_keep_their_controls_states_and_instances(tmp_path: Path) -> None:
    dyna = ModelSpec.from_config(load_model(folder(tmp_path, "simple_dyna_sequence", DYNA_SEQUENCE)).config)
    assert dyna.sequence is not None and dyna.sequence.oldest and dyna.sequence.slots == 1024
    assert {(c.name, c.datatype) for c in dyna.sequence.controls} >= {("CORRID", "UINT64"), ("START", "INT32")}
    assert dyna.instance_count() == 2
    growable = ModelSpec.from_config(load_model(folder(tmp_path, "growable_memory", GROWABLE_MEMORY)).config)
    assert growable.sequence is not None and growable.sequence.states[0].dims == (1024, 1024)


# triton-inference-server/server qa/L0_metrics/unit_test_models/identity_cache_on/config.pbtxt, as a
# Python model (backend "identity" there); it has no name: the folder gives it
CACHE_ON = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
response_cache {
  enable: true
}
"""


def test_response_cache_and_a_name_from_the_folder(tmp_path: Path) -> None:
    spec = ModelSpec.from_config(load_model(folder(tmp_path, "identity_cache_on", CACHE_ON)).config)
    assert spec.name == "identity_cache_on" and spec.response_cache


# -- configs Despina refuses, and says why -------------------------------------------------------------

# triton-inference-server/server qa/L0_config_json/max_priority_level.pbtxt (backend "identity" there)
MAX_PRIORITY_LEVEL = """
name: "max_priority_level"
backend: "python"
max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching:
{
    # Max uint64
    priority_levels: 18446744073709551615
    # Max uint32
    default_priority_level: 4294967295
    # Max uint32 + 1
    priority_queue_policy: [
       {key: 4294967296
        value: {
          timeout_action: REJECT
          default_timeout_microseconds: 18446744073709551615
          allow_timeout_override: true
          max_queue_size: 10
       }
    }
]
}"""


def test_priority_levels_past_what_despina_serves_are_refused(tmp_path: Path) -> None:
    """Each level is a Redis stream that workers read and metrics count: 2**64 - 1 of them never finish."""
    message = refused(folder(tmp_path, "max_priority_level", MAX_PRIORITY_LEVEL))
    assert "'dynamic_batching.priority_levels'" in message and "18446744073709551615" in message


# triton-inference-server/server docs/examples/model_repository/simple_string/config.pbtxt
SIMPLE_STRING = """
name: "simple_string"
platform: "tensorflow_graphdef"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
"""


def test_a_graphdef_model_is_refused_as_a_graphdef(tmp_path: Path) -> None:
    """Not as a SavedModel that is missing: the folder holds model.graphdef, which Despina cannot run."""
    path = folder(tmp_path, "simple_string", SIMPLE_STRING, model_py=False)
    (path / "1" / "model.graphdef").write_bytes(b"\x0a\x00")
    message = refused(path)
    assert "'tensorflow_graphdef'" in message and "SavedModel" in message and "does not exist" not in message


# triton-inference-server/server docs/examples/stable_diffusion/model_repository/vae/config.pbtxt
VAE = """
name: "vae"
platform: "tensorrt_plan"
max_batch_size: 8
input [ { name: "latent_sample" data_type: TYPE_FP32 dims: [ -1, -1, -1] } ]
output [ { name: "sample" data_type: TYPE_FP32 dims: [ 3, -1, -1] } ]
instance_group [ { kind: KIND_GPU } ]
"""


def test_a_triton_platform_despina_lacks_is_named_with_those_it_has(tmp_path: Path) -> None:
    message = refused(folder(tmp_path, "vae", VAE, model_py=False))
    assert "'tensorrt_plan' is not supported by Despina" in message and "onnxruntime_onnx" in message


# triton-inference-server/server qa/L0_model_config/autofill_noplatform/ensemble/has_backend/config.pbtxt
HAS_BACKEND = """
name: "has_backend"
max_batch_size: 8
backend: "onnxruntime"
platform: "ensemble"
input [ { name: "data" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 1, 28, 28 ] } ]
output [ { name: "prob" data_type: TYPE_FP32 dims: [ 10, 1, 1 ] } ]
"""


def test_a_platform_and_a_backend_that_disagree_are_refused(tmp_path: Path) -> None:
    """Triton refuses this ensemble; taking it as an onnxruntime model would look for a model file."""
    message = refused(folder(tmp_path, "has_backend", HAS_BACKEND, model_py=False))
    assert "'ensemble'" in message and "'onnxruntime'" in message and "do not go together" in message


# triton-inference-server/server qa/L0_iterative_sequence/models/iterative_sequence/config.pbtxt (backend
# "iterative_sequence" there), and docs/examples/model_repository/simple_dyna_sequence as it is
ITERATIVE = """
backend: "python"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  iterative_sequence : true
}
instance_group [{ kind: KIND_CPU }]
"""


@pytest.mark.parametrize("name, config, expected", [
    ("iterative_sequence", ITERATIVE, "'sequence_batching.iterative_sequence' is not supported by Despina"),
    ("simple_dyna_sequence", DYNA_SEQUENCE.replace('backend: "python"', 'platform: "custom"'),
     "'custom' is not supported by Despina"),
])
def test_what_despina_lacks_is_named(tmp_path: Path, name: str, config: str, expected: str) -> None:
    assert expected in refused(folder(tmp_path, name, config))
