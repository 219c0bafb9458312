"""Triton's repository API through tritonclient, unchanged: explicit mode, versions, uploads, refusals."""
from __future__ import annotations

import asyncio
import base64
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import redis
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina.contract.catalog import CatalogEntry
from despina.contract.errors import ConfigError, DespinaError
from despina.contract.keys import Keys
from despina.control.plane import ControlPlane
from despina.control.repository import load_model, read_model
from despina.examples import build_add_sub, build_mlp
from despina.redis_client import connect
from despina.registry import LocalRegistry
from despina.settings import Settings

from .conftest import Server, stop_server
from .control_support import MLP_CONFIG, ROW, expected, index, infer, mlp_folder, wait_until


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    mlp_folder(root, "mlp", {1: 0, 2: 1}, extra="version_policy { all { } }")
    (root / "add_sub" / "1").mkdir(parents=True)
    build_add_sub(root / "add_sub" / "1" / "model.onnx")
    return root


def test_explicit_mode_load_unload_and_index(serve: Callable[..., Server], repo: Path) -> None:
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "add_sub",
                   wait_models=("add_sub",))
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        assert client.is_model_ready("add_sub") and not client.is_model_ready("mlp")
        assert httpx.get(f"{server.url}/v2/models/mlp/config").status_code == 404  # not loaded yet
        assert {r["name"]: r for r in client.get_model_repository_index()}["mlp"] == {"name": "mlp"}

        client.load_model("mlp")
        assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
        rows = [(r["name"], r.get("version"), r.get("state")) for r in client.get_model_repository_index()]
        assert ("mlp", "1", "READY") in rows and ("mlp", "2", "READY") in rows
        # as Triton writes the index: a row without a reason has no "reason" (it was "reason": "")
        assert {"name": "mlp", "version": "1", "state": "READY"} in client.get_model_repository_index()
        assert [r["name"] for r in index(server.url, ready=True)] == ["add_sub", "mlp", "mlp"]

        # several versions serve; the default is the highest READY one
        for version, seed in ((1, 0), (2, 1)):
            r = infer(server.url, version=version)
            assert r.status_code == 200 and r.json()["model_version"] == str(version)
            assert np.allclose(r.json()["outputs"][0]["data"], expected(seed), atol=1e-4)
        assert infer(server.url).json()["model_version"] == "2"

        client.unload_model("mlp")
        assert not client.is_model_ready("mlp")
        rows = {(r["name"], r.get("version")): r for r in client.get_model_repository_index()}
        assert rows[("mlp", "2")]["state"] == "UNAVAILABLE" and rows[("mlp", "2")]["reason"] == "unloaded"
        r = infer(server.url)
        # Triton's 404 and words for a model it has unloaded (it was a 400)
        assert r.status_code == 404 and "Request for unknown model: 'mlp' has no available versions" in r.json()["error"]
        for path in ("", "/config"):  # its metadata and config too, as Triton's
            r = httpx.get(f"{server.url}/v2/models/mlp{path}")
            assert r.status_code == 404 and "'mlp' has no available versions" in r.json()["error"], (path, r.text)
        r = httpx.get(f"{server.url}/v2/models/mlp/versions/2")  # a version it unloaded: Triton's 503
        assert r.status_code == 503 and "'mlp' version 2 is not at ready state" in r.json()["error"], r.text

        # a config override (Triton's `config` parameter): only version 1 this time
        override = {"name": "mlp", "backend": "onnxruntime", "max_batch_size": 4,
                    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [256]}],
                    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [10]}],
                    "version_policy": {"specific": {"versions": [1]}}}
        client.load_model("mlp", config=orjson.dumps(override).decode())
        assert client.get_model_config("mlp")["max_batch_size"] == 4
        assert infer(server.url).json()["model_version"] == "1"
        # as Triton's: a load without `config`, its files unchanged, keeps the override (it read config.pbtxt)
        client.load_model("mlp")
        assert client.get_model_config("mlp")["max_batch_size"] == 4
        assert infer(server.url).json()["model_version"] == "1"
        client.unload_model("mlp")  # an unload forgets it
        client.load_model("mlp")
        assert client.get_model_config("mlp")["max_batch_size"] == 8
        client.load_model("mlp", config=orjson.dumps(override).decode())

        # one broken version of three: the load says so, the others serve
        (repo / "mlp" / "3").mkdir()
        (repo / "mlp" / "3" / "model.onnx").write_bytes(b"not onnx")
        with pytest.raises(InferenceServerException, match="failed to load 'mlp' version 3") as failed:
            client.load_model("mlp")  # the files changed: read again, without the override
        assert failed.value.status() == "400"  # as Triton's: the files are at fault, a retry will not do
        # the load answers as soon as version 3 failed; version 2 may still be coming up
        deadline = time.monotonic() + 10
        while not client.is_model_ready("mlp", "2") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.is_model_ready("mlp", "2") and not client.is_model_ready("mlp", "3")
        assert infer(server.url).json()["model_version"] == "2"
        row = next(r for r in client.get_model_repository_index() if r.get("version") == "3")
        assert row["state"] == "UNAVAILABLE" and "model.onnx" in row["reason"]

        with pytest.raises(InferenceServerException, match="no model 'nope'"):
            client.load_model("nope")
        client.unload_model("nope")  # as Triton's: unloading what is not loaded succeeds (it was a 404)
    finally:
        client.close()


def test_load_can_carry_the_model_files(serve: Callable[..., Server], repo: Path) -> None:
    # tritonclient.http's load_model(files=...) cannot send them (it puts bytes into json.dumps), so
    # the request is made as Triton documents it: base64 contents under "file:<version>/<name>"
    server = serve(repo, "--model-control-mode", "explicit")
    config = {"name": "uploaded", "backend": "onnxruntime", "max_batch_size": 8}
    onnx = (repo / "mlp" / "1" / "model.onnx").read_bytes()
    body = {"parameters": {"config": orjson.dumps(config).decode(),
                           "file:1/model.onnx": base64.b64encode(onnx).decode()}}
    r = httpx.post(f"{server.url}/v2/repository/models/uploaded/load", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert not (repo / "uploaded").exists()   # as Triton's: loaded from the files, never written to the registry
    r = infer(server.url, "uploaded")
    assert r.status_code == 200 and np.allclose(r.json()["outputs"][0]["data"], expected(0), atol=1e-4)

    r = httpx.post(f"{server.url}/v2/repository/models/other/load",
                   json={"parameters": {"file:1/model.onnx": "AAAA"}}, timeout=30)
    assert r.status_code == 400 and "need 'config'" in r.json()["error"]
    bad = {"parameters": {**body["parameters"],
                          "config": '{"name": "uploaded", "backend": "onnxruntime", "max_batch_size": -1}'}}
    r = httpx.post(f"{server.url}/v2/repository/models/uploaded/load", json=bad, timeout=30)
    assert r.status_code == 400 and "max_batch_size" in r.json()["error"]
    assert infer(server.url, "uploaded").status_code == 200   # a failed reload leaves it serving

    # files that fail the load leave the repository as it was (they used to be written there, and stay)
    before = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*"))
    garbage = {"config": orjson.dumps({"backend": "onnxruntime", "max_batch_size": 4}).decode(),
               "file:1/model.onnx": base64.b64encode(b"garbage").decode(),
               "file:1/extra.txt": base64.b64encode(b"new").decode()}
    for name in ("uploaded", "fresh"):
        r = httpx.post(f"{server.url}/v2/repository/models/{name}/load", json={"parameters": garbage},
                       timeout=30)
        assert r.status_code == 400 and "model.onnx" in r.json()["error"], r.text
    assert sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*")) == before
    assert infer(server.url, "uploaded").status_code == 200
    httpx.post(f"{server.url}/v2/repository/models/uploaded/unload", timeout=30).raise_for_status()
    # an unloaded model whose load fails says why in its answer; as Triton 2.51's, a model made only of a
    # load's files is not in the index, loaded or not
    r = httpx.post(f"{server.url}/v2/repository/models/uploaded/load", json=bad, timeout=30)
    assert r.status_code == 400 and "max_batch_size" in r.json()["error"]
    assert "uploaded" not in [r["name"] for r in httpx.post(f"{server.url}/v2/repository/index").json()]
    assert httpx.post(f"{server.url}/v2/repository/models/uploaded/load", json=body, timeout=60).status_code == 200
    # a load without files reads the repository, which has no such model (Triton's fails too)
    r = httpx.post(f"{server.url}/v2/repository/models/uploaded/load", timeout=60)
    assert r.status_code in (400, 404) and "no model 'uploaded'" in r.json()["error"], r.text


def test_a_load_with_files_and_a_config_naming_no_backend_finds_it_from_the_files(
        serve: Callable[..., Server], repo: Path) -> None:
    # as a config.pbtxt or a config override alone may leave platform and backend out (auto-complete
    # finds them from the model file), so may one sent with the files: it answered 400 "neither field
    # 'platform' nor field 'backend' is set" before the files were written
    server = serve(repo, "--model-control-mode", "explicit")
    onnx = (repo / "mlp" / "1" / "model.onnx").read_bytes()
    body = {"parameters": {"config": '{"max_batch_size": 8}',
                           "file:3/model.onnx": base64.b64encode(onnx).decode()}}
    r = httpx.post(f"{server.url}/v2/repository/models/uploaded/load", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert not (repo / "uploaded").exists()
    r = infer(server.url, "uploaded")
    assert r.status_code == 200 and r.json()["model_version"] == "3"
    assert np.allclose(r.json()["outputs"][0]["data"], expected(0), atol=1e-4)
    # a config whose name is not the model's is still refused, and its files taken back out
    body["parameters"]["config"] = '{"name": "other", "max_batch_size": 8}'
    body["parameters"]["file:4/model.onnx"] = body["parameters"].pop("file:3/model.onnx")
    r = httpx.post(f"{server.url}/v2/repository/models/uploaded/load", json=body, timeout=60)
    assert r.status_code == 400 and "field 'name' is 'other'" in r.json()["error"], r.text
    assert not (repo / "uploaded").exists() and infer(server.url, "uploaded").status_code == 200


def test_a_file_entry_that_cannot_be_a_file_of_the_model_is_a_400(serve: Callable[..., Server], repo: Path) -> None:
    # these used to answer 500 ("control plane: load failed: embedded null byte", "[Errno 21] Is a directory",
    # ...), and a name too long left its new version folder behind, empty: the next load took it for the latest.
    # (The files given are the model alone now: a file "1" leaves it no version, a folder "model.onnx" no
    # model file)
    server = serve(repo, "--model-control-mode", "explicit")
    config = orjson.dumps({"name": "add_sub", "platform": "onnxruntime_onnx", "max_batch_size": 8}).decode()
    before = sorted(p.relative_to(repo).as_posix() for p in (repo / "add_sub").rglob("*"))
    for path, words in (("1/a\0b", "invalid file path"), ("1", "no numeric version folder"),
                        ("1/model.onnx/x", "model.onnx"), ("2/" + "x" * 300, "File name too long")):
        r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load", timeout=30,
                       json={"parameters": {"config": config, f"file:{path}": "AAAA"}})
        assert r.status_code == 400 and words in r.json()["error"], (path, r.text)
    assert sorted(p.relative_to(repo).as_posix() for p in (repo / "add_sub").rglob("*")) == before
    assert httpx.post(f"{server.url}/v2/repository/models/add_sub/load", timeout=60).status_code == 200


def test_a_file_entry_in_a_folder_no_version_is_read_from_is_a_400(serve: Callable[..., Server],
                                                                   repo: Path) -> None:
    # "file:01/model.onnx" (or 00, a number past 18 digits) was written and the load answered 200, the
    # model serving on from its old versions: the file sent was never used, and the folder stayed behind
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "add_sub", wait_models=("add_sub",))
    config = orjson.dumps({"platform": "onnxruntime_onnx", "max_batch_size": 8}).decode()
    onnx = base64.b64encode((repo / "add_sub" / "1" / "model.onnx").read_bytes()).decode()
    before = sorted(p.relative_to(repo).as_posix() for p in (repo / "add_sub").rglob("*"))
    for folder in ("01", "00", "1" * 19):
        r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load", timeout=30,
                       json={"parameters": {"config": config, f"file:{folder}/model.onnx": onnx}})
        assert r.status_code == 400 and f"'{folder}' is not a version folder" in r.json()["error"], r.text
    assert sorted(p.relative_to(repo).as_posix() for p in (repo / "add_sub").rglob("*")) == before
    # folders beside the versions stay allowed: warmup data, a sequence model's initial state
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load", timeout=60,
                   json={"parameters": {"config": config, "file:2/model.onnx": onnx,
                                        "file:warmup/a.bin": base64.b64encode(b"0000").decode()}})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/v2/models/add_sub/versions/2/ready").status_code == 200


def test_a_load_parameter_triton_does_not_know_is_refused(serve: Callable[..., Server], repo: Path) -> None:
    # as Triton's ("Unrecognized load parameter"): a misspelt "config" used to be ignored, and the model
    # loaded from the repository's own config with a 200
    server = serve(repo, "--model-control-mode", "explicit")
    override = orjson.dumps({"backend": "onnxruntime", "max_batch_size": 4}).decode()
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load",
                   json={"parameters": {"confg": override}}, timeout=60)
    assert r.status_code == 400 and "unrecognized load parameter 'confg'" in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/v2/models/add_sub/ready", timeout=10).status_code == 400
    for params in ([], 0, "", False, [{"config": override}]):  # not an object: not taken as none
        for action in ("load", "unload"):
            r = httpx.post(f"{server.url}/v2/repository/models/add_sub/{action}", json={"parameters": params},
                           timeout=60)
            assert r.status_code == 400 and "'parameters' must be a JSON object" in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/v2/models/add_sub/ready", timeout=10).status_code == 400
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load",
                   json={"parameters": {"config": override}}, timeout=60)
    assert r.status_code == 200, r.text


PYTHON_MODEL = """
import time


class TritonPythonModel:
    def initialize(self, args):
        {body}

    def execute(self, requests):
        return []
"""
PYTHON_CONFIG = {"backend": "python", "max_batch_size": 4,
                 "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [3]}],
                 "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [3]}]}


def test_files_that_fail_on_the_workers_are_taken_back_out_too(serve: Callable[..., Server], repo: Path) -> None:
    # the control plane reads these files well; the workers' load fails (initialize raises). The files
    # used to stay: the next load or restart read them, and a model that served was gone
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "add_sub",
                   wait_models=("add_sub",))
    source = PYTHON_MODEL.format(body="raise RuntimeError('no weights here')")
    params = {"config": orjson.dumps(PYTHON_CONFIG).decode(),
              "file:1/model.py": base64.b64encode(source.encode()).decode()}
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    for name in ("fresh", "add_sub"):
        r = httpx.post(f"{server.url}/v2/repository/models/{name}/load", json={"parameters": params},
                       timeout=60)
        assert r.status_code == 400 and "no weights here" in r.json()["error"], r.text
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before
    # add_sub serves on from its own files, and loads again from them
    add = {"inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
                      for n in ("a", "b")]}
    r = httpx.post(f"{server.url}/v2/models/add_sub/infer", json=add, timeout=30)
    assert r.status_code == 200 and [2, 4, 6, 8] in [o["data"] for o in r.json()["outputs"]], r.text
    assert httpx.post(f"{server.url}/v2/repository/models/add_sub/load", timeout=60).status_code == 200
    assert httpx.post(f"{server.url}/v2/models/add_sub/infer", json=add, timeout=30).status_code == 200
    # as Triton 2.51's, the index lists no model made only of a load's files, one that failed to load too
    assert "fresh" not in [r["name"] for r in index(server.url)]


def test_a_config_override_that_fails_on_the_workers_leaves_the_old_config_serving(
        serve: Callable[..., Server], repo: Path) -> None:
    # the old files served on, but the catalog kept the config that failed: the model's metadata and
    # config were the new one's, its requests were checked against it, its statistics were refused and
    # its index row said it failed. Triton 2.51 keeps the old config with the old model, as seen
    (repo / "picky" / "1").mkdir(parents=True)
    picky = "import json; assert json.loads(args['model_config'])['max_batch_size'] == 4, 'only 4'"
    (repo / "picky" / "1" / "model.py").write_text(PYTHON_MODEL.format(body=picky))
    (repo / "picky" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\ninput [ { name: "IN", data_type: TYPE_INT32, dims: [ 3 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 3 ] } ]\n')
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "picky", wait_models=("picky",))
    override = {**PYTHON_CONFIG, "max_batch_size": 2,
                "input": [{"name": "OTHER", "data_type": "TYPE_INT32", "dims": [3]}]}
    r = httpx.post(f"{server.url}/v2/repository/models/picky/load",
                   json={"parameters": {"config": orjson.dumps(override).decode()}}, timeout=60)
    assert r.status_code == 400 and "only 4" in r.json()["error"], r.text
    meta = httpx.get(f"{server.url}/v2/models/picky", timeout=10).json()
    assert meta["versions"] == ["1"] and [i["name"] for i in meta["inputs"]] == ["IN"], meta
    assert httpx.get(f"{server.url}/v2/models/picky/config", timeout=10).json()["max_batch_size"] == 4
    assert httpx.get(f"{server.url}/v2/models/picky/stats", timeout=10).status_code == 200
    assert {"name": "picky", "version": "1", "state": "READY"} in index(server.url)


def test_a_load_and_an_unload_sent_together_both_succeed_in_turn(serve: Callable[..., Server],
                                                                  repo: Path) -> None:
    # as Triton's: they are serialised. The load used to answer 503 "is unloaded" when the unload
    # landed while it waited for the workers
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(PYTHON_MODEL.format(body="time.sleep(2)"))
    (repo / "slow" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "IN", data_type: TYPE_INT32, dims: [ 3 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 3 ] } ]\n')
    server = serve(repo, "--model-control-mode", "explicit")
    url = f"{server.url}/v2/repository/models/slow"
    with ThreadPoolExecutor(2) as pool:
        load = pool.submit(httpx.post, f"{url}/load", timeout=60)
        time.sleep(0.5)  # the load is waiting for the workers (initialize takes 2 s)
        unload = pool.submit(httpx.post, f"{url}/unload", timeout=60)
        assert load.result().status_code == 200, load.result().text
        assert unload.result().status_code == 200, unload.result().text
    assert httpx.get(f"{server.url}/v2/models/slow/ready", timeout=10).status_code == 400
    assert {r["name"]: r for r in index(server.url)}["slow"]["reason"] == "unloaded"


def test_a_load_that_no_worker_has_room_for_fails_at_once_when_asked(
        serve: Callable[..., Server], repo: Path) -> None:
    # Despina's extension of the load API: "fail_without_room" answers at once when memory alone keeps the
    # model off every worker (SageMaker's multi-model routes use it for their 507), instead of waiting
    # for a worker with room until the load timeout
    big = repo / "big"
    shutil.copytree(repo / "add_sub", big)
    (big / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n'
                                      'parameters { key: "memory_mb" value { string_value: "100000" } }\n')
    server = serve(repo, "--model-control-mode", "explicit", env={"DESPINA_WORKER_MEMORY_MB": "512"})
    started = time.monotonic()
    r = httpx.post(f"{server.url}/v2/repository/models/big/load",
                   json={"parameters": {"fail_without_room": True}}, timeout=60)
    assert r.status_code == 503 and "does not fit on any worker" in r.json()["error"], r.text
    assert "MiB free, the model needs 100000 MiB" in r.json()["error"]
    assert time.monotonic() - started < 20  # not the load timeout (300 s)
    r = httpx.post(f"{server.url}/v2/repository/models/big/load",
                   json={"parameters": {"fail_without_room": "yes"}}, timeout=30)
    assert r.status_code == 400 and "fail_without_room" in r.json()["error"]
    # a model that fits loads as ever with it
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load",
                   json={"parameters": {"fail_without_room": True}}, timeout=60)
    assert r.status_code == 200, r.text


def test_an_instance_count_no_worker_can_hold_is_refused_by_placement(serve: Callable[..., Server],
                                                                     repo: Path) -> None:
    # each instance holds its own copy of the model: the footprint counts them (a count of 100000 used to
    # be placed as one model's files, and the worker built sessions until memory ran out)
    server = serve(repo, "--model-control-mode", "explicit", env={"DESPINA_WORKER_MEMORY_MB": "512"})
    config = {"backend": "onnxruntime", "instance_group": [{"count": 40, "kind": "KIND_CPU"}]}
    params = {"config": orjson.dumps(config).decode(), "fail_without_room": True}
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load", json={"parameters": params}, timeout=60)
    assert r.status_code == 503 and "does not fit on any worker" in r.json()["error"], r.text
    assert "the model needs 640 MiB" in r.json()["error"]   # 40 instances of 16 MiB and the file's bytes
    config["instance_group"] = [{"count": 2, "kind": "KIND_CPU"}]
    params["config"] = orjson.dumps(config).decode()
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load", json={"parameters": params}, timeout=60)
    assert r.status_code == 200, r.text


GATED_MODEL = """
import json, os, time

GATE = "GATE_DIR"


class TritonPythonModel:
    def initialize(self, args):
        size = json.loads(args["model_config"])["max_batch_size"]
        self.mark = os.path.join(GATE, f"{size}-{os.getpid()}")
        open(self.mark + ".started", "w").close()
        deadline = time.monotonic() + 60  # until the test lets the load of its config go on
        while not os.path.exists(os.path.join(GATE, f"go-{size}")) and time.monotonic() < deadline:
            time.sleep(0.05)

    def finalize(self):
        open(self.mark + ".finalized", "w").close()

    def execute(self, requests):
        return []
"""


def test_a_load_no_longer_wanted_stops(serve: Callable[..., Server], repo: Path, tmp_path: Path) -> None:
    # new files while the old ones load: both loads used to run to the end (the stale one could finish
    # last and serve); an unloaded model's load ran to the end too
    config = ('backend: "python"\nmax_batch_size: {}\ninstance_group [ {{ count: 2, kind: KIND_CPU }} ]\n'
              'input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 3 ] }} ]\n'
              'output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 3 ] }} ]\n')
    gate = tmp_path / "gate"  # each load's initialize waits until the test lets its config's go on
    gate.mkdir()
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(GATED_MODEL.replace("GATE_DIR", str(gate)))
    (repo / "slow" / "config.pbtxt").write_text(config.format(4))
    server = serve(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2", health="live")
    wait_until(lambda: "loading slow version 1" in server.logs(), 20, what="slow to start loading")
    (repo / "slow" / "config.pbtxt").write_text(config.format(8))
    wait_until(lambda: "stopped loading slow version 1: no longer wanted" in server.logs(), 30,
               what="the first load to stop")

    def unloaded() -> bool:  # what the stopped load made is unloaded once its thread is done
        started, ended = ({p.stem for p in gate.glob(f"4-*.{s}")} for s in ("started", "finalized"))
        return bool(started) and started == ended

    (gate / "go-4").touch()
    # had it gone on, it would serve, and be unloaded only once the new load (still held) is done
    wait_until(unloaded, 30, what="the stopped load's instances to be unloaded")
    assert "loaded slow version 1" not in server.logs(), server.logs()[-3000:]
    (gate / "go-8").touch()
    wait_until(lambda: "loaded slow version 1" in server.logs(), 30, what="slow to load")
    assert server.logs().count("loaded slow version 1") == 1
    assert httpx.get(f"{server.url}/v2/models/slow/config").json()["max_batch_size"] == 8


def test_load_and_unload_are_refused_outside_explicit_mode(serve: Callable[..., Server], repo: Path) -> None:
    server = serve(repo, wait_models=("mlp",))  # mode none: everything loaded at start
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        for call in (client.load_model, client.unload_model):
            with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
                call("mlp")
        assert client.is_model_ready("mlp")
        assert "model_repository" in client.get_server_metadata()["extensions"]
        r = httpx.post(f"{server.url}/v2/repository/index", content=b'{"ready": 3}')
        assert r.status_code == 400
    finally:
        client.close()
    r = httpx.post(f"{server.url}/fn/mlp", json=ROW)
    assert r.status_code == 200


def test_poll_on_a_local_folder(serve: Callable[..., Server], repo: Path) -> None:
    (repo / "mlp" / "2").rename(repo / "spare")      # start with version 1 only
    server = serve(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2",
                   wait_models=("mlp", "add_sub"))
    def ready_versions() -> list[str]:
        return [r["version"] for r in index(server.url, ready=True) if r["name"] == "mlp"]

    assert ready_versions() == ["1"]
    (repo / "spare").rename(repo / "mlp" / "2")      # a new version appears
    wait_until(lambda: ready_versions() == ["1", "2"], 20, what="version 2 to load")
    assert infer(server.url).json()["model_version"] == "2"
    shutil.rmtree(repo / "add_sub")                  # a model leaves the repository
    wait_until(lambda: all(r["name"] != "add_sub" for r in index(server.url)), 20, what="add_sub to go")
    assert httpx.get(f"{server.url}/v2/models/add_sub").status_code == 404


def test_a_version_folder_with_a_leading_zero_is_ignored(serve: Callable[..., Server], repo: Path) -> None:
    # as Triton's VersionsToLoad ("ignore version directory '02' which contains leading zeros"): "02" used to
    # be version 2, the latest, and its load looked for the folder "2", which is not there
    (repo / "mlp" / "config.pbtxt").write_text(MLP_CONFIG.format(name="mlp", extra="", delay_us=100))
    (repo / "mlp" / "2").rename(repo / "mlp" / "02")
    assert load_model(repo / "mlp").versions == (1,)
    server = serve(repo, "--model-control-mode", "explicit")
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
    assert r.status_code == 200, r.text
    assert [(r.get("version"), r.get("state")) for r in index(server.url) if r["name"] == "mlp"] == [("1", "READY")]
    r = infer(server.url)
    assert r.json()["model_version"] == "1" and np.allclose(r.json()["outputs"][0]["data"], expected(0), atol=1e-4)


def test_a_version_folder_whose_number_no_url_can_name_is_ignored(serve: Callable[..., Server],
                                                                  repo: Path) -> None:
    # a folder "99999999999999999999" (past int64, as Triton's stoll refuses it) used to be the latest
    # version: the catalog could not be written (orjson: "Integer exceeds 64-bit range"), and every tick of
    # the control plane failed from then on, for every model. (The load API's file: entries made one too:
    # they answer 400 now, test_a_file_entry_in_a_folder_no_version_is_read_from_is_a_400.)
    server = serve(repo, "--model-control-mode", "explicit")
    huge, longest = "9" * 20, "1" * 19   # a URL's version has at most 18 digits (gateway/auth.py)
    onnx = (repo / "mlp" / "1" / "model.onnx").read_bytes()
    for v in ("1", huge, longest):
        (repo / "big" / v).mkdir(parents=True)
        (repo / "big" / v / "model.onnx").write_bytes(onnx)
    (repo / "big" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n'
                                               "version_policy { all { } }\n")
    r = httpx.post(f"{server.url}/v2/repository/models/big/load", timeout=60)
    assert r.status_code == 200, r.text
    assert [(r.get("version"), r.get("state")) for r in index(server.url) if r["name"] == "big"] == [("1", "READY")]
    assert infer(server.url, "big").json()["model_version"] == "1"
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load", timeout=60)  # the others load on
    assert r.status_code == 200, r.text
    assert load_model(repo / "big").versions == (1,)


def test_a_config_that_is_not_utf8_leaves_its_model_unavailable_and_the_others_serving(
        serve: Callable[..., Server], repo: Path) -> None:
    # a Latin-1 comment used to raise UnicodeDecodeError out of the control plane's look at the repository:
    # its loop ended without a word, the models after it were never read and the server never got ready.
    # Triton 2.51 serves a model whose comment is Latin-1 ("# caf\xe9 \xff"): its parser skips a comment's
    # bytes; Despina refused it ("config.pbtxt is not UTF-8 text (line 1, byte 5)"). Such a byte in a value
    # is refused still (Triton loads it and logs "String field ... contains invalid UTF-8 data").
    shutil.copytree(repo / "mlp", repo / "latin")
    (repo / "latin" / "config.pbtxt").write_bytes(
        b"# caf\xe9 \xff\n" + MLP_CONFIG.format(name="latin", extra="", delay_us=100).encode())
    assert load_model(repo / "latin").config["name"] == "latin"
    shutil.copytree(repo / "mlp", repo / "latin_value")
    data = (b"# caf\xe9\n" + MLP_CONFIG.format(name="latin_value", extra="", delay_us=100).encode()
            + b'parameters { key: "k" value { string_value: "caf\xe9" } }\n')
    (repo / "latin_value" / "config.pbtxt").write_bytes(data)
    bad = data.rindex(b"\xe9")  # the value's byte, not the comment's
    line = data.count(b"\n", 0, bad) + 1
    with pytest.raises(ConfigError, match=rf"^model 'latin_value': config.pbtxt is not UTF-8 text \(line "
                                          rf"{line}, byte {bad}\)$"):
        load_model(repo / "latin_value")
    server = serve(repo, wait_models=("add_sub", "mlp", "latin"))
    row = next(r for r in index(server.url) if r["name"] == "latin_value")
    assert row["state"] == "UNAVAILABLE" and "config.pbtxt is not UTF-8 text" in row["reason"], row


def test_a_config_without_platform_or_backend_gets_the_backend_from_the_model_file(tmp_path: Path) -> None:
    """Triton's auto-complete, as for a folder with no config.pbtxt: in a config.pbtxt or the load API's
    config, by model.onnx or by the config's default_model_filename. An ensemble still needs its platform."""
    folder = tmp_path / "m"
    build_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text("max_batch_size: 8\n")
    config = load_model(folder).config
    assert (config["backend"], config["platform"], config["max_batch_size"]) == ("onnxruntime", "onnxruntime_onnx", 8)
    registry = LocalRegistry(tmp_path)
    assert read_model(registry, registry.model("m"), {"max_batch_size": 2}).config["backend"] == "onnxruntime"

    (folder / "1" / "model.onnx").rename(folder / "1" / "net.onnx")
    (folder / "config.pbtxt").write_text('default_model_filename: "net.onnx"\n')
    assert load_model(folder).config["backend"] == "onnxruntime"
    (folder / "config.pbtxt").write_text('default_model_filename: "net.bin"\n')
    with pytest.raises(ConfigError, match=r"model 'm': neither field 'platform' nor field 'backend' is set, and no "
                                          r"model file Despina recognizes \('net.bin'\)"):
        load_model(folder)

    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "config.pbtxt").write_text(
        'max_batch_size: 8 input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ] '
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] } ] ensemble_scheduling { step [ { model_name: "m" '
        'model_version: -1 input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }')
    with pytest.raises(ConfigError, match="model 'pipe': neither field 'platform' nor field 'backend' is set"):
        load_model(pipe)


def test_model_metadata_lists_the_version_asked_for_else_those_that_serve(serve: Callable[..., Server],
                                                                         repo: Path) -> None:
    # Triton's metadata names the version asked for, else the READY ones: not every version on disk
    (repo / "mlp" / "3").mkdir()
    (repo / "mlp" / "3" / "model.onnx").write_bytes(b"not onnx")
    server = serve(repo, wait_models=("mlp",))
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        wait_until(lambda: next(r for r in client.get_model_repository_index()
                                if r.get("version") == "3")["state"] == "UNAVAILABLE", what="version 3 to fail")
        assert client.get_model_metadata("mlp")["versions"] == ["1", "2"]
        assert client.get_model_metadata("mlp", "1")["versions"] == ["1"]
        for call in (client.get_model_metadata, client.get_model_config):
            with pytest.raises(InferenceServerException, match="version 3 failed to load"):
                call("mlp", "3")
    finally:
        client.close()


def test_a_version_the_specific_policy_names_twice_is_one_version(tmp_path: Path) -> None:
    """Triton's versions are a set: version_policy { specific { versions: [1, 1] } } serves version 1 once
    (the model's metadata listed it twice)."""
    folder = mlp_folder(tmp_path, "mlp", {1: 0, 2: 1}, extra="version_policy { specific { versions: [ 2, 1, 2 ] } }")
    assert load_model(folder).versions == (1, 2)


def test_unloading_and_stopping_leave_no_consumer_in_the_request_streams(
        serve: Callable[..., Server], repo: Path, redis_url: str, key_prefix: str) -> None:
    # a worker's consumer stayed in a stream's group for good after an unload, and after the worker
    # stopped (scaled in, restarted): the control plane deletes only a dead worker's, from what is loaded
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "mlp", wait_models=("mlp",))
    streams = [Keys(key_prefix).request_stream("mlp", v) for v in (1, 2)]
    client = redis.Redis.from_url(redis_url)

    def consumers() -> list[bytes]:
        return [c["name"] for s in streams for c in client.xinfo_consumers(s, "workers")]

    try:
        for version in (1, 2):
            assert infer(server.url, version=version).status_code == 200
        assert consumers()
        assert httpx.post(f"{server.url}/v2/repository/models/mlp/unload", timeout=60).status_code == 200
        wait_until(lambda: not consumers(), what="the worker's consumers to leave the groups")

        assert httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60).status_code == 200
        assert infer(server.url, version=2).status_code == 200
        assert consumers()
        assert stop_server(server) == 0
        assert consumers() == []
    finally:
        client.close()


async def test_loads_of_models_that_do_not_exist_leave_no_lock_behind(tmp_path: Path, redis_url: str,
                                                                       key_prefix: str) -> None:
    """The control plane's lock per model name lives while the name is in use: a client loading and
    unloading names that no model has must not grow it (one lock per name, for good, before)."""
    client = connect(redis_url)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), client)
    try:
        for i in range(50):
            with pytest.raises(DespinaError):
                await plane.commands.load(f"nothing{i}", {}, timeout=5.0)
            await plane.commands.unload(f"nothing{i}", dependents=False, timeout=5.0)
        first = asyncio.ensure_future(plane.commands.load("nothing", {}, timeout=5.0))
        second = asyncio.ensure_future(plane.commands.load("nothing", {}, timeout=5.0))
        await asyncio.wait([first, second])
        assert isinstance(first.exception(), DespinaError) and isinstance(second.exception(), DespinaError)
        assert len(plane.locks) == 0
    finally:
        await client.aclose()


async def test_a_poll_interval_of_0_reads_the_repository_at_start_only(repo: Path, redis_url: str,
                                                                        key_prefix: str) -> None:
    """As in Triton, --repository-poll-secs 0 in poll mode means no polls after the first look. The control
    plane read the repository again and again without a pause instead, a core spent on it for good."""
    client = connect(redis_url)
    settings = Settings(model_repository=str(repo), key_prefix=key_prefix, model_control_mode="poll",
                        repository_poll_secs=0)
    plane = ControlPlane(settings, client)
    try:
        await asyncio.wait_for(plane.registration.run(), 30)  # the registration loop ends after its first look
        assert plane.registration.error == ""
    finally:
        await client.aclose(close_connection_pool=True)


def test_a_reload_serves_a_model_file_replaced_with_one_of_the_same_size_and_time(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """A file's key was its size and mtime: new weights of the same architecture (the same size) put in
    place with their build's time kept (`cp -p`, `rsync -a`, an archive unpacked) looked unchanged, and a
    reload kept serving the old ones. The key now has the change time too, which no copy sets."""
    import os

    model = mlp_folder(tmp_path / "repo") / "1" / "model.onnx"
    for seed in (1, 2):
        build_mlp(tmp_path / f"seed{seed}.onnx", seed=seed)
        os.utime(tmp_path / f"seed{seed}.onnx", ns=(10**18, 10**18))  # both built "at the same time"
    shutil.copy2(tmp_path / "seed1.onnx", model)
    server = serve(tmp_path / "repo", "--model-control-mode", "explicit")
    for seed in (1, 2):
        if seed == 2:
            shutil.copy2(tmp_path / "seed2.onnx", model)  # same size, same mtime, other weights
        assert httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60).status_code == 200
        got = infer(server.url).json()["outputs"][0]["data"]
        assert np.allclose(got, expected(seed), atol=1e-4), seed


def test_a_config_override_is_kept_in_the_catalog() -> None:
    """The catalog in Redis keeps a load's config override: a control plane taking over keeps it too."""
    e = CatalogEntry("m", "/repo/m", {}, (1,), override={"max_batch_size": 4}, override_files="f1")
    assert CatalogEntry.loads(e.dumps()) == e
    assert "override" not in orjson.loads(CatalogEntry("m", "/repo/m", {}, (1,)).dumps())
