"""The load API's `file:` entries, as Triton 2.51 takes them: the files given (with the `config`) are the
model, loaded from a place of Despina's own (Redis); the repository is never written, versions only in
the repository are not loaded, and a later load without files reads the repository again."""
from __future__ import annotations

import base64
import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import redis

from despina.contract.keys import Keys

from .conftest import Server, stop_server
from .control_support import catalog_entry, index, wait_until, worker_hashes

MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * {k})]) for r in requests]
'''
CONFIG = {"name": "m", "backend": "python", "max_batch_size": 4,
          "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [2]}],
          "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [2]}],
          "version_policy": {"all": {}}, "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}
CONFIG_PBTXT = '''name: "m"
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 2 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 2 ] } ]
version_policy { all { } }
instance_group [ { count: 1, kind: KIND_CPU } ]
'''


def make_repo(root: Path) -> Path:
    """Model m, versions 1 and 2 (answering IN * 1 and IN * 2)."""
    for v in (1, 2):
        (root / "m" / str(v)).mkdir(parents=True)
        (root / "m" / str(v) / "model.py").write_text(MODEL.format(k=v))
    (root / "m" / "config.pbtxt").write_text(CONFIG_PBTXT)
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes (a Python model's __pycache__ aside: the interpreter's own)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def files_load(url: str, k: int = 3, version: int = 3, **extra: str) -> httpx.Response:
    params = {"config": orjson.dumps(CONFIG).decode(),
              f"file:{version}/model.py": base64.b64encode(MODEL.format(k=k).encode()).decode(), **extra}
    return httpx.post(f"{url}/v2/repository/models/m/load", json={"parameters": params}, timeout=60)


def ready(url: str) -> list[int]:
    return [v for v in (1, 2, 3) if httpx.get(f"{url}/v2/models/m/versions/{v}/ready", timeout=10).status_code == 200]


def times(url: str, version: int) -> list[int]:
    body = {"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]}
    r = httpx.post(f"{url}/v2/models/m/versions/{version}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0]["data"]


def given_fields(redis_url: str, prefix: str, model: str = "m") -> list[bytes]:
    client = redis.Redis.from_url(redis_url)
    try:
        return sorted(client.hkeys(Keys(prefix).given_files(model)))
    finally:
        client.close()


def test_a_load_with_files_serves_them_alone_and_leaves_the_repository_unchanged(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # Triton 2.51, seen (explicit mode, m with versions 1 and 2, version_policy all): a load with config +
    # file:3/model.py leaves 3 READY and 1, 2 unloaded, the repository untouched; a plain load then serves 1
    # and 2 again. Despina wrote 3/model.py and config.pbtxt into the repository and served 1, 2 and 3
    repo = make_repo(tmp_path / "repo")
    before = tree(repo)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "m", wait_models=("m",),
                   env={"DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    wait_until(lambda: ready(server.url) == [1, 2], what="versions 1 and 2")

    r = files_load(server.url)
    assert r.status_code == 200, r.text
    assert tree(repo) == before
    wait_until(lambda: ready(server.url) == [3], what="version 3 alone")
    assert times(server.url, 3) == [3, 6]
    rows = {r.get("version"): r for r in index(server.url) if r["name"] == "m"}
    assert rows["3"]["state"] == "READY" and rows["1"]["state"] != "READY" and rows["2"]["state"] != "READY"
    assert len(given_fields(redis_url, key_prefix)) == 1   # the file, kept where every worker finds it

    # a load without files reads the repository again; the files given are gone
    assert httpx.post(f"{server.url}/v2/repository/models/m/load", timeout=60).status_code == 200
    wait_until(lambda: ready(server.url) == [1, 2], what="the repository's versions again")
    assert times(server.url, 2) == [2, 4]
    assert given_fields(redis_url, key_prefix) == []

    # files again, then others in their place: those of the first load go once the second serves
    assert files_load(server.url).status_code == 200
    first = given_fields(redis_url, key_prefix)
    r = files_load(server.url, k=5)
    assert r.status_code == 200, r.text
    assert times(server.url, 3) == [5, 10]
    second = given_fields(redis_url, key_prefix)
    assert len(second) == 1 and second != first

    # an unload removes them; a load after it reads the repository
    assert httpx.post(f"{server.url}/v2/repository/models/m/unload", timeout=60).status_code == 200
    assert given_fields(redis_url, key_prefix) == []
    assert httpx.post(f"{server.url}/v2/repository/models/m/load", timeout=60).status_code == 200
    wait_until(lambda: ready(server.url) == [1, 2], what="the repository's versions after the unload")
    assert tree(repo) == before


def test_a_load_with_files_that_fail_keeps_what_served(serve: Callable[..., Server], tmp_path: Path,
                                                      redis_url: str, key_prefix: str) -> None:
    repo = make_repo(tmp_path / "repo")
    before = tree(repo)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "m", wait_models=("m",),
                   env={"DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    assert files_load(server.url).status_code == 200
    kept = given_fields(redis_url, key_prefix)
    broken = base64.b64encode(b"raise RuntimeError('no weights here')\n").decode()
    r = files_load(server.url, version=4, **{"file:4/model.py": broken})
    assert r.status_code == 400 and "no weights here" in r.json()["error"], r.text
    assert times(server.url, 3) == [3, 6] and given_fields(redis_url, key_prefix) == kept
    # errors, as Triton's (its own answers: a 500 "failed to poll from model repository" without config or
    # for a path that climbs out, and a load of the garbage its lenient base64 decoding made of bad base64)
    for params, words in (({"file:3/model.py": "AAAA"}, "need 'config'"),
                          ({"config": orjson.dumps(CONFIG).decode(), "file:3/model.py": "!!!"}, "not base64"),
                          ({"config": orjson.dumps(CONFIG).decode(), "file:../x": "AAAA"}, "invalid file path"),
                          ({"config": orjson.dumps(CONFIG).decode(), "file:3/../../x": "AAAA"}, "invalid file path"),
                          ({"config": orjson.dumps(CONFIG).decode(), "file:/tmp/x": "AAAA"}, "invalid file path"),
                          ({"config": orjson.dumps(CONFIG).decode(), "file:model.py": "AAAA"}, "version")):
        r = httpx.post(f"{server.url}/v2/repository/models/m/load", json={"parameters": params}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"], (params, r.text)
    assert tree(repo) == before and given_fields(redis_url, key_prefix) == kept
    assert times(server.url, 3) == [3, 6]


def test_the_files_given_reach_the_worker_that_takes_the_model_over(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # the files live where any worker reads them, for as long as the model is loaded: a worker that takes
    # the model over from a dead one loads the same files
    repo = make_repo(tmp_path / "repo")
    server = serve(repo, "--workers", "2", "--model-control-mode", "explicit",
                   env={"DESPINA_WORKER_TTL_S": "2", "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    wait_until(lambda: len(worker_hashes(redis_url, key_prefix)) == 2, what="two workers")
    assert files_load(server.url).status_code == 200
    entry = catalog_entry(redis_url, key_prefix, "m")
    assert entry is not None and len(entry.workers) == 1
    victim = entry.workers[0]
    os.kill(orjson.loads(worker_hashes(redis_url, key_prefix)[victim][b"info"])["pid"], signal.SIGKILL)
    wait_until(lambda: (e := catalog_entry(redis_url, key_prefix, "m")) is not None and e.workers
               and victim not in e.workers, 30, what="the model to move")
    wait_until(lambda: ready(server.url) == [3], 30, what="version 3 on the other worker")
    assert times(server.url, 3) == [3, 6]


def test_the_files_given_go_once_nothing_loads_from_them(serve: Callable[..., Server], tmp_path: Path,
                                                        redis_url: str, key_prefix: str) -> None:
    # a reload that failed in one version and serves the repository's others loads nothing from the files
    # given before: they went only at the next load or unload (a load that does not wait, an ensemble's step
    # or a start's --load-model, never removed them)
    repo = make_repo(tmp_path / "repo")
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "m", wait_models=("m",),
                   env={"DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    assert files_load(server.url).status_code == 200
    (repo / "m" / "2" / "model.py").write_text("raise RuntimeError('no weights here')\n")
    r = httpx.post(f"{server.url}/v2/repository/models/m/load", timeout=60)
    assert r.status_code == 400 and "no weights here" in r.text, r.text
    assert times(server.url, 1) == [1, 2]
    assert given_fields(redis_url, key_prefix) == []


def test_a_restart_that_loads_the_repository_removes_the_files_given(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # Triton forgets a load's files at a restart: its --load-model reads the repository. Despina's did too,
    # but kept the files in Redis until the model's next load or unload
    repo = make_repo(tmp_path / "repo")
    env = {"DESPINA_CACHE_DIR": str(tmp_path / "cache")}
    server = serve(repo, "--model-control-mode", "explicit", env=env)
    assert files_load(server.url).status_code == 200
    assert len(given_fields(redis_url, key_prefix)) == 1
    stop_server(server)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "m", wait_models=("m",), env=env)
    wait_until(lambda: ready(server.url) == [1, 2], what="the repository's versions")
    assert times(server.url, 2) == [2, 4]
    wait_until(lambda: given_fields(redis_url, key_prefix) == [], what="the files given to go")


def test_the_index_does_not_list_a_model_made_only_of_files(serve: Callable[..., Server], tmp_path: Path,
                                                           redis_url: str, key_prefix: str) -> None:
    # Triton 2.51, seen: a load of model f (in no repository folder) with config + file:1/model.py serves
    # it, and its index lists the repository's models alone ([{"name":"m"}]), before and after f's unload.
    # Despina listed f (READY, then UNAVAILABLE "unloaded")
    repo = make_repo(tmp_path / "repo")
    server = serve(repo, "--model-control-mode", "explicit", env={"DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    params = {"config": orjson.dumps({**CONFIG, "name": "f"}).decode(),
              "file:1/model.py": base64.b64encode(MODEL.format(k=7).encode()).decode()}
    r = httpx.post(f"{server.url}/v2/repository/models/f/load", json={"parameters": params}, timeout=60)
    assert r.status_code == 200, r.text
    body = {"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]}
    assert httpx.post(f"{server.url}/v2/models/f/infer", json=body, timeout=30).json()["outputs"][0]["data"] \
        == [7, 14]
    assert index(server.url) == [{"name": "m"}]
    assert files_load(server.url).status_code == 200  # m from files: the repository's m, listed
    assert [r for r in index(server.url) if r["name"] == "m"] == [{"name": "m", "version": "3", "state": "READY"}]
    assert httpx.post(f"{server.url}/v2/repository/models/f/unload", timeout=60).status_code == 200
    assert [r["name"] for r in index(server.url)] == ["m"]
    assert given_fields(redis_url, key_prefix, "f") == []


def test_a_specific_version_policy_loads_the_versions_it_names_that_are_there(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    # Triton 2.51, seen: a load with version_policy specific [1, 3] and file:3/model.py alone serves version 3
    # (VersionsToLoad keeps the named versions that are there); specific [1] with it is a 400 "at least one
    # version must be available under the version policy of model 'm'", version 3 serving on. Despina
    # refused the first ("names versions [1] that have no folder")
    repo = make_repo(tmp_path / "repo")
    server = serve(repo, "--model-control-mode", "explicit", env={"DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    r = files_load(server.url, config=orjson.dumps({**CONFIG, "version_policy": {"specific": {"versions": [1, 3]}}
                                                    }).decode())
    assert r.status_code == 200, r.text
    wait_until(lambda: ready(server.url) == [3], what="version 3")
    assert times(server.url, 3) == [3, 6]
    r = files_load(server.url, k=5, config=orjson.dumps({**CONFIG, "version_policy": {"specific": {"versions": [1]}}
                                                         }).decode())
    assert r.status_code == 400, r.text
    assert "at least one version must be available under the version policy of model 'm'" in r.json()["error"]
    assert times(server.url, 3) == [3, 6]


ENSEMBLE_PBTXT = '''name: "e"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 2 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 2 ] } ]
ensemble_scheduling { step [ { model_name: "m" model_version: -1
  input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }
'''


def test_loading_an_ensemble_reloads_its_step_loaded_from_files_from_the_repository(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # Triton 2.51, seen (explicit mode): step A loaded with config + file:1/model.py (answering x + 100), then
    # its ensemble E loaded: A is loaded again from the repository (x + 1), and E calls that. A load of E
    # polls the models it calls, and a step loaded from files differs from its repository folder. Despina
    # kept the files' step: e answered through m's version 3
    repo = make_repo(tmp_path / "repo")
    (repo / "e").mkdir()
    (repo / "e" / "config.pbtxt").write_text(ENSEMBLE_PBTXT)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "m", wait_models=("m",),
                   env={"DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    assert files_load(server.url).status_code == 200
    wait_until(lambda: ready(server.url) == [3], what="version 3 alone")

    r = httpx.post(f"{server.url}/v2/repository/models/e/load", timeout=60)
    assert r.status_code == 200, r.text
    wait_until(lambda: ready(server.url) == [1, 2], what="the repository's versions of m")
    body = {"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]}
    r = httpx.post(f"{server.url}/v2/models/e/infer", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4], r.text
    wait_until(lambda: given_fields(redis_url, key_prefix) == [], what="the files given to go")
