"""A reload that changes only a model's instance groups updates it in place, as Triton 2.51's does: the
instances added are loaded beside those that serve, the ones removed stop once free, the model stays READY
all along, requests in flight and queued are served, and its statistics go on. Any other change reloads."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from despina.workers.backends.base import Instance
from despina.workers.instances import matched

from .conftest import Server, settled_stats
from .control_support import wait_until

SLOW_MODEL = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        if os.path.exists({log!r} + ".fail"):
            raise RuntimeError("no room for another instance")
        with open({log!r}, "a") as f:
            f.write(f"init {{self.name}}\\n")

    def execute(self, requests):
        time.sleep(0.05)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy() + 1)]) for r in requests]

    def finalize(self):
        with open({log!r}, "a") as f:
            f.write(f"fini {{self.name}}\\n")
"""

PBTXT = """backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""
BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]}


def config(count: int, max_batch_size: int = 0, groups: int = 1) -> dict[str, Any]:
    return {"name": "slow", "backend": "python", "max_batch_size": max_batch_size,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
            "instance_group": [{"count": count, "kind": "KIND_CPU"}] * groups}


def inference_count(url: str) -> int:
    return int(settled_stats(url, "slow")["inference_count"])


class Traffic:
    """Clients sending requests all along, and one polling the version's readiness, until stopped."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url, self.answers, self.ready = url, [], []  # type: ignore[var-annotated]
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._send) for _ in range(clients)]
        self.threads.append(threading.Thread(target=self._poll))
        for t in self.threads:
            t.start()

    def _send(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stopped.is_set():
                r = client.post("/v2/models/slow/infer", json=BODY)
                self.answers.append((r.status_code, r.text))

    def _poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stopped.is_set():
                self.ready.append(client.get("/v2/models/slow/versions/1/ready").status_code)
                time.sleep(0.01)

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join()


def slow_repository(tmp_path: Path) -> tuple[Path, Path]:
    """A repository of the model `slow` (SLOW_MODEL, one instance), and the log its instances write."""
    repo, log = tmp_path / "repo", tmp_path / "instances.log"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL.format(log=str(log)))
    (repo / "slow" / "config.pbtxt").write_text(PBTXT)
    return repo, log


def test_a_load_changing_only_instance_counts_updates_the_model_in_place(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """Triton 2.51, checked with this model: a load whose `config` changes the count 1 -> 3 initializes two
    instances more (the one serving is kept), 3 -> 1 finalizes two, the version's ready never fails, no
    request fails, and inference_count goes on. Despina loaded every instance anew and its statistics
    started again from nothing (5 + n inferences before and during the load: the stats said fewer)."""
    repo, log = slow_repository(tmp_path)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "slow", wait_models=("slow",))

    def load(cfg: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/v2/repository/models/slow/load",
                          json={"parameters": {"config": json.dumps(cfg)}}, timeout=60)

    for _ in range(5):
        assert httpx.post(f"{server.url}/v2/models/slow/infer", json=BODY, timeout=30).status_code == 200
    assert inference_count(server.url) == 5 and log.read_text() == "init slow_0_0\n"
    for count, changed in ((3, "init slow_0_1\ninit slow_0_2\n"), (1, "fini slow_0_1\nfini slow_0_2\n")):
        before, lines = inference_count(server.url), log.read_text()
        traffic = Traffic(server.url)
        time.sleep(0.3)
        r = load(config(count))
        time.sleep(0.3)
        traffic.stop()
        assert r.status_code == 200, r.text
        assert [a for a in traffic.answers if a[0] != 200] == [] and traffic.answers
        assert set(traffic.ready) == {200}
        assert inference_count(server.url) == before + len(traffic.answers)
        assert sorted(log.read_text()[len(lines):].splitlines()) == changed.splitlines()
        groups = httpx.get(f"{server.url}/v2/models/slow/config").json()["instance_group"]
        assert [g["count"] for g in groups] == [count]
    assert [(r["name"], r["state"]) for r in httpx.post(f"{server.url}/v2/repository/index").json()] \
        == [("slow", "READY")]


def test_a_second_group_of_the_same_kind_is_added_in_place_and_any_other_change_reloads(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """A group added beside the first adds its instances alone; a change of anything but the instance
    groups (max_batch_size here) loads every instance anew, and the statistics start again, as Triton's."""
    repo, log = slow_repository(tmp_path)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "slow", wait_models=("slow",))

    def load(cfg: dict[str, Any]) -> None:
        r = httpx.post(f"{server.url}/v2/repository/models/slow/load",
                       json={"parameters": {"config": json.dumps(cfg)}}, timeout=60)
        assert r.status_code == 200, r.text

    assert httpx.post(f"{server.url}/v2/models/slow/infer", json=BODY, timeout=30).status_code == 200
    load(config(1, groups=2))
    assert log.read_text() == "init slow_0_0\ninit slow_1_0\n"
    assert inference_count(server.url) == 1
    load(config(1, groups=2))  # nothing changed: nothing loads, the statistics go on
    assert log.read_text() == "init slow_0_0\ninit slow_1_0\n" and inference_count(server.url) == 1
    load(config(1, max_batch_size=4, groups=2))
    assert inference_count(server.url) == 0
    reloaded = ["fini slow_0_0", "fini slow_1_0", "init slow_0_0", "init slow_1_0"]
    # (the old instances stop once the new serve everywhere: after the load answered)
    wait_until(lambda: sorted(log.read_text().splitlines()[2:]) == reloaded, 20, what="a reload")


def test_an_added_instance_that_fails_to_load_leaves_the_model_as_it_was(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """As Triton 2.51's: the load answers 400 with the instance's error, the model stays READY with its
    instances and config as they were, and its statistics go on."""
    repo, log = slow_repository(tmp_path)
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "slow", wait_models=("slow",))
    assert httpx.post(f"{server.url}/v2/models/slow/infer", json=BODY, timeout=30).status_code == 200
    (tmp_path / "instances.log.fail").touch()
    r = httpx.post(f"{server.url}/v2/repository/models/slow/load",
                   json={"parameters": {"config": json.dumps(config(2))}}, timeout=60)
    assert r.status_code == 400 and "no room for another instance" in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/v2/models/slow/versions/1/ready").status_code == 200
    assert [g["count"] for g in httpx.get(f"{server.url}/v2/models/slow/config").json()["instance_group"]] == [1]
    assert httpx.post(f"{server.url}/v2/models/slow/infer", json=BODY, timeout=30).status_code == 200
    assert inference_count(server.url) == 2
    assert [line for line in log.read_text().splitlines() if line.startswith("init")] == ["init slow_0_0"]


def test_a_polled_config_changing_only_instance_counts_updates_the_model_in_place(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """The same when polling sees config.pbtxt change: the instance added alone is loaded."""
    repo, log = slow_repository(tmp_path)
    server = serve(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2", wait_models=("slow",))
    assert httpx.post(f"{server.url}/v2/models/slow/infer", json=BODY, timeout=30).status_code == 200
    (repo / "slow" / "config.pbtxt").write_text(PBTXT.replace("count: 1", "count: 2"))
    wait_until(lambda: [g["count"] for g in httpx.get(f"{server.url}/v2/models/slow/config").json()[
        "instance_group"]] == [2] and "slow_0_1" in log.read_text(), 30, what="the second instance")
    assert log.read_text() == "init slow_0_0\ninit slow_0_1\n" and inference_count(server.url) == 1


def test_which_instances_an_update_adds_and_removes() -> None:
    """matched(): an instance stays where one of the new groups runs where it does, one of its own name
    first, and keeps its name; the rest of the new ones are added, the rest of the old ones removed."""
    cpu = [Instance("m_0_0"), Instance("m_0_1"), Instance("m_0_2")]
    assert matched(cpu[:1], cpu) == (cpu[1:], [])
    assert matched(cpu, cpu[:1]) == ([], [1, 2])
    assert matched(cpu[1:], cpu[:1]) == ([], [1])  # m_0_1 stays as the one instance (its name kept)
    gpu = [Instance("g_0", "GPU", 0), Instance("g_1", "GPU", 1)]
    assert matched([*cpu[:1], gpu[0]], gpu) == (gpu[1:], [0])  # a kind or device moved: a new instance
    assert matched(cpu[:1], [Instance("m_0_0", passive=True)]) == ([Instance("m_0_0", passive=True)], [0])
    assert matched([Instance("m_0_0", threads=2)], [Instance("m_0_0")]) == ([], [])
