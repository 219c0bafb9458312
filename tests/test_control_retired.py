"""Versions a model no longer loads, as Triton's repository index keeps them: UNAVAILABLE "unloaded", and a
request naming one is told it is not at ready state (503), not that the version is unknown."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from despina.contract.catalog import RETIRED_KEPT, CatalogEntry, retire, version_refused
from despina.contract.errors import NotFound, Unavailable
from despina.examples import build_mlp

from .conftest import Server, stop_server
from .control_support import catalog_entry, index, infer, mlp_folder, wait_until

NOT_READY = "Request for unknown model: 'mlp' version {} is not at ready state"


def mlp_rows(url: str) -> dict[str, dict[str, str]]:
    return {r["version"]: r for r in index(url) if r["name"] == "mlp"}


def assert_not_ready(url: str, version: int) -> None:
    """Infer, metadata and config of a version the model loaded once: Triton's 503 and words."""
    for r in (infer(url, version=version), httpx.get(f"{url}/v2/models/mlp/versions/{version}"),
              httpx.get(f"{url}/v2/models/mlp/versions/{version}/config")):
        assert r.status_code == 503 and r.json()["error"] == NOT_READY.format(version), (r.url, r.text)


def test_a_version_retired_by_a_poll_stays_in_the_index(serve: Callable[..., Server], tmp_path: Path,
                                                         redis_url: str, key_prefix: str) -> None:
    # version 2 arrives (the policy: the latest one): version 1 retires. It used to go from the index, and
    # a request naming it heard 404 "unknown version 1 of model 'mlp'"
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", {1: 0})
    poll = ("--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    server = serve(repo, *poll, wait_models=("mlp",))
    assert mlp_rows(server.url) == {"1": {"name": "mlp", "version": "1", "state": "READY"}}
    (repo / "mlp" / "2").mkdir()
    build_mlp(repo / "mlp" / "2" / "model.onnx", seed=1)
    wait_until(lambda: mlp_rows(server.url).get("1", {}).get("state") == "UNAVAILABLE", 30,
               what="version 1 to retire")
    assert mlp_rows(server.url) == {"1": {"name": "mlp", "version": "1", "state": "UNAVAILABLE",
                                          "reason": "unloaded"},
                                    "2": {"name": "mlp", "version": "2", "state": "READY"}}
    assert [r.get("version") for r in index(server.url, ready=True) if r["name"] == "mlp"] == ["2"]
    assert_not_ready(server.url, 1)
    assert infer(server.url).json()["model_version"] == "2"
    r = infer(server.url, version=9)  # a version it never had is not found (404), in Triton's words
    assert r.status_code == 404 and r.json()["error"] == "Request for unknown model: 'mlp' version 9 is not found"

    # the catalog is in Redis: a control plane started again still lists it
    stop_server(server)
    again = serve(repo, *poll, wait_models=("mlp",))
    assert mlp_rows(again.url)["1"] == {"name": "mlp", "version": "1", "state": "UNAVAILABLE",
                                        "reason": "unloaded"}
    assert_not_ready(again.url, 1)

    # version 1 back in the policy: it loads again, and is no longer listed as unloaded
    (repo / "mlp" / "config.pbtxt").write_text(
        (repo / "mlp" / "config.pbtxt").read_text() + "version_policy { all { } }\n")
    wait_until(lambda: mlp_rows(again.url).get("1", {}).get("state") == "READY", 30,
               what="version 1 to load again")
    assert infer(again.url, version=1).json()["model_version"] == "1"
    entry = catalog_entry(redis_url, key_prefix, "mlp")
    assert entry is not None and entry.retired == ()


def test_versions_unloaded_by_a_reload_and_an_unload_stay_in_the_index(serve: Callable[..., Server],
                                                                       tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", {1: 0, 2: 1})
    server = serve(repo, "--model-control-mode", "explicit")
    load = f"{server.url}/v2/repository/models/mlp/load"
    assert httpx.post(load, timeout=60).status_code == 200  # the latest: version 2
    config = {"name": "mlp", "backend": "onnxruntime", "max_batch_size": 8,
              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [256]}],
              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [10]}],
              "version_policy": {"specific": {"versions": [1]}}}
    r = httpx.post(load, json={"parameters": {"config": orjson.dumps(config).decode()}}, timeout=60)
    assert r.status_code == 200, r.text
    wait_until(lambda: mlp_rows(server.url).get("2", {}).get("reason") == "unloaded", 30,
               what="version 2 to retire")
    assert mlp_rows(server.url)["1"]["state"] == "READY"
    assert_not_ready(server.url, 2)

    # the whole model unloaded: each version it loaded is listed so, and a request naming one hears so
    assert httpx.post(f"{server.url}/v2/repository/models/mlp/unload", timeout=60).status_code == 200
    assert mlp_rows(server.url) == {v: {"name": "mlp", "version": v, "state": "UNAVAILABLE", "reason": "unloaded"}
                                    for v in ("1", "2")}
    for version in (1, 2):
        assert_not_ready(server.url, version)
    r = infer(server.url)
    assert r.status_code == 404 and "'mlp' has no available versions" in r.json()["error"]
    r = infer(server.url, version=7)
    assert r.status_code == 404 and "'mlp' has no available versions" in r.json()["error"]

    assert httpx.post(load, timeout=60).status_code == 200  # the repository's config again: version 2
    deadline = time.monotonic() + 30
    while mlp_rows(server.url)["2"]["state"] != "READY" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mlp_rows(server.url) == {"1": {"name": "mlp", "version": "1", "state": "UNAVAILABLE",
                                          "reason": "unloaded"},
                                    "2": {"name": "mlp", "version": "2", "state": "READY"}}


def test_the_retired_versions_are_bounded_and_a_record_without_them_still_reads() -> None:
    e = CatalogEntry("m", "/repo/m", {}, (40,))
    for v in range(1, 40):
        e = CatalogEntry("m", "/repo/m", {}, (40,), retired=retire(e, [v], (40,)))
    assert e.retired == tuple(range(40 - RETIRED_KEPT, 40))
    assert retire(e, [38, 50], (39,))[-2:] == (38, 50) and 39 not in retire(e, [], (39,))
    assert CatalogEntry.loads(e.dumps()) == e
    # the record an earlier control plane wrote, and the one an earlier reader gets: no "retired" unless some
    older = orjson.loads(e.dumps())
    del older["retired"]
    assert CatalogEntry.loads(orjson.dumps(older)).retired == ()
    assert "retired" not in orjson.loads(CatalogEntry("m", "/repo/m", {}, (1,)).dumps())
    # a version the model never had is unknown (404); one it loaded and unloaded since is not ready (503)
    assert isinstance(version_refused(e, 99), NotFound) and isinstance(version_refused(e, 39), Unavailable)

