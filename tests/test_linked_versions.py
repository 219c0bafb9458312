"""A version folder that is a symbolic link (`1 -> /builds/1234`), held against Triton 2.51: both serve it,
and Triton's poll sees a change of the files behind the link (it stats through links). Despina's scan did not
walk into the link: the version had no files, so its revision never changed and a poll never reloaded it."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx

from despina.registry import LocalRegistry

from .conftest import Server
from .control_support import wait_until
from .test_broken_repositories import python_model
from .test_version_zero import MODEL_PY


def linked_repository(tmp_path: Path) -> tuple[Path, Path]:
    build = tmp_path / "builds" / "1234"
    build.mkdir(parents=True)
    (build / "model.py").write_text(MODEL_PY)
    repo = tmp_path / "repo"
    folder = python_model(repo, "m", versions=())
    os.symlink(build, folder / "1")
    os.symlink("..", folder / "up")  # a link up to the repository: walked into, it lists other models' files
    python_model(repo, "other")
    return repo, build


def test_the_scan_lists_the_files_behind_a_linked_version_folder(tmp_path: Path) -> None:
    repo, build = linked_repository(tmp_path)
    model = LocalRegistry(repo).model("m")
    assert [f.path for f in model.files] == ["1/model.py", "config.pbtxt"]
    assert model.versions == [1]


def test_a_poll_reloads_a_version_whose_linked_files_changed(serve: Callable[..., Server], tmp_path: Path) -> None:
    repo, build = linked_repository(tmp_path)
    server = serve(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2", wait_models=("m",))
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}

    def answer() -> list[float]:
        r = httpx.post(f"{server.url}/v2/models/m/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["outputs"][0]["data"]

    assert answer() == [2, 3, 4, 5]
    (build / "model.py").write_text(MODEL_PY.replace("+ self.version", "+ self.version + 10"))
    wait_until(lambda: answer() == [12, 13, 14, 15], timeout=60, what="the new model.py behind the link")


def test_links_that_go_round_are_walked_once(tmp_path: Path) -> None:
    repo, build = linked_repository(tmp_path)
    (build / "other").mkdir()
    os.symlink(build, build / "other" / "back")  # 1/other/back is 1 again
    os.symlink(build, repo / "m" / "2")            # two versions of one build: each has its files
    model = LocalRegistry(repo).model("m")
    assert [f.path for f in model.files] == ["1/model.py", "2/model.py", "config.pbtxt"]
