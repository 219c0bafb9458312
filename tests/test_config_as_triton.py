"""A model's config as Triton 2.51 completes it: what GET .../config answers and what a Python model's
initialize() gets as args["model_config"].

triton_2_51_configs.json holds, for each config.pbtxt, the JSON that a real Triton 2.51 (the Python
backend, no GPU) answered for it; its initialize() got the same JSON. Despina's answers are compared whole.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from despina.contract.instance_groups import completed_config, resolve
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model

RECORDED: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "triton_2_51_configs.json").read_text())

MODEL_PY = """
class TritonPythonModel:
    def execute(self, requests):
        return []
"""
# c_auto's config.pbtxt says only its backend: the rest comes from auto_complete_config, as in Triton.
# c_auto_pref's says max_batch_size 2 and dynamic_batching: Triton completes the config before it hands
# it over, so the preferred size is 2 (Despina's was the 4 auto_complete_config set after)
AUTO_COMPLETE = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return []
"""


def despina_config(tmp_path: Path, name: str) -> dict[str, Any]:
    folder = tmp_path / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(RECORDED[name]["config.pbtxt"])
    if "ensemble_scheduling" not in RECORDED[name]["config.pbtxt"]:
        (folder / "1" / "model.py").write_text(AUTO_COMPLETE if name.startswith("c_auto") else MODEL_PY)
    return load_model(folder).config


@pytest.mark.parametrize("name", sorted(n for n in RECORDED if n != "c_ens"))
def test_a_python_models_config_is_tritons(tmp_path: Path, name: str) -> None:
    """What initialize() gets on a worker without a GPU, and what GET .../config shows of a model served by
    such workers (or by none yet), is Triton's JSON, field for field. The catalog's config differs only in
    KIND_AUTO: each worker resolves it for itself (placement prefers a GPU worker for it)."""
    config = despina_config(tmp_path, name)
    triton = RECORDED[name]["triton"]
    assert completed_config(ModelSpec.from_config(config), gpu_count=0) == triton
    auto = [g["kind"] == "KIND_AUTO" for g in config["instance_group"]]
    kept = {**config, "instance_group": [{**g, "kind": "KIND_CPU"} if a else g
                                         for g, a in zip(config["instance_group"], auto)]}
    assert kept == triton


def test_an_ensembles_config_is_tritons(tmp_path: Path) -> None:
    """No backend (Triton's is ""), model_transaction_policy {decoupled: false} (Triton: decoupled when a
    step is; Despina's never are), and no ensemble_scheduling.max_inflight_requests: 2.51 has no such field."""
    config = despina_config(tmp_path, "c_ens")
    assert config == RECORDED["c_ens"]["triton"]
    assert completed_config(ModelSpec.from_config(config), gpu_count=2) == config  # it has no instances


def test_instance_groups_resolve_to_where_they_run(tmp_path: Path) -> None:
    """Triton's NormalizeInstanceGroup: KIND_AUTO becomes KIND_GPU where there is a GPU, and a KIND_GPU
    group that names no GPU gets every one."""
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(MODEL_PY)
    (folder / "config.pbtxt").write_text(
        'backend: "python" input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ] instance_group [ { kind: KIND_AUTO }, '
        '{ kind: KIND_GPU gpus: [ 1 ] count: 2 }, { kind: KIND_GPU } ]')
    spec = ModelSpec.from_config(load_model(folder).config)
    assert [(g["name"], g["kind"], g["gpus"], g["count"]) for g in resolve(spec, gpu_count=2)] == [
        ("m_0", "KIND_GPU", [0, 1], 1), ("m_1", "KIND_GPU", [1], 2), ("m_2", "KIND_GPU", [0, 1], 1)]
    assert [(g["kind"], g["gpus"]) for g in resolve(spec, gpu_count=0)][0] == ("KIND_CPU", [])
