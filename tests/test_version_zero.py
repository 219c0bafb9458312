"""A version folder 0/, held against Triton 2.51, which serves it: as any other version under each
version_policy, by /versions/0, in the index and statistics, and as an ensemble step's model_version 0 (Triton
reads 0 there as version 0, not the latest: only -1 is the latest). Despina skipped the folder: a model whose
only version was 0 "had no numeric version folder", and `specific { versions: [0] }` named "versions [0] that
have no folder"."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from despina.contract.ensemble import Ensemble
from despina.control.repository import load_model
from despina.registry.transfer import plan

from .conftest import Server
from .control_support import index, wait_until
from .test_broken_repositories import python_model

# adds its own version to the input: the answer tells which version ran
MODEL_PY = """import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + self.version)])
            for r in requests]
"""
ENSEMBLE = """platform: "ensemble"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "m" model_version: 0
  input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "OUTPUT0" } } ] }
"""


@pytest.mark.parametrize("policy, folders, versions", [
    ("version_policy: { all { } }", ("0", "1"), (0, 1)),
    ("version_policy: { specific { versions: [ 0 ] } }", ("0", "1"), (0,)),
    ("", ("0",), (0,)),
    ("", ("0", "1"), (1,)),
    ("version_policy: { latest { num_versions: 2 } }", ("0", "1", "2"), (1, 2)),
])
def test_version_0_is_a_version_under_each_policy(tmp_path: Path, policy: str, folders: tuple[str, ...],
                                                  versions: tuple[int, ...]) -> None:
    entry = load_model(python_model(tmp_path, "m", extra=policy + "\n", versions=folders))
    assert entry.versions == versions
    assert entry.available == tuple(int(f) for f in folders)


def test_an_ensemble_step_may_name_version_0() -> None:
    config = {"name": "e", "input": [{"name": "INPUT0"}], "output": [{"name": "OUTPUT0"}],
              "ensemble_scheduling": {"step": [{"model_name": "m", "model_version": 0,
                                                "input_map": {"INPUT0": "INPUT0"},
                                                "output_map": {"OUTPUT0": "OUTPUT0"}}]}}
    assert Ensemble.from_config(config).steps[0].version == 0


def test_push_puts_version_0_in_folder_0(tmp_path: Path) -> None:
    # it was refused ("versions are numbered from 1"); `version or 1` had once made it version 1
    folder = python_model(tmp_path, "m", versions=("1",))
    assert [p.path for p in plan(folder, 0)] == ["0/model.py", "config.pbtxt"]
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "model.py").write_text(MODEL_PY)
    assert [p.path for p in plan(flat, 0)] == ["0/model.py"]


def test_version_0_serves_as_in_triton(serve: Callable[..., Server], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", extra="version_policy: { all { } }\n", model=MODEL_PY, versions=("0", "1"))
    python_model(repo, "only0", model=MODEL_PY, versions=("0",))
    (repo / "e" / "1").mkdir(parents=True)
    (repo / "e" / "config.pbtxt").write_text(ENSEMBLE)
    server = serve(repo, wait_models=("m", "only0", "e"))
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}

    def infer(path: str) -> tuple[str, list[float]]:
        r = httpx.post(f"{server.url}/v2/models/{path}/infer", json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
        return r.json()["model_version"], r.json()["outputs"][0]["data"]

    # Triton 2.51's answers to the same repository and requests
    assert infer("m/versions/0") == ("0", [1, 2, 3, 4])
    assert infer("m/versions/1") == ("1", [2, 3, 4, 5])
    assert infer("m") == ("1", [2, 3, 4, 5])
    assert infer("only0") == ("0", [1, 2, 3, 4])
    assert infer("e") == ("1", [1, 2, 3, 4])   # its step ran m's version 0, not the latest
    rows = {(r["name"], r.get("version")): r.get("state") for r in index(server.url)}
    assert rows[("m", "0")] == rows[("m", "1")] == rows[("only0", "0")] == "READY", rows
    meta = httpx.get(f"{server.url}/v2/models/m/versions/0").json()
    assert meta["versions"] == ["0"], meta   # (Triton names the version asked for alone)
    assert httpx.get(f"{server.url}/v2/models/only0/versions/0/ready").status_code == 200
    stats = httpx.get(f"{server.url}/v2/models/m/versions/0/stats").json()["model_stats"]
    assert [(s["version"], s["inference_count"] >= 1) for s in stats] == [("0", True)], stats
    # the status page's rows: version 0 is a version (0 stood for "no version" there, shown as "-")
    status = server.metrics_url.removesuffix("/metrics") + "/status.json"

    def shown() -> set[tuple[str, int | None]]:  # (the control plane samples the page every 2 s)
        return {(m["name"], m["version"]) for m in httpx.get(status, timeout=30).json()["models"]}

    wait_until(lambda: {("m", 0), ("m", 1), ("only0", 0)} <= shown(), 15, what="the status page's rows")


def test_the_status_page_shows_a_model_without_versions_as_none() -> None:
    """A model with no version (one that failed to load) had a row as version 0, which version 0 now is:
    its row read version 0's statistics, and the page showed a real version 0 as "-" (`0 || "-"`)."""
    from despina.contract.keys import Keys
    from despina.control.repository import unavailable
    from despina.control.status import StatusTracker
    from despina.control.status_page import HTML

    tracker = StatusTracker(None, Keys("t"))  # type: ignore[arg-type]  # (snapshot reads no Redis)
    tracker.catalog = {"m": unavailable("m", "broken")}
    tracker.samples.append((0.0, {"m:0": {"success_count": 5}}))
    (row,) = tracker.snapshot()["models"]
    assert (row["version"], row["success"]) == (None, 0), row
    assert '${m.version ?? "-"}' in HTML
