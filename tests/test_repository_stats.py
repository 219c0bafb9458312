"""The statistics extension across the repository API's loads and unloads, as Triton 2.51 answers."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import tritonclient.http as httpclient

from .conftest import Server
from .control_support import infer, mlp_folder, wait_until


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    mlp_folder(root, "mlp", {1: 0, 2: 1}, extra="version_policy { all { } }")
    return root


def counts(server: Server) -> dict[str, int]:
    r = httpx.get(f"{server.url}/v2/models/mlp/stats", timeout=10)
    assert r.status_code == 200, r.text
    return {s["version"]: s["inference_count"] for s in r.json()["model_stats"]}


def metric(server: Server) -> float:
    lines = httpx.get(server.metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines.splitlines()
               if line.startswith('nv_inference_count{model="mlp"'))


def test_a_load_starts_the_statistics_of_what_it_loads_afresh(serve: Callable[..., Server], repo: Path) -> None:
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "mlp", wait_models=("mlp",))
    for version in (1, 2, 2):
        assert infer(server.url, version=version).status_code == 200
    wait_until(lambda: counts(server) == {"1": 1, "2": 2}, 10, what="the inferences counted")

    # a load of files unchanged changes nothing: the statistics go on, as Triton's (checked with a Python
    # model: its first reload made it anew all the same, but only because Python had written model.py's
    # bytecode into its version folder meanwhile, which changed the folder)
    assert httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60).status_code == 200
    assert counts(server) == {"1": 1, "2": 2}

    # Triton's load of a loaded model whose files changed makes it anew: its statistics start again from
    # nothing ...
    for version in (1, 2):
        model = repo / "mlp" / str(version) / "model.onnx"
        model.write_bytes(model.read_bytes())
    assert httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60).status_code == 200
    stats = httpx.get(f"{server.url}/v2/models/mlp/versions/2/stats", timeout=10).json()["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"], stats["last_inference"]) == (0, 0, 0)
    assert stats["inference_stats"]["success"] == {"count": 0, "ns": 0} and stats["batch_stats"] == []
    # ... while its Prometheus counters go on counting, as Triton's do
    assert metric(server) == 3

    assert infer(server.url, version=2).status_code == 200
    wait_until(lambda: counts(server) == {"1": 0, "2": 1}, 10, what="the inference after the load counted")
    stats = httpx.get(f"{server.url}/v2/models/mlp/versions/2/stats", timeout=10).json()["model_stats"][0]
    assert stats["last_inference"] > 0 and stats["batch_stats"][0]["compute_infer"]["count"] == 1

    # an unload and a load: from nothing again
    assert httpx.post(f"{server.url}/v2/repository/models/mlp/unload", timeout=60).status_code == 200
    assert httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60).status_code == 200
    assert counts(server) == {"1": 0, "2": 0}
    assert metric(server) == 4


def test_a_load_of_a_model_whose_files_did_not_change_keeps_its_statistics(serve: Callable[..., Server],
                                                                           repo: Path) -> None:
    # Triton 2.51 loads again only a model whose files changed since it loaded them: a client's load_model
    # of a model that serves, unchanged, keeps it as it is, its statistics with it
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "mlp", wait_models=("mlp",))
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        for version in (2, 2):
            assert infer(server.url, version=version).status_code == 200
        wait_until(lambda: counts(server) == {"1": 0, "2": 2}, 10, what="the inferences counted")
        client.load_model("mlp")
        assert client.is_model_ready("mlp", "2")
        stats = client.get_inference_statistics("mlp", "2")["model_stats"][0]
        assert (stats["inference_count"], stats["execution_count"]) == (2, 2)
        assert stats["last_inference"] > 0 and stats["inference_stats"]["success"]["count"] == 2
        assert counts(server) == {"1": 0, "2": 2}
    finally:
        client.close()


def test_a_version_a_polled_repository_loads_again_counts_from_nothing(serve: Callable[..., Server],
                                                                       tmp_path: Path) -> None:
    root = tmp_path / "repo"
    mlp_folder(root, "mlp", {1: 0, 2: 1})  # the latest version serves
    (root / "mlp" / "2").rename(root / "spare")
    server = serve(root, "--model-control-mode", "poll", "--repository-poll-secs", "0.2", wait_models=("mlp",))
    for _ in range(2):
        assert infer(server.url).json()["model_version"] == "1"
    wait_until(lambda: counts(server) == {"1": 2}, 10, what="version 1's inferences counted")

    (root / "spare").rename(root / "mlp" / "2")  # version 2 comes, version 1 goes
    wait_until(lambda: counts(server) == {"2": 0}, 30, what="version 2 alone")
    assert infer(server.url).json()["model_version"] == "2"
    wait_until(lambda: counts(server) == {"2": 1}, 10, what="version 2's inference counted")

    # version 2 goes, version 1 is loaded again: a version loaded anew counts from nothing, as Triton's
    # (it went on from the 2 inferences of its earlier load), and so does version 2 when it comes back
    (root / "mlp" / "2").rename(root / "spare")
    wait_until(lambda: counts(server).keys() == {"1"}, 30, what="version 1 alone again")
    assert counts(server) == {"1": 0}
    (root / "spare").rename(root / "mlp" / "2")
    wait_until(lambda: counts(server).keys() == {"2"}, 30, what="version 2 alone again")
    assert counts(server) == {"2": 0}
