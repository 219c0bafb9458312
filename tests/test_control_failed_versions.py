"""Versions whose load failed, as Triton's repository index keeps them: UNAVAILABLE with the load's error
once the model no longer loads them, until a later load of theirs succeeds; a version the model never had
is 'not found' (404), in Triton's words; a model deleted from a polled repository leaves the index."""
from __future__ import annotations

import base64
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina.contract.catalog import LOADED, RETIRED_KEPT, CatalogEntry, drop, version_refused
from despina.contract.errors import NotFound, Unavailable
from despina.control.versions import transition, try_again
from despina.examples import build_mlp

from .conftest import Server
from .control_support import catalog_entry, index, infer, mlp_folder, wait_until

NOT_READY = "Request for unknown model: 'mlp' version {} is not at ready state"
NOT_FOUND = "Request for unknown model: 'mlp' version {} is not found"
POLL = ("--model-control-mode", "poll", "--repository-poll-secs", "0.2")


def mlp_rows(url: str) -> dict[str, dict[str, str]]:
    return {r["version"]: r for r in index(url) if r["name"] == "mlp"}


def version_answers(url: str, version: int) -> list[httpx.Response]:
    """Infer, metadata and config of one version."""
    return [infer(url, version=version), httpx.get(f"{url}/v2/models/mlp/versions/{version}"),
            httpx.get(f"{url}/v2/models/mlp/versions/{version}/config")]


def assert_refused(url: str, version: int, status: int, words: str) -> None:
    for r in version_answers(url, version):
        assert r.status_code == status and r.json()["error"] == words.format(version), (r.url, r.text)
    assert httpx.get(f"{url}/v2/models/mlp/versions/{version}/ready").status_code == 400
    r = httpx.get(f"{url}/v2/models/mlp/versions/{version}/stats")
    assert r.status_code == 400 and r.json()["error"] == "requested model version is not available for model 'mlp'"


def test_a_failed_version_the_repository_drops_stays_in_the_index_with_its_error(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", {1: 0})
    server = serve(repo, *POLL, wait_models=("mlp",))
    # a version it never had: Triton's words and 404 (it was "unknown version 9 of model 'mlp'")
    assert_refused(server.url, 9, 404, NOT_FOUND)

    (repo / "mlp" / "2").mkdir()
    (repo / "mlp" / "2" / "model.onnx").write_bytes(b"not onnx")
    failed = wait_until(lambda: mlp_rows(server.url).get("2", {}).get("state") == "UNAVAILABLE"
                        and mlp_rows(server.url)["2"], 30, what="version 2 to fail")
    assert failed["reason"] and infer(server.url).json()["model_version"] == "1"

    # its folder removed: the model loads version 1 only. Triton's index goes on listing version 2 with
    # its load's error (its record stays); it used to drop out of the index, and a request naming it
    # heard 404 "unknown version 2" as if the model never had it
    shutil.rmtree(repo / "mlp" / "2")
    wait_until(lambda: (e := catalog_entry(redis_url, key_prefix, "mlp")) is not None and e.versions == (1,),
               30, what="the catalog to load version 1 only")
    assert mlp_rows(server.url) == {"1": {"name": "mlp", "version": "1", "state": "READY"}, "2": failed}
    assert [r["version"] for r in index(server.url, ready=True) if r["name"] == "mlp"] == ["1"]
    assert_refused(server.url, 2, 503, NOT_READY)

    # its files fixed: it loads, READY, and version 1 retires (listed "unloaded")
    (repo / "mlp" / "2").mkdir()
    build_mlp(repo / "mlp" / "2" / "model.onnx", seed=1)
    wait_until(lambda: mlp_rows(server.url)["1"]["state"] == "UNAVAILABLE", 30, what="version 1 to retire")
    assert mlp_rows(server.url) == {"1": {"name": "mlp", "version": "1", "state": "UNAVAILABLE",
                                          "reason": "unloaded"},
                                    "2": {"name": "mlp", "version": "2", "state": "READY"}}
    entry = catalog_entry(redis_url, key_prefix, "mlp")
    assert entry is not None and entry.dropped == {}


def file_load(url: str, onnx: bytes) -> httpx.Response:
    config = {"name": "mlp", "backend": "onnxruntime", "max_batch_size": 8,
              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [256]}],
              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [10]}]}
    params: dict[str, Any] = {"config": orjson.dumps(config).decode(),
                              "file:2/model.onnx": base64.b64encode(onnx).decode()}
    return httpx.post(f"{url}/v2/repository/models/mlp/load", json={"parameters": params}, timeout=60)


def test_a_failed_load_with_files_leaves_its_version_in_the_index(serve: Callable[..., Server],
                                                                  tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", {1: 0})
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "mlp", wait_models=("mlp",))
    # new files for a version 2 that cannot load: version 1 serves on, as Triton's; its index lists
    # version 2 with the load's error (the failed load's files are taken back out, and version 2 was
    # forgotten: not in the index, and a request naming it heard "unknown version")
    r = file_load(server.url, b"not onnx")
    assert r.status_code == 400 and "version 2" in r.json()["error"], r.text
    rows = mlp_rows(server.url)
    assert rows["1"] == {"name": "mlp", "version": "1", "state": "READY"}
    assert rows["2"]["state"] == "UNAVAILABLE" and rows["2"]["reason"], rows
    assert_refused(server.url, 2, 503, NOT_READY)
    assert infer(server.url).json()["model_version"] == "1"

    onnx = tmp_path / "good.onnx"
    build_mlp(onnx, seed=1)
    assert file_load(server.url, onnx.read_bytes()).status_code == 200
    wait_until(lambda: mlp_rows(server.url)["1"]["state"] == "UNAVAILABLE", 30, what="version 1 to retire")
    assert mlp_rows(server.url)["2"] == {"name": "mlp", "version": "2", "state": "READY"}
    assert infer(server.url, version=2).json()["model_version"] == "2"


def test_a_model_whose_every_version_failed_has_no_available_versions(serve: Callable[..., Server],
                                                                      tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", {1: 0})
    (repo / "mlp" / "1" / "model.onnx").write_bytes(b"not onnx")
    server = serve(repo, "--model-control-mode", "explicit")
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
    assert r.status_code == 400 and "version 1" in r.json()["error"], r.text
    # as Triton's: the model has no version to answer for, 404 in its words (Despina's say why); it was
    # metadata and config 200 (of no version) and an infer's 503
    for r in (infer(server.url), httpx.get(f"{server.url}/v2/models/mlp"),
              httpx.get(f"{server.url}/v2/models/mlp/config")):
        error = r.json()["error"]
        assert r.status_code == 404 and error.startswith("Request for unknown model: 'mlp' has no available "
                                                         "versions (version 1: "), (r.url, r.text)
        assert "model.onnx" in error
    for r in version_answers(server.url, 1):  # the version itself: Triton's 503 (Despina's words say why)
        assert r.status_code == 503 and "version 1 failed to load: " in r.json()["error"], (r.url, r.text)


PY_CONFIG = """
name: "py"
backend: "python"
max_batch_size: 4
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
PY_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if BROKEN:
            raise RuntimeError("boom")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X")
                                                            .as_numpy())]) for r in requests]
"""


def test_an_unload_of_a_model_whose_load_failed_keeps_its_error_and_the_server_not_ready(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    # Triton 2.51 (strict readiness, its default): the unload succeeds, yet the version's load error stays
    # its state's reason in the index, and the server stays not ready, until a load of it succeeds
    repo = tmp_path / "repo"
    (repo / "py" / "1").mkdir(parents=True)
    (repo / "py" / "config.pbtxt").write_text(PY_CONFIG)
    (repo / "py" / "1" / "model.py").write_text("BROKEN = True\n" + PY_MODEL)
    server = serve(repo, "--model-control-mode", "explicit", env={"DESPINA_STRICT_READINESS": "true"})
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))

    def rows() -> list[tuple[str, str]]:
        return [(r["state"], r["reason"]) for r in client.get_model_repository_index() if r["name"] == "py"]

    def never_ready() -> bool:  # (the gateways learn of a load or unload a moment after it answers)
        for _ in range(20):
            if client.is_server_ready():
                return False
            time.sleep(0.1)
        return True

    try:
        with pytest.raises(InferenceServerException, match="boom"):
            client.load_model("py")
        wait_until(lambda: not client.is_server_ready(), 5, what="the failed model known to the gateway")
        [(state, why)] = rows()
        assert state == "UNAVAILABLE" and "RuntimeError: boom" in why
        client.unload_model("py")
        assert rows() == [("UNAVAILABLE", why)]
        assert never_ready() and not client.is_model_ready("py")
        (repo / "py" / "1" / "model.py").write_text("BROKEN = False\n" + PY_MODEL)  # fixed: it loads
        client.load_model("py")
        assert client.is_model_ready("py")
        wait_until(client.is_server_ready, 5, what="the server ready")
        client.unload_model("py")  # the unload of a model that served: "unloaded", and ready
        assert rows() == [("UNAVAILABLE", "unloaded")]
        wait_until(client.is_server_ready, 5, what="the server ready")
    finally:
        client.close()


def test_a_model_deleted_from_a_polled_repository_leaves_the_index(serve: Callable[..., Server],
                                                                   tmp_path: Path) -> None:
    # Triton's index lists the repository's folders only (RepositoryIndex walks them): a model deleted
    # from it is unloaded and not listed, not even UNAVAILABLE "unloaded"
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", {1: 0})
    mlp_folder(repo, "other", {1: 0})
    server = serve(repo, *POLL, wait_models=("mlp", "other"))
    shutil.rmtree(repo / "mlp")
    wait_until(lambda: all(r["name"] != "mlp" for r in index(server.url)), 30, what="mlp to leave the index")
    assert [r["name"] for r in index(server.url)] == ["other"]
    r = infer(server.url)
    assert r.status_code in (400, 404) and "'mlp'" in r.json()["error"], r.text


def test_the_dropped_versions_are_bounded_and_refused_as_not_ready() -> None:
    e = CatalogEntry("m", "/repo/m", {}, (40,))
    for v in range(1, 40):
        e = CatalogEntry("m", "/repo/m", {}, (40,), dropped=drop(e, {v: f"bad {v}"}, (40,)))
    assert list(e.dropped) == list(range(40 - RETIRED_KEPT, 40)) and e.dropped[39] == "bad 39"
    assert 39 not in drop(e, {}, (39,)) and list(drop(e, {30: "again"}, ()))[-1] == 30
    assert CatalogEntry.loads(e.dumps()) == e
    assert "dropped" not in orjson.loads(CatalogEntry("m", "/repo/m", {}, (1,)).dumps())
    refused = version_refused(e, 39)
    assert isinstance(refused, Unavailable) and refused.message == "Request for unknown model: 'm' version 39 " \
                                                                   "is not at ready state"
    refused = version_refused(e, 99)
    assert isinstance(refused, NotFound) and refused.message == "Request for unknown model: 'm' version 99 is not found"


def test_a_transition_drops_failed_versions_and_takes_back_those_that_load_again() -> None:
    old = CatalogEntry("m", "/repo/m", {}, (1, 2, 3), revisions={1: "a", 2: "b", 3: "c"},
                       failed={2: "bad 2", 3: "the new files failed to load; the previous ones serve: bad 3"})
    new = CatalogEntry("m", "/repo/m", {}, (4,), revisions={4: "d"})
    serving = {1, 3}  # version 3's earlier files serve: it is unloaded (retired), not a failed record
    e = transition(old, new, LOADED, lambda v: v in serving)
    assert e.dropped == {2: "bad 2"} and 3 in e.retired and 3 not in e.dropped
    # version 2 again, in new files: loaded, no longer a failed record
    again = transition(e, CatalogEntry("m", "/repo/m", {}, (2, 4), revisions={2: "b2", 4: "d"}), LOADED,
                       lambda v: v == 4)
    assert again.dropped == {} and 2 in again.versions


FLAKY_MODEL = """
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        here = Path({here!r})
        with open(here / "inits", "a") as f:
            f.write("x")
        if (here / "fail").exists():
            raise RuntimeError("flaky: its resource is missing")

    def execute(self, requests):
        return []
"""


def test_a_load_of_unchanged_files_tries_a_failed_model_again_and_leaves_a_loaded_one_be(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """As Triton 2.51's: a model whose load failed (initialize raised: a resource it needs was missing) is
    tried again by a plain load of the same files, which now succeeds; a plain load of a model that serves,
    its files unchanged, changes nothing (initialize is not called again). Despina's worker remembered the
    failure of those files and the load answered 400 with the first error again."""
    repo = tmp_path / "repo"
    (repo / "flaky" / "1").mkdir(parents=True)
    (repo / "flaky" / "1" / "model.py").write_text(FLAKY_MODEL.format(here=str(tmp_path)))
    (repo / "flaky" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\ninput [ { name: "IN", data_type: TYPE_INT32, dims: [ 3 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 3 ] } ]\n')
    server = serve(repo, "--model-control-mode", "explicit")
    inits = tmp_path / "inits"

    def load() -> httpx.Response:
        return httpx.post(f"{server.url}/v2/repository/models/flaky/load", timeout=60)

    (tmp_path / "fail").touch()
    r = load()
    assert r.status_code == 400 and "its resource is missing" in r.json()["error"], r.text
    (tmp_path / "fail").unlink()
    r = load()
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/v2/models/flaky/ready").status_code == 200
    assert inits.read_text() == "xx"
    assert load().status_code == 200
    assert [(r["name"], r["state"]) for r in index(server.url)] == [("flaky", "READY")]
    assert inits.read_text() == "xx"  # not loaded again: nothing changed


def test_a_load_tries_failed_versions_again_by_moving_tries() -> None:
    """try_again(): the versions a load loads that failed with the same files lose their failure and the
    entry's tries moves, which workers know failures by (attempt()); nothing else moves anything."""
    old = CatalogEntry("m", "/repo/m", {}, (1, 2), revisions={1: "a", 2: "b"}, failed={2: "bad 2"})
    e = try_again(transition(old, replace(old, failed={}), LOADED, lambda v: v == 1))
    assert e.failed == {} and e.tries == 1 and (e.attempt(1), e.attempt(2)) == ("a/1", "b/1")
    assert old.attempt(2) == "b" and CatalogEntry.loads(e.dumps()) == e
    assert try_again(e) is e and transition(e, replace(old, failed={}), LOADED, lambda v: True).tries == 1


STEP_MODEL = """
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if Path({fail!r}).exists():
            raise RuntimeError("step: its resource is missing")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(
            r, "IN").as_numpy() * 2)]) for r in requests]
"""


def test_an_ensemble_load_tries_its_failed_step_again(serve: Callable[..., Server], tmp_path: Path) -> None:
    """As Triton 2.51's: the load of an ensemble loads its steps, and a step whose own load failed earlier
    (initialize raised: a resource it needs was missing) is tried again with it, and now loads; the
    ensemble serves. Despina's took the failed step for loaded and answered 400 "ensemble 'double2' cannot
    serve: step 1 (model 'double'): model 'double' failed to load"."""
    repo = tmp_path / "repo"
    (repo / "double" / "1").mkdir(parents=True)
    (repo / "double" / "1" / "model.py").write_text(STEP_MODEL.format(fail=str(tmp_path / "fail")))
    (repo / "double" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\ninput [ { name: "IN", data_type: TYPE_INT32, dims: [ 3 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 3 ] } ]\n')
    (repo / "double2" / "1").mkdir(parents=True)
    (repo / "double2" / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 4\ninput [ { name: "X", data_type: TYPE_INT32, dims: [ 3 ] } ]\n'
        'output [ { name: "Y", data_type: TYPE_INT32, dims: [ 3 ] } ]\nensemble_scheduling { step [ {\n'
        '  model_name: "double" model_version: -1 input_map { key: "IN" value: "X" }\n'
        '  output_map { key: "OUT" value: "Y" } } ] }\n')
    server = serve(repo, "--model-control-mode", "explicit")

    def load(name: str) -> httpx.Response:
        return httpx.post(f"{server.url}/v2/repository/models/{name}/load", timeout=60)

    (tmp_path / "fail").touch()
    r = load("double")
    assert r.status_code == 400 and "its resource is missing" in r.json()["error"], r.text
    (tmp_path / "fail").unlink()
    r = load("double2")
    assert r.status_code == 200, r.text
    assert [(r["name"], r["state"]) for r in index(server.url)] == [("double", "READY"), ("double2", "READY")]
    r = httpx.post(f"{server.url}/v2/models/double2/infer", json={
        "inputs": [{"name": "X", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]}]}, timeout=30)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6], r.text
