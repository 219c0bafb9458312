"""Scale-to-zero and what a request finds: a stateful model is not unloaded while a sequence may still be
running in its worker (within max_sequence_idle_microseconds of its last request), so the next request of
that sequence meets its state rather than a 400 blaming the client; and a request that the model's
metadata refuses is refused at once, without a cold start for it."""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from .conftest import ROOT, Server
from .test_sequence import CONTROLS, SUMS

# a running sum per sequence; its sequences idle out after 6 s, its model after 1 s without requests
STATEFUL = f"""
name: "sums"
backend: "python"
max_batch_size: 4
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "sum" data_type: TYPE_FP32 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 6000000
  {CONTROLS}
  direct {{ }}
}}
parameters {{ key: "idle_timeout_s" value: {{ string_value: "1" }} }}
"""


def add(server: Server, x: float, start: bool = False, end: bool = False) -> httpx.Response:
    parameters: dict[str, Any] = {"sequence_id": 7, "sequence_start": start, "sequence_end": end}
    return httpx.post(f"{server.url}/v2/models/sums/infer", timeout=30, json={"parameters": parameters, "inputs": [
        {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [x]}]})


def index_row(server: Server, name: str = "sums") -> dict[str, Any]:
    rows = httpx.post(f"{server.url}/v2/repository/index", timeout=30).json()
    return next(r for r in rows if r["name"] == name)  # type: ignore[no-any-return]


def test_a_stateful_model_stays_loaded_while_its_sequence_may_go_on(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sums" / "1").mkdir(parents=True)
    (repo / "sums" / "1" / "model.py").write_text(SUMS)
    (repo / "sums" / "config.pbtxt").write_text(STATEFUL)
    server = serve(repo, wait_models=("sums",))
    first = add(server, 1.0, start=True)
    assert first.status_code == 200, first.text
    time.sleep(3.5)  # past the idle timeout (1 s) and two lifecycle checks, within the sequence's 6 s
    assert index_row(server)["state"] == "READY"
    r = add(server, 2.0)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [3.0]  # the sequence's state, not a fresh one
    assert add(server, 4.0, end=True).json()["outputs"][0]["data"] == [7.0]
    # and with no sequence left it scales to zero, and comes back for the next one
    deadline = time.monotonic() + 30
    while index_row(server).get("state") == "READY":
        assert time.monotonic() < deadline, "sums was never scaled to zero"
        time.sleep(0.2)
    assert index_row(server)["reason"].startswith("idle")
    r = add(server, 5.0, start=True, end=True)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [5.0]


def test_a_request_its_model_refuses_wakes_no_model_scaled_to_zero(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """The gateway knows a model scaled to zero (its metadata answers): a request with an input the model
    lacks, or a stateful model's request without a sequence, was refused only after a cold start, so its
    caller waited the load (with a load longer than its deadline, 503 "did not load" named the wrong
    cause) and a worker loaded the model for nothing."""
    repo, hold = tmp_path / "repo", tmp_path / "hold"
    (repo / "sums" / "1").mkdir(parents=True)
    (repo / "sums" / "1" / "model.py").write_text(SUMS.replace(
        "    def initialize(self, args):\n", "    def initialize(self, args):\n        import os, time\n"
        f"        while os.path.exists({str(hold)!r}):\n            time.sleep(0.05)\n"))
    (repo / "sums" / "config.pbtxt").write_text(STATEFUL.replace("6000000", "100000"))
    server = serve(repo, "--request-timeout", "3", wait_models=("sums",))
    deadline = time.monotonic() + 30
    while index_row(server).get("state") == "READY":
        assert time.monotonic() < deadline, "sums was never scaled to zero"
        time.sleep(0.2)
    hold.touch()  # from now on a cold start cannot end
    url = f"{server.url}/v2/models/sums/infer"
    unknown = httpx.post(url, timeout=30, json={"parameters": {"sequence_id": 1, "sequence_start": True},
                                                "inputs": [{"name": "q", "shape": [1, 1], "datatype": "FP32",
                                                            "data": [1.0]}]})
    assert unknown.status_code == 400 and "has no input 'q'" in unknown.text, unknown.text
    no_sequence = httpx.post(url, timeout=30, json={"inputs": [
        {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]})
    assert no_sequence.status_code == 400 and "correlation ID" in no_sequence.text, no_sequence.text
    fn = httpx.post(f"{server.url}/fn/sums", timeout=30, json={"x": [1.0]})  # /fn names no sequence
    assert fn.status_code == 400 and "stateful" in fn.text, fn.text
    generate = httpx.post(f"{server.url}/v2/models/sums/generate", timeout=30, json={"x": [1.0]})
    assert generate.status_code == 400 and "correlation ID" in generate.text, generate.text
    row = index_row(server)
    assert row["state"] == "UNAVAILABLE" and row["reason"].startswith("idle"), row  # not woken
    hold.unlink()
    r = add(server, 5.0, start=True, end=True)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [5.0], r.text


def test_a_decoupled_model_scaled_to_zero_is_not_woken_for_an_infer_it_refuses(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """/infer and /fn refuse a decoupled model (501, as Triton's HTTP infer): that refusal came after the
    wake, so a model scaled to zero was loaded for nothing and its caller waited for the load first."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "text_stream", repo / "text_stream")
    with (repo / "text_stream" / "config.pbtxt").open("a") as config:
        config.write('parameters { key: "idle_timeout_s" value: { string_value: "1" } }\n')
    server = serve(repo, wait_models=("text_stream",))

    def row() -> dict[str, Any]:
        return index_row(server, "text_stream")

    deadline = time.monotonic() + 30
    while row().get("state") == "READY":
        assert time.monotonic() < deadline, "text_stream was never scaled to zero"
        time.sleep(0.2)
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a b"]}]}
    r = httpx.post(f"{server.url}/v2/models/text_stream/infer", json=body, timeout=30)
    assert r.status_code == 501 and "decoupled" in r.text, r.text
    time.sleep(0.5)
    assert row()["state"] == "UNAVAILABLE" and row()["reason"].startswith("idle"), row()  # not woken
