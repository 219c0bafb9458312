"""A Python model on its own environment (Triton's EXECUTION_ENV_PATH) through a real `despina serve`:
a packed environment (a tarball in the model's folder) or an unpacked one, whose interpreter runs the
model's process and whose packages it imports; and the load errors for what cannot be used.

The environments here are made for the test: bin/python3 is a script that puts the environment's own
package folder on the path and runs this test's interpreter (which has numpy), as a conda-pack or venv
environment's interpreter would run with its own packages."""
from __future__ import annotations

import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from despina.workers.backends.python_env import Interpreter, _unpacked, envs_dir, interpreter, trim
from despina.workers.backends.python_process import Stub

from .conftest import Server, module_server

MODEL = '''
import os
import numpy as np
import only_in_env  # the environment's package: not in the worker's
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        first_on_path = os.environ["PATH"].split(os.pathsep)[0]
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("value", np.array([only_in_env.VALUE], np.int64)),
            pb_utils.Tensor("where", np.array([first_on_path.encode()], np.object_))]) for _ in requests]
'''
CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "value", data_type: TYPE_INT64, dims: [ 1 ] }}, {{ name: "where", data_type: TYPE_STRING, dims: [ 1 ] }} ]
parameters {{ key: "EXECUTION_ENV_PATH", value: {{ string_value: "{env}" }} }}
'''


def make_env(folder: Path, value: int, numpy: bool = True) -> None:
    (folder / "bin").mkdir(parents=True)
    (folder / "site").mkdir()
    (folder / "site" / "only_in_env.py").write_text(f"VALUE = {value}\n")
    if not numpy:  # an environment without numpy: the model's process cannot start on it
        (folder / "site" / "numpy.py").write_text("raise ImportError('no numpy in this environment')\n")
    python = folder / "bin" / "python3"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="$(dirname "$0")/../site" exec {sys.executable} "$@"\n')
    python.chmod(0o755)


def write_model(root: Path, name: str, env: str) -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(MODEL)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, env=env))
    return root / name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("env-repo")
    packed = write_model(root, "packed", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    source = tmp_path_factory.mktemp("env") / "env"
    make_env(source, 42)
    with tarfile.open(packed / "env.tar.gz", "w:gz") as tar:  # its contents at the top, as conda-pack's
        tar.add(source, arcname=".")
    folder = write_model(root, "folder", "$$TRITON_MODEL_DIRECTORY/myenv")
    make_env(folder / "myenv", 7)
    write_model(root, "missing", "$$TRITON_MODEL_DIRECTORY/nope.tar.gz")
    no_numpy = write_model(root, "no_numpy", "$$TRITON_MODEL_DIRECTORY/env")
    make_env(no_numpy / "env", 1, numpy=False)
    write_model(root, "no_python", "$$TRITON_MODEL_DIRECTORY")  # the model's folder: no bin/python3
    cache = tmp_path_factory.mktemp("cache")
    yield from module_server(root, tmp_path_factory, redis_url, ("packed", "folder"),
                             env={"DESPINA_CACHE_DIR": str(cache)})


def infer(server: Server, model: str) -> dict[str, list]:
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", timeout=30,
                   json={"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]})
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"] for o in r.json()["outputs"]}


def test_a_packed_environment_runs_the_model_with_its_packages(server: Server) -> None:
    out = infer(server, "packed")
    assert out["value"] == [42]
    # unpacked, first, on the artifact cache's volume (the temporary folder may be a tmpfs: memory)
    assert "/cache0/python-envs/" in out["where"][0] and out["where"][0].endswith("/bin"), out


def test_archives_unpack_in_the_cache_folder_or_the_temporary_one_where_it_is_read_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacked into the temporary folder, an environment of hundreds of MB took as much memory where that
    is a tmpfs (systemd's tmp.mount); a cache folder that cannot be written still leaves it somewhere."""
    monkeypatch.setenv("DESPINA_CACHE_DIR", str(tmp_path / "cache"))
    assert envs_dir() == tmp_path / "cache" / "python-envs" and envs_dir().is_dir()
    (tmp_path / "ro").mkdir()
    monkeypatch.setenv("DESPINA_CACHE_DIR", str(tmp_path / "ro" / "cache"))
    os.chmod(tmp_path / "ro", 0o500)
    try:
        if os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere: a file where the folder would go
            os.chmod(tmp_path / "ro", 0o700)
            (tmp_path / "ro" / "cache").write_text("not a folder")
        assert envs_dir() == Path(tempfile.gettempdir()) / "despina-python-envs"
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_an_unpacked_environment_is_used_where_it_is(server: Server) -> None:
    out = infer(server, "folder")
    assert out["value"] == [7] and out["where"][0].endswith("/folder/myenv/bin")


@pytest.mark.parametrize(("model", "message"), [
    ("missing", "parameter EXECUTION_ENV_PATH '$$TRITON_MODEL_DIRECTORY/nope.tar.gz': no such file or folder"),
    ("no_numpy", "EXECUTION_ENV_PATH's: it needs numpy"),
    ("no_python", "the environment has no bin/python3 or bin/python"),
])
def test_an_environment_that_cannot_be_used_keeps_the_model_from_loading(server: Server, model: str,
                                                                         message: str) -> None:
    rows: list[dict] = []
    for _ in range(100):  # the model's load fails a moment after the others loaded
        rows = [row for row in httpx.post(f"{server.url}/v2/repository/index", timeout=10).json()
                if row["name"] == model]
        if rows and rows[0].get("state") == "UNAVAILABLE" and message in rows[0].get("reason", ""):
            r = httpx.post(f"{server.url}/v2/models/{model}/infer", timeout=10, json={
                "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]})
            # as Triton: a model none of whose versions loaded has "no available versions" (404)
            assert r.status_code == 404 and message in r.json()["error"], r.text
            return
        time.sleep(0.2)
    raise AssertionError(f"{model}: {rows}")


def test_an_archive_replaced_by_a_copy_of_the_same_size_and_time_is_unpacked_again(tmp_path: Path) -> None:
    """`cp -p` or `rsync -a` of a new environment over the old keeps the file's size and modification time
    (the same packages, one changed in a line): the next load must run the new one, not the old unpack."""
    def packed(value: int, name: str) -> Path:
        source = tmp_path / f"src{value}"
        make_env(source, value)
        archive = tmp_path / name
        with tarfile.open(archive, "w") as tar:  # plain tar: the same size for either value
            tar.add(source, arcname=".")
        return archive

    archive, other = packed(1, "env.tar"), packed(2, "other.tar")
    assert archive.stat().st_size == other.stat().st_size
    mtime = archive.stat().st_mtime_ns
    first, hold = _unpacked(archive, "test", tmp_path / "envs")
    hold.close()
    assert (first / "site" / "only_in_env.py").read_text() == "VALUE = 1\n"
    shutil.copyfile(other, archive)  # in place, then the old time put back, as `cp -p` does
    os.utime(archive, ns=(mtime, mtime))
    second, hold = _unpacked(archive, "test", tmp_path / "envs")
    hold.close()
    assert (second / "site" / "only_in_env.py").read_text() == "VALUE = 2\n"


HOUR_AGO = time.time() - 3600


def packed_model(tmp_path: Path, name: str, value: int) -> tuple[Path, dict[str, dict[str, str]]]:
    """A model folder with a packed environment, and its config's parameters."""
    folder = tmp_path / name
    make_env(tmp_path / f"src-{name}", value)
    folder.mkdir()
    with tarfile.open(folder / "env.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / f"src-{name}", arcname=".")
    return folder, {"EXECUTION_ENV_PATH": {"string_value": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"}}


def unpacked_root(python: Interpreter) -> Path:
    assert python.env is not None
    return Path(python.env["CONDA_PREFIX"])


def test_a_new_archive_removes_the_unpacked_environments_unused_for_the_lease(tmp_path: Path) -> None:
    """Every model update brings a new archive: the folders unpacked for the old ones stayed in the
    temporary folder for the host's life, hundreds of MB each. Now an unpack removes those unused for the
    lease; not one held (a model's process runs on it), however old, nor one used recently."""
    envs = tmp_path / "envs"
    roots, folders = {}, {}
    for name, value in (("old", 1), ("held", 2), ("recent", 3)):
        folder, parameters = folders[name] = packed_model(tmp_path, name, value)
        with interpreter(name, parameters, folder, sys.executable, envs) as python:
            roots[name] = unpacked_root(python)
    held = interpreter("held", folders["held"][1], folders["held"][0], sys.executable, envs)  # to the end
    assert unpacked_root(held) == roots["held"]
    for name in ("old", "held"):
        os.utime(roots[name], (HOUR_AGO, HOUR_AGO))
    try:
        folder, parameters = packed_model(tmp_path, "new", 4)
        with interpreter("new", parameters, folder, sys.executable, envs) as python:
            assert (unpacked_root(python) / "site" / "only_in_env.py").read_text() == "VALUE = 4\n"
        assert not roots["old"].exists()
        assert roots["held"].is_dir() and roots["recent"].is_dir()
        assert sorted(p.name for p in envs.iterdir()) == sorted(
            p.name for p in (roots["held"], roots["recent"], unpacked_root(python)))
    finally:
        held.hold.close()  # type: ignore[union-attr]


def test_an_environment_stays_while_a_model_process_runs_on_it_and_goes_after(tmp_path: Path) -> None:
    """The worker lets go of its hold once the process started; the process keeps the environment from
    a trim as long as it runs, and its end lets it go. A later load unpacks it again."""
    envs = tmp_path / "envs"
    folder, parameters = packed_model(tmp_path, "m", 5)
    with interpreter("m", parameters, folder, sys.executable, envs) as python:
        stub = Stub.start("m", python=python)
    root = unpacked_root(python)
    try:
        assert trim(envs, lease_s=0) == 0 and (root / "bin" / "python3").exists()
        assert stub.alive()
    finally:
        stub.stop()
    deadline = time.monotonic() + 30
    while trim(envs, lease_s=0) == 0:  # the lock goes with the process's last descriptor
        assert time.monotonic() < deadline, "the environment was never freed"
        time.sleep(0.05)
    assert not root.exists() and not any(envs.iterdir())
    with interpreter("m", parameters, folder, sys.executable, envs) as again:
        assert (unpacked_root(again) / "site" / "only_in_env.py").read_text() == "VALUE = 5\n"
