"""Triton's trace extension on a real `despina serve`, through tritonclient's get_trace_settings and
update_trace_settings: the settings (global, a model's own, cleared), one request in trace_rate traced up
to trace_count, the traces in Triton's JSON form in trace_file (.0, .1 with log_frequency; whole when the
settings change), every gateway of a server following the settings, and the errors."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import Server, module_server, start_server, stop_server

DEFAULTS = {"trace_file": "", "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
            "log_frequency": "0", "trace_mode": "triton"}
ORDER = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, example_repository: Path) -> Iterator[Server]:
    yield from module_server(example_repository, tmp_path_factory, redis_url, ("add_sub", "mlp"))


@pytest.fixture
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    for model in ("add_sub", "mlp"):
        c.update_trace_settings(model, {})
    c.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                                      "log_frequency": "0", "trace_file": ""})
    c.close()


def add_sub(client: httpclient.InferenceServerClient, n: int, request_id: str = "") -> None:
    a = np.ones((1, 4), np.float32)
    for i in range(n):
        inputs = [httpclient.InferInput(name, [1, 4], "FP32") for name in ("a", "b")]
        for x in inputs:
            x.set_data_from_numpy(a)
        client.infer("add_sub", inputs, request_id=f"{request_id}{i}" if request_id else "")


def traces(base: Path) -> list[dict]:
    found = []
    for path in sorted(base.parent.glob(base.name + "*")):
        found += json.loads(path.read_text())
    return found


def check_timestamps(trace: dict) -> None:
    names = [t["name"] for t in trace["timestamps"]]
    assert names == ORDER, names
    ns = [t["ns"] for t in trace["timestamps"]]
    assert ns == sorted(ns) and ns[-1] - ns[0] < 10e9
    assert abs(ns[0] - time.time_ns()) < 120e9  # the wall clock, in nanoseconds


def test_settings_rate_and_files_by_log_frequency(client: httpclient.InferenceServerClient, tmp_path: Path) -> None:
    assert "trace" in client.get_server_metadata()["extensions"]
    assert client.get_trace_settings() == DEFAULTS
    base = tmp_path / "trace.json"
    settings = client.update_trace_settings(settings={"trace_file": str(base), "trace_level": ["TIMESTAMPS"],
                                                      "trace_rate": "2", "log_frequency": "3"})
    assert settings == {**DEFAULTS, "trace_file": str(base), "trace_level": ["TIMESTAMPS"], "trace_rate": "2",
                        "log_frequency": "3"}
    add_sub(client, 12, request_id="req-")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["trace.json.0", "trace.json.1"]  # 6 traced, written 3 at a time
    found = traces(base)
    assert [t["request_id"] for t in found] == [f"req-{i}" for i in range(0, 12, 2)]  # the 1st, 3rd, ...
    assert len({t["id"] for t in found}) == 6
    for t in found:
        assert t["model_name"] == "add_sub" and t["model_version"] == 1
        check_timestamps(t)


def test_a_models_own_settings_count_and_clear(client: httpclient.InferenceServerClient, tmp_path: Path) -> None:
    base = tmp_path / "t.json"
    client.update_trace_settings(settings={"trace_file": str(base), "log_frequency": "1"})
    own = client.update_trace_settings("add_sub", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                                   "trace_count": "2"})
    assert own == {**DEFAULTS, "trace_file": str(base), "log_frequency": "1", "trace_level": ["TIMESTAMPS"],
                   "trace_rate": "1", "trace_count": "2"}
    assert client.get_trace_settings()["trace_level"] == ["OFF"]  # the global ones are as they were
    assert client.get_trace_settings("mlp")["trace_level"] == ["OFF"]
    add_sub(client, 5)
    x = httpclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    client.infer("mlp", [x])  # not traced: its level is the global OFF
    found = traces(base)
    assert [t["model_name"] for t in found] == ["add_sub", "add_sub"]  # trace_count 2
    # null: that setting follows the global one again; {}: all of them do
    assert client.update_trace_settings("add_sub", {"trace_rate": None})["trace_rate"] == "1000"
    assert client.get_trace_settings("add_sub")["trace_count"] == "2"
    client.update_trace_settings(settings={"trace_rate": "7"})
    assert client.get_trace_settings("add_sub")["trace_rate"] == "7"
    assert client.update_trace_settings("add_sub", {}) == {**DEFAULTS, "trace_file": str(base), "log_frequency": "1",
                                                           "trace_rate": "7"}


def test_a_models_unset_settings_follow_the_global_ones(client: httpclient.InferenceServerClient,
                                                       tmp_path: Path) -> None:
    """As Triton's trace_endpoint_test: a global change reaches the settings a model has not set itself."""
    base = tmp_path / "m.json"
    client.update_trace_settings(settings={"trace_file": str(base), "log_frequency": "1"})
    client.update_trace_settings("add_sub", {"trace_count": "3"})
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "9"})
    assert client.get_trace_settings("add_sub") == {**DEFAULTS, "trace_file": str(base), "log_frequency": "1",
                                                    "trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                                    "trace_count": "3"}
    add_sub(client, 5)
    assert len(traces(base)) == 3  # traced at the global level and rate, counted by its own trace_count


def test_the_models_on_the_global_settings_share_its_count(client: httpclient.InferenceServerClient,
                                                          tmp_path: Path) -> None:
    """Triton samples and counts on the setting a request's model follows: one for all the models on the
    global settings, one for each model with settings of its own."""
    base = tmp_path / "shared.json"
    client.update_trace_settings(settings={"trace_file": str(base), "trace_level": ["TIMESTAMPS"],
                                           "trace_rate": "1", "trace_count": "3", "log_frequency": "1"})
    x = httpclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    for _ in range(3):
        add_sub(client, 1)
        client.infer("mlp", [x])
    assert [t["model_name"] for t in traces(base)] == ["add_sub", "mlp", "add_sub"]  # 3 in all, not 3 each


def test_a_null_resets_a_global_setting(client: httpclient.InferenceServerClient) -> None:
    """As Triton's trace_endpoint_test clears them: a null puts a global setting back to its default."""
    client.update_trace_settings(settings={"trace_rate": "56", "trace_count": "78", "log_frequency": "9"})
    cleared = client.update_trace_settings(settings={"trace_rate": None, "trace_count": None})
    assert cleared == {**DEFAULTS, "log_frequency": "9"}


def test_with_log_frequency_0_the_traces_are_written_when_the_settings_change(
        client: httpclient.InferenceServerClient, tmp_path: Path) -> None:
    base = tmp_path / "all.json"
    client.update_trace_settings(settings={"trace_file": str(base), "trace_level": ["TIMESTAMPS"],
                                           "trace_rate": "1"})
    add_sub(client, 4)
    assert not base.exists()  # kept until then
    client.update_trace_settings(settings={"trace_level": ["OFF"]})
    found = json.loads(base.read_text())
    assert len(found) == 4 and [t["id"] for t in found] == sorted(t["id"] for t in found)
    add_sub(client, 2)
    assert len(json.loads(base.read_text())) == 4  # off: nothing more


def test_bad_settings(server: Server, client: httpclient.InferenceServerClient, tmp_path: Path) -> None:
    def refused(settings: dict, model: str | None = None) -> str:
        with pytest.raises(InferenceServerException) as caught:
            client.update_trace_settings(model, settings)
        return str(caught.value)

    assert "TENSORS" in refused({"trace_level": ["TENSORS"], "trace_file": str(tmp_path / "x")})
    assert "unknown trace level" in refused({"trace_level": ["LOUD"]})
    assert "opentelemetry" in refused({"trace_mode": "opentelemetry"})
    assert "unknown trace setting 'rate'" in refused({"rate": "1"})
    assert "at least 1" in refused({"trace_rate": "0"})
    assert "at least -1" in refused({"trace_count": "-2"})
    assert "integer" in refused({"log_frequency": "often"})
    assert "integer" in refused({"trace_count": "--1"})  # not a number to int() either: was a 500
    assert "integer" in refused({"trace_rate": "\u00b2"})
    assert "at most 2147483647" in refused({"trace_rate": "9" * 5000})  # past int()'s digits: was a 500 too
    assert "needs trace_file" in refused({"trace_level": ["TIMESTAMPS"]})
    assert "needs trace_file" in refused({"trace_level": ["TIMESTAMPS"]}, "add_sub")
    assert client.get_trace_settings() == DEFAULTS  # nothing changed
    r = httpx.get(f"{server.url}/v2/models/nope/trace/setting")
    assert r.status_code == 404
    r = httpx.post(f"{server.url}/v2/trace/setting", content=b"[1, 2]")
    assert r.status_code == 400


def test_every_gateway_follows_the_settings_and_writes_its_own_file(
        tmp_path: Path, redis_url: str, key_prefix: str, example_repository: Path) -> None:
    served = start_server(example_repository, tmp_path, redis_url, key_prefix, "--gateways", "2",
                          wait_models=("add_sub",))
    base = tmp_path / "traces" / "gw.json"
    try:
        c = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
        c.update_trace_settings(settings={"trace_file": str(base), "trace_level": ["TIMESTAMPS"],
                                          "trace_rate": "1", "log_frequency": "1"})
        c.close()
        body = {"inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]} for n in "ab"]}

        def send(n: int) -> None:
            for _ in range(n):  # a new connection each time: the kernel spreads them over both gateways
                with httpx.Client() as fresh:
                    assert fresh.post(f"{served.url}/v2/models/add_sub/infer", json=body,
                                      headers={"connection": "close"}).status_code == 200

        def writers() -> set[str]:  # gw.json-0.N and gw.json-1.N
            return {p.name.split(".json")[1].split(".")[0] for p in base.parent.glob("gw.json*")}

        deadline = time.monotonic() + 20
        while writers() != {"-0", "-1"}:  # the other gateway hears of it through the events channel
            assert time.monotonic() < deadline, writers()
            send(1)
        before = len(traces(base))
        send(16)  # both follow the settings now: every request is traced, by whichever gateway had it
        assert len(traces(base)) == before + 16
    finally:
        stop_server(served)
