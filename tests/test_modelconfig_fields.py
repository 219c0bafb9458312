"""Config fields Despina does not act on: refused at load where Triton refuses them outside TensorRT (or
Despina lacks what they name), else named in one warning per model, never dropped without a word."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from despina.contract.errors import ConfigError
from despina.control.repository import load_model
from despina.examples import build_add_sub

from .test_instances_warmup import runner_for
from .test_triton_configs import folder, refused

PYTHON = """
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""


@pytest.mark.parametrize("extra, expected", [
    ('input [ { name: "S" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true } ]',
     "input 'S': field 'is_shape_tensor': shape tensors are only supported for TensorRT"),
    ('output [ { name: "S" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true } ]',
     "output 'S': field 'is_shape_tensor': shape tensors are only supported for TensorRT"),
    ('input [ { name: "I" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 224, 224 ] } ]',
     "input 'I': field 'format' FORMAT_NCHW needs 3 dims (C, H, W or H, W, C), got [224, 224]"),
    ('instance_group [ { kind: KIND_CPU profile: [ "0" ] } ]',
     "instance_group[0]: field 'profile' is only supported for TensorRT models"),
    ('instance_group [ { kind: KIND_MODEL gpus: [ 0 ] } ]',
     "instance group m_0 has kind KIND_MODEL but specifies one or more GPUs"),
    ('instance_group [ { kind: KIND_CPU passive: true }, { kind: KIND_CPU count: 2 passive: true } ]',
     "every instance group is passive: no instance would take requests"),
    ('sequence_batching { direct { minimum_slot_utilization: 1.5 } }',
     "'sequence_batching.direct.minimum_slot_utilization' must be in range [0, 1], got 1.5"),
    ('runtime: "model.py"',
     "field 'runtime' 'model.py': Despina runs backend 'python' its own way (leave 'runtime' out, or "
     "give 'libtriton_python.so')"),
    ('model_repository_agents { agents [ { name: "decrypt" } ] }',
     "field 'model_repository_agents': repository agent 'decrypt' is not supported by Despina"),
    ('model_repository_agents { agents [ { name: "checksum" parameters { key: "SHA1:1/model.py" value: "0" } } ] }',
     "checksum agent: unsupported checksum algorithm: SHA1 (Triton's agent has MD5 only)"),
    ('model_repository_agents { agents [ { name: "checksum" parameters { key: "1/model.py" value: "0" } } ] }',
     "checksum agent: failed to parse key: 1/model.py"),
])
def test_what_triton_refuses_outside_tensorrt_or_despina_lacks_is_refused(
        tmp_path: Path, extra: str, expected: str) -> None:
    assert expected in refused(folder(tmp_path, "m", PYTHON + extra))


def test_a_runtime_that_names_the_backend_s_own_library_loads(tmp_path: Path) -> None:
    entry = load_model(folder(tmp_path, "m", PYTHON + 'runtime: "libtriton_python.so"'))
    assert entry.config["runtime"] == "libtriton_python.so"


IGNORED = PYTHON + """
instance_group [ { kind: KIND_CPU host_policy: "numa0" rate_limiter { resources [ { name: "R" count: 1 } ] } } ]
optimization { priority: PRIORITY_MAX cuda { graphs: true } eager_batching: true }
cc_model_filenames { key: "7.5" value: "model_75.py" }
model_operations { op_library_filename: "libcustom.so" }
model_metrics { metric_control [ { metric_identifier { family: "nv_inference_first_response_histogram_ms" } } ] }
"""


def test_fields_despina_ignores_are_named_once_per_model(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    path = folder(tmp_path, "ignored_fields", IGNORED)
    with caplog.at_level(logging.WARNING, logger="despina.control"):
        load_model(path)
        load_model(path)  # read again (a poll, a load call): not said again
    lines = [r.getMessage() for r in caplog.records if "ignored_fields" in r.getMessage()]
    assert len(lines) == 1, lines
    for field in ("instance_group[0].host_policy", "instance_group[0].rate_limiter", "optimization.priority",
                  "optimization.cuda", "optimization.eager_batching", "cc_model_filenames",
                  "model_operations", "model_metrics"):
        assert field in lines[0], field
    assert lines[0].startswith("model 'ignored_fields': Despina ignores ")


def test_a_plain_config_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="despina.control"):
        load_model(folder(tmp_path, "plain", PYTHON + "dynamic_batching { }\ninstance_group [ { count: 2 } ]"))
    assert not [r for r in caplog.records if "plain" in r.getMessage()]


def test_ignored_fields_present_but_empty_say_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = ('instance_group [ { rate_limiter { } } ]\noptimization { cuda { graphs: false } }\n'
             'model_metrics { }\n')
    with caplog.at_level(logging.WARNING, logger="despina.control"):
        load_model(folder(tmp_path, "empty_fields", PYTHON + empty))
    assert not [r for r in caplog.records if "empty_fields" in r.getMessage()]


async def test_the_checksum_agent_loads_a_model_only_when_its_files_digests_are_the_configs(
        tmp_path: Path) -> None:
    """Triton's checksum repository agent: each `MD5:<file>` parameter names a file of the model's folder
    and its MD5; the worker that loads the model checks them first."""
    folder = tmp_path / "checked"
    build_add_sub(folder / "1" / "model.onnx")
    md5 = hashlib.md5((folder / "1" / "model.onnx").read_bytes()).hexdigest()

    def config(key: str, value: str) -> None:
        (folder / "config.pbtxt").write_text(
            'platform: "onnxruntime_onnx"\nmax_batch_size: 8\nmodel_repository_agents { agents [ { name: '
            f'"checksum" parameters {{ key: "{key}" value: "{value}" }} }} ] }}\n')

    config("MD5:1/model.onnx", md5)
    runner = runner_for(folder)
    await runner.load()
    await runner.stop()
    config("md5:1/model.onnx", md5.upper())  # the algorithm's name and the digest's hex in either case
    await runner_for(folder).load()
    for key, value, error in (
            ("MD5:1/model.onnx", "0" * 32, f"mismatched MD5 hash for file 1/model.onnx, expect: {'0' * 32}, "
                                           f"got: {md5}"),
            ("MD5:1/missing.onnx", md5, "checksum agent: cannot read file 1/missing.onnx: No such file"),
            ("MD5:../checked/1/model.onnx", md5, "checksum agent: invalid file path '../checked/1/model.onnx'")):
        config(key, value)
        with pytest.raises(ConfigError, match=error.replace("(", r"\(")):
            await runner_for(folder).load()
