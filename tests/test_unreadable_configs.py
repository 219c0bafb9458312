"""config.pbtxt files that cannot be read, each held against what Triton 2.51 does with it: the model is
UNAVAILABLE with a reason that says why (an explicit load answers 400), and the rest of the repository loads."""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from despina.contract.errors import ConfigError
from despina.control.repository import load_model

from .conftest import Server
from .control_support import index
from .test_broken_repositories import python_model

# Triton 2.51 on each: a link to nothing, "failed to stat file .../config.pbtxt" (not loaded); a link loop,
# "failed to load 'm', failed to poll from model repository"; a FIFO, its load never answers. Despina took the
# first two for a model without a config (auto-completed and served it) and hung its control plane on the
# third, so that no model after it loaded.
BROKEN = {
    "a_dangling": r"model 'a_dangling': config.pbtxt is a symbolic link to 'nowhere.pbtxt', which does not exist",
    "b_loop": r"model 'b_loop': config.pbtxt cannot be read: Too many levels of symbolic links",
    "c_fifo": r"model 'c_fifo': config.pbtxt is not a regular file \(a FIFO\)",
    # a link's target is bytes: one that is not UTF-8 made a reason no catalog write could encode, which
    # dropped every model of that write from the catalog
    "d_latin1": r"model 'd_latin1': config.pbtxt is a symbolic link to 'caf\\xe9.pbtxt', which does not exist",
}


def broken_repository(root: Path) -> Path:
    for name in BROKEN:
        (python_model(root, name) / "config.pbtxt").unlink()
    os.symlink("nowhere.pbtxt", root / "a_dangling" / "config.pbtxt")
    os.symlink("other.pbtxt", root / "b_loop" / "config.pbtxt")
    os.symlink("config.pbtxt", root / "b_loop" / "other.pbtxt")
    os.mkfifo(root / "c_fifo" / "config.pbtxt")
    os.symlink(b"caf\xe9.pbtxt", os.fsencode(root / "d_latin1" / "config.pbtxt"))
    python_model(root, "z_ok")
    return root


def odd_files(root: Path) -> Path:
    """A model with a file whose name is not UTF-8 beside its own (the whole model went unread, the
    repository's poll failing every round, and the server never ready), and one whose model.py is a FIFO
    (which would hang the poll's or the worker's read)."""
    odd = python_model(root, "y_odd_name")
    (odd / "1" / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"notes")
    fifo = python_model(root, "e_fifo_model")
    (fifo / "1" / "model.py").unlink()
    os.mkfifo(fifo / "1" / "model.py")
    return root


@pytest.mark.parametrize("name", ["a_dangling", "b_loop"])
def test_a_config_pbtxt_that_cannot_be_read_is_a_config_error(tmp_path: Path, name: str) -> None:
    repo = broken_repository(tmp_path)
    with pytest.raises(ConfigError, match=BROKEN[name]):
        load_model(repo / name)


def test_unreadable_configs_are_unavailable_and_the_others_serve(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    repo = odd_files(broken_repository(tmp_path / "repo"))
    server = serve(repo)
    rows = {r["name"]: r for r in index(server.url)}
    assert rows["z_ok"].get("state") == "READY", rows
    assert rows["y_odd_name"].get("state") == "READY", rows
    assert rows["e_fifo_model"].get("state") == "UNAVAILABLE" and "model.py" in rows["e_fifo_model"]["reason"]
    for name, reason in BROKEN.items():
        assert rows[name]["state"] == "UNAVAILABLE", rows[name]
        assert re.fullmatch(reason, rows[name]["reason"]), rows[name]


def test_an_explicit_load_of_an_unreadable_config_answers_400(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    repo = broken_repository(tmp_path / "repo")
    server = serve(repo, "--model-control-mode", "explicit")
    for name in BROKEN:
        r = httpx.post(f"{server.url}/v2/repository/models/{name}/load", timeout=30)
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert re.search(BROKEN[name], r.json()["error"]), r.text
    r = httpx.post(f"{server.url}/v2/repository/models/z_ok/load", timeout=60)
    assert r.status_code == 200, r.text
