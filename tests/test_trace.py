"""Triton's trace extension on a real `despina serve`, through tritonclient's get_trace_settings and
update_trace_settings: the settings (global, a model's own, cleared), one request in trace_rate traced up
to trace_count, the traces in Triton's JSON form in the trace file the server started with (.0, .1 with
log_frequency; whole when the settings change), every gateway of a server following the settings, the
trace file that the API may not change, and the errors."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina.cli import parser, settings_of
from despina.contract.keys import Keys
from despina.settings import BadSetting

from .conftest import Server, module_server, start_server, stop_server

DEFAULTS = {"trace_file": "", "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
            "log_frequency": "0", "trace_mode": "triton"}
# as Triton 2.51 stamps an HTTP request (its trace file, in time order): the HTTP receive and send as the
# gateway's HTTP protocol sees them, the compute's input, infer and output as the worker timed its batch,
# and INFER_RESPONSE_COMPLETE when the model's answer is back
COMPUTE = ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
ORDER = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", *COMPUTE,
         "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START", "HTTP_SEND_END", "REQUEST_END"]
STEP = ["REQUEST_START", "QUEUE_START", *COMPUTE, "REQUEST_END"]  # an ensemble's step
CLEAR = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}  # a model's own
FIXED = "trace file location can not be updated through network protocol"  # Triton's words


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trace file the module's server starts with."""
    return tmp_path_factory.mktemp("traces") / "trace.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, example_repository: Path,
           base: Path) -> Iterator[Server]:
    yield from module_server(example_repository, tmp_path_factory, redis_url, ("add_sub", "mlp"),
                             env={"DESPINA_TRACE_FILE": str(base)})


@pytest.fixture
def client(server: Server, base: Path) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    for model in ("add_sub", "mlp"):
        c.update_trace_settings(model, CLEAR)
    c.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                                      "log_frequency": "0"})  # writes what was kept: then gone too
    c.close()
    for path in base.parent.iterdir():
        path.unlink()


def add_sub(client: httpclient.InferenceServerClient, n: int, request_id: str = "") -> None:
    a = np.ones((1, 4), np.float32)
    for i in range(n):
        inputs = [httpclient.InferInput(name, [1, 4], "FP32") for name in ("a", "b")]
        for x in inputs:
            x.set_data_from_numpy(a)
        client.infer("add_sub", inputs, request_id=f"{request_id}{i}" if request_id else "")


def traces(base: Path) -> list[dict]:
    found = []
    def written(path: Path) -> tuple[str, int]:  # .json.10 after .json.9, not after .json.1
        head, _, part = path.name.rpartition(".")
        return (head, int(part)) if part.isdigit() else (path.name, -1)

    for path in sorted(base.parent.glob(base.name + "*"), key=written):
        found += json.loads(path.read_text())
    return found


def traced(base: Path, n: int) -> list[dict]:
    """The traces written, once there are n: a gateway writes a trace just after it answers its request."""
    deadline = time.monotonic() + 10
    while len(found := traces(base)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def check_timestamps(trace: dict, order: list[str] = ORDER) -> None:
    names = [t["name"] for t in trace["timestamps"]]
    assert names == order, names
    ns = [t["ns"] for t in trace["timestamps"]]
    assert ns == sorted(ns) and ns[-1] - ns[0] < 10e9
    assert abs(ns[0] - time.time_ns()) < 120e9  # the wall clock, in nanoseconds


def test_settings_rate_and_files_by_log_frequency(client: httpclient.InferenceServerClient, base: Path) -> None:
    assert "trace" in client.get_server_metadata()["extensions"]
    assert client.get_trace_settings() == {**DEFAULTS, "trace_file": str(base)}
    # in Triton's order, as its answer lists them
    assert list(client.get_trace_settings()) == ["trace_level", "trace_rate", "trace_count", "log_frequency",
                                                 "trace_file", "trace_mode"]
    settings = client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "2",
                                                      "log_frequency": "3"})
    assert settings == {**DEFAULTS, "trace_file": str(base), "trace_level": ["TIMESTAMPS"], "trace_rate": "2",
                        "log_frequency": "3"}
    add_sub(client, 12, request_id="req-")
    # 6 traced, written 3 at a time to trace.json.N and .N+1 (N goes on over the module's tests, as Triton's);
    # the 12th request is the 6th traced, whose part the gateway writes just after it answers
    found = traced(base, 6)
    parts = sorted(int(p.suffix[1:]) for p in base.parent.iterdir() if not p.name.startswith("."))
    assert len(parts) == 2 and parts[1] == parts[0] + 1 and base.with_suffix(f".json.{parts[0]}").exists()
    # the 2nd, 4th, ..., as Triton's (++sample % rate == 0): Despina traced the 1st, 3rd...
    assert [t["request_id"] for t in found] == [f"req-{i}" for i in range(1, 12, 2)]
    assert len({t["id"] for t in found}) == 6
    for t in found:
        assert t["model_name"] == "add_sub" and t["model_version"] == 1
        check_timestamps(t)


def test_pipelined_requests_each_have_their_own_http_stamps(server: Server,
                                                           client: httpclient.InferenceServerClient,
                                                           base: Path) -> None:
    """Two requests in one write on one connection: each trace has its own receive and send, the second
    answered after the first (HTTP/1.1 pipelining: in order)."""
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "1"})
    host, port = server.url.removeprefix("http://").split(":")
    one = json.dumps({"inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
                                 for n in "ab"]}).encode()
    heads = [f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nX-Request-Id: p{i}\r\n"
             f"Content-Length: {len(one)}\r\n\r\n".encode() for i in range(2)]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(heads[0] + one + heads[1] + one)
        got = b""
        while got.count(b"HTTP/1.1 200") < 2 or not got.endswith(b"}]}"):
            part = s.recv(65536)
            assert part, got
            got += part
    found = sorted(traced(base, 2), key=lambda t: t["id"])
    assert len(found) == 2
    for t in found:
        check_timestamps(t)
    first, second = ({n["name"]: n["ns"] for n in t["timestamps"]} for t in found)
    assert second["HTTP_RECV_START"] > first["HTTP_RECV_START"]  # its own message's
    assert second["HTTP_SEND_START"] >= first["HTTP_SEND_END"]


def test_a_models_own_settings_count_and_clear(client: httpclient.InferenceServerClient, base: Path) -> None:
    client.update_trace_settings(settings={"log_frequency": "1"})
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
    # null: that setting follows the global one again
    assert client.update_trace_settings("add_sub", {"trace_rate": None})["trace_rate"] == "1000"
    assert client.get_trace_settings("add_sub")["trace_count"] == "0"  # its 2 taken, as Triton's answers
    client.update_trace_settings(settings={"trace_rate": "7"})
    assert client.get_trace_settings("add_sub")["trace_rate"] == "7"
    own = client.get_trace_settings("add_sub")
    assert own["trace_level"] == ["TIMESTAMPS"]
    assert client.update_trace_settings("add_sub", {}) == own  # no settings change nothing, as Triton's
    assert client.update_trace_settings("add_sub", CLEAR) == {**DEFAULTS, "trace_file": str(base),
                                                              "log_frequency": "1", "trace_rate": "7"}


def test_a_models_unset_settings_follow_the_global_ones(client: httpclient.InferenceServerClient,
                                                       base: Path) -> None:
    """As Triton's trace_endpoint_test: a global change reaches the settings a model has not set itself."""
    client.update_trace_settings(settings={"log_frequency": "1"})
    client.update_trace_settings("add_sub", {"trace_count": "3"})
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "9"})
    assert client.get_trace_settings("add_sub") == {**DEFAULTS, "trace_file": str(base), "log_frequency": "1",
                                                    "trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                                    "trace_count": "3"}
    add_sub(client, 5)
    assert len(traces(base)) == 3  # traced at the global level and rate, counted by its own trace_count


def test_the_models_on_the_global_settings_share_its_count(client: httpclient.InferenceServerClient,
                                                          base: Path) -> None:
    """Triton samples and counts on the setting a request's model follows: one for all the models on the
    global settings, one for each model with settings of its own."""
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "3",
                                           "log_frequency": "1"})
    x = httpclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    for _ in range(3):
        add_sub(client, 1)
        client.infer("mlp", [x])
    assert [t["model_name"] for t in traces(base)] == ["add_sub", "mlp", "add_sub"]  # 3 in all, not 3 each


def test_trace_count_answers_what_is_left_as_triton_does(client: httpclient.InferenceServerClient,
                                                          base: Path) -> None:
    """Triton's GET answers the traces still to take, shared by the models on the global settings, and a
    change that does not name trace_count goes on from what is left; one that names it starts again."""
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "3",
                                           "log_frequency": "2"})
    add_sub(client, 2)
    assert client.get_trace_settings()["trace_count"] == "1"
    assert client.get_trace_settings("add_sub")["trace_count"] == "1"
    assert client.update_trace_settings(settings={"log_frequency": "1"})["trace_count"] == "1"
    add_sub(client, 2)
    assert client.get_trace_settings()["trace_count"] == "0"
    assert len(traced(base, 3)) == 3
    assert client.update_trace_settings(settings={"trace_count": "2"})["trace_count"] == "2"


def test_the_same_trace_count_posted_again_starts_it_again(client: httpclient.InferenceServerClient,
                                                           base: Path) -> None:
    """As Triton's: a POST that names trace_count sets the traces still to take to it, even to the value it
    had (re-arming tracing for the next N requests); the settings kept did not change, so the gateways did
    not see it, and the count went on from what was left."""
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "2"})
    add_sub(client, 2)
    assert client.get_trace_settings()["trace_count"] == "0"
    assert client.update_trace_settings(settings={"trace_count": "2"})["trace_count"] == "2"
    assert client.get_trace_settings()["trace_count"] == "2"
    add_sub(client, 1)
    assert client.get_trace_settings()["trace_count"] == "1"
    client.update_trace_settings("add_sub", settings={"trace_count": "3"})
    add_sub(client, 1)
    assert client.update_trace_settings("add_sub", settings={"trace_count": "3"})["trace_count"] == "3"
    assert client.get_trace_settings()["trace_count"] == "1"  # the global count went on
    add_sub(client, 1)
    client.update_trace_settings(settings={"trace_count": "2"})
    assert client.get_trace_settings("add_sub")["trace_count"] == "2"  # its own count went on


def test_traces_go_to_the_next_part_once_trace_count_is_used_up(client: httpclient.InferenceServerClient,
                                                                base: Path) -> None:
    """As Triton's: with log_frequency 0, the traces are written to ${trace_file}.N as soon as the last one
    trace_count allows is done, not kept until the settings change."""
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "2"})
    add_sub(client, 1, request_id="a")
    add_sub(client, 2, request_id="b")
    found = traced(base, 2)
    assert [t["request_id"] for t in found] == ["a0", "b0"]
    assert len(list(base.parent.glob(base.name + ".*"))) == 1 and not base.exists()


def test_a_null_resets_a_global_setting(client: httpclient.InferenceServerClient, base: Path) -> None:
    """As Triton's trace_endpoint_test clears them: a null puts a global setting back to its default."""
    client.update_trace_settings(settings={"trace_rate": "56", "trace_count": "78", "log_frequency": "9"})
    cleared = client.update_trace_settings(settings={"trace_rate": None, "trace_count": None})
    assert cleared == {**DEFAULTS, "trace_file": str(base), "log_frequency": "9"}
    # no levels change nothing, as Triton 2.51's (for the global settings and a model's)
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    assert client.update_trace_settings(settings={"trace_level": []})["trace_level"] == ["TIMESTAMPS"]
    client.update_trace_settings("add_sub", {"trace_level": ["OFF"]})
    assert client.update_trace_settings("add_sub", {"trace_level": []})["trace_level"] == ["OFF"]
    assert client.update_trace_settings("add_sub", {"trace_level": None})["trace_level"] == ["TIMESTAMPS"]


def test_with_log_frequency_0_the_traces_are_written_when_the_settings_change(
        client: httpclient.InferenceServerClient, base: Path) -> None:
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    add_sub(client, 4)
    assert not base.exists()  # kept until then
    client.update_trace_settings(settings={"trace_level": ["OFF"]})
    found = json.loads(base.read_text())
    assert len(found) == 4 and [t["id"] for t in found] == sorted(t["id"] for t in found)
    add_sub(client, 2)
    assert len(json.loads(base.read_text())) == 4  # off: nothing more


def refusal(client: httpclient.InferenceServerClient, settings: dict, model: str | None = None,
            status: str = "400") -> str:
    with pytest.raises(InferenceServerException) as caught:
        client.update_trace_settings(model, settings)
    assert caught.value.status() == status
    return str(caught.value)


def test_bad_settings(server: Server, client: httpclient.InferenceServerClient, base: Path) -> None:
    def refused(settings: dict, model: str | None = None) -> str:
        return refusal(client, settings, model)

    assert "unknown trace level" in refused({"trace_level": ["LOUD"]})
    # Triton's: OFF with another level is refused (it was taken for TIMESTAMPS)
    assert "Expect only one trace level 'OFF'" in refused({"trace_level": ["OFF", "TIMESTAMPS"]})
    assert "opentelemetry" in refused({"trace_mode": "opentelemetry"})
    assert "unknown trace setting 'rate'" in refused({"rate": "1"})
    assert "at least 1" in refused({"trace_rate": "0"})
    assert "at least -1" in refused({"trace_count": "-2"})
    assert "integer" in refused({"log_frequency": "often"})
    assert "integer" in refused({"trace_count": "--1"})  # not a number to int() either: was a 500
    assert "integer" in refused({"trace_rate": "\u00b2"})
    assert "at most 2147483647" in refused({"trace_rate": "9" * 5000})  # past int()'s digits: was a 500 too
    assert client.get_trace_settings() == {**DEFAULTS, "trace_file": str(base)}  # nothing changed
    # Triton's 400 and words for a model it does not have, as for its statistics
    for r in (httpx.get(f"{server.url}/v2/models/nope/trace/setting"),
              httpx.post(f"{server.url}/v2/models/nope/trace/setting", json={"trace_rate": "1"})):
        assert (r.status_code, r.json()["error"]) == (400, "Request for unknown model : nope")
    r = httpx.post(f"{server.url}/v2/trace/setting", content=b"[1, 2]")
    assert r.status_code == 400


async def test_concurrent_changes_of_different_settings_are_all_kept(
        server: Server, client: httpclient.InferenceServerClient) -> None:
    """A POST read the settings, changed what it names and wrote them all back: two at once (through one
    gateway or two) each wrote the settings it had read, and the one written first was lost. Each round
    changes four settings at once, each in a POST of its own, the global ones and a model's."""
    posts = [("/v2/trace/setting", "trace_rate", lambda i: str(100 + i)),
             ("/v2/trace/setting", "trace_count", lambda i: str(1000 + i)),
             ("/v2/trace/setting", "log_frequency", lambda i: str(10 + i)),
             ("/v2/models/mlp/trace/setting", "trace_rate", lambda i: str(200 + i))]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        for i in range(20):
            answers = await asyncio.gather(*(http.post(path, json={name: value(i)})
                                             for path, name, value in posts))
            assert [a.status_code for a in answers] == [200] * len(posts), [a.text for a in answers]
            kept = (await http.get("/v2/trace/setting")).json()
            own = (await http.get("/v2/models/mlp/trace/setting")).json()
            assert [kept["trace_rate"], kept["trace_count"], kept["log_frequency"], own["trace_rate"]] == \
                [value(i) for _, _, value in posts], f"round {i}"


def both_gateways_tracing(url: str, base: Path) -> Callable[[int], None]:
    """Send requests to add_sub, a fresh connection each (the kernel spreads them over both gateways of
    `serve --gateways 2`), until both have written a trace to `base`; the sender, for more."""
    body = {"inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]} for n in "ab"]}

    def send(n: int) -> None:
        for _ in range(n):
            with httpx.Client() as fresh:
                assert fresh.post(f"{url}/v2/models/add_sub/infer", json=body,
                                  headers={"connection": "close"}).status_code == 200

    def writers() -> set[str]:  # gw.json-0.N and gw.json-1.N
        return {p.name.split(".json")[1].split(".")[0] for p in base.parent.glob("gw.json*")}

    deadline = time.monotonic() + 20
    while writers() != {"-0", "-1"}:  # the other gateway hears of the settings through the events channel
        assert time.monotonic() < deadline, writers()
        send(1)
    return send


def test_every_gateway_follows_the_settings_and_writes_its_own_file(
        tmp_path: Path, redis_url: str, key_prefix: str, example_repository: Path) -> None:
    base = tmp_path / "traces" / "gw.json"  # its folder made by the gateways
    served = start_server(example_repository, tmp_path, redis_url, key_prefix, "--gateways", "2",
                          "--trace-file", str(base), wait_models=("add_sub",))
    try:
        c = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
        c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "1"})
        c.close()
        send = both_gateways_tracing(served.url, base)
        time.sleep(0.5)  # the last one's trace, written just after its answer
        before = len(traces(base))
        send(16)  # both follow the settings now: every request is traced, by whichever gateway had it
        assert len(traced(base, before + 16)) == before + 16
    finally:
        stop_server(served)


def test_the_api_may_not_set_the_trace_file(server: Server, client: httpclient.InferenceServerClient, base: Path,
                                            tmp_path: Path) -> None:
    """As Triton's (L0_trace): trace_file in a POST, global or a model's, is refused with Triton's words, and
    nothing is written where it names, a file there or a folder to make; a null changes nothing."""
    kept = tmp_path / "kept.txt"
    kept.write_text("the server's user may write me")
    made = tmp_path / "made" / "new.json"
    for target in (kept, made):
        for model in (None, "add_sub"):
            # Triton 2.51 answers 501 (UNSUPPORTED), as seen: it was a 400
            assert FIXED in refusal(client, {"trace_file": str(target), "trace_level": ["TIMESTAMPS"],
                                             "trace_rate": "1", "log_frequency": "1"}, model, "501")
    r = httpx.post(f"{server.url}/v2/trace/setting", json={"trace_file": [str(made)]})
    assert r.status_code == 501 and FIXED in r.json()["error"]
    assert client.get_trace_settings() == {**DEFAULTS, "trace_file": str(base)}  # nothing changed
    assert client.get_trace_settings("add_sub") == {**DEFAULTS, "trace_file": str(base)}
    # a null is no change: tritonclient and Triton's own tests clear settings so
    assert client.update_trace_settings(settings={"trace_file": None, "trace_level": ["TIMESTAMPS"],
                                                  "trace_rate": "1", "log_frequency": "1"})["trace_file"] == str(base)
    assert client.update_trace_settings("add_sub", {"trace_file": None})["trace_file"] == str(base)
    add_sub(client, 2)
    assert len(traced(base, 2)) == 2
    assert kept.read_text() == "the server's user may write me" and not made.parent.exists()


def test_a_trace_file_kept_in_redis_is_not_used(server: Server, client: httpclient.InferenceServerClient,
                                                redis_url: str, base: Path, tmp_path: Path) -> None:
    """Settings a Despina before --trace-file kept (the API took trace_file then) trace to the server's file."""
    elsewhere = tmp_path / "elsewhere.json"
    doc = {"global": {"trace_file": str(elsewhere), "trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                      "log_frequency": "1"}, "models": {"add_sub": {"trace_file": str(elsewhere)}}}
    redis.Redis.from_url(redis_url).set(Keys(server.prefix).trace_settings, json.dumps(doc))
    assert client.get_trace_settings("add_sub")["trace_file"] == str(base)
    client.update_trace_settings(settings={"trace_count": "-1"})  # the gateway follows the doc now
    add_sub(client, 2)
    assert len(traced(base, 2)) == 2 and not elsewhere.exists()


def test_a_server_writes_traces_to_the_file_it_started_with(client: httpclient.InferenceServerClient,
                                                            base: Path) -> None:
    """The module's server started with DESPINA_TRACE_FILE (the gateways' test: --trace-file)."""
    assert client.get_trace_settings()["trace_file"] == str(base)
    assert client.get_trace_settings("mlp")["trace_file"] == str(base)
    client.update_trace_settings("add_sub", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    add_sub(client, 3, request_id="mine-")
    client.update_trace_settings("add_sub", CLEAR)  # log_frequency 0: written as the settings change
    assert [t["request_id"] for t in json.loads(base.read_text())] == ["mine-0", "mine-1", "mine-2"]


def test_without_a_trace_file_tracing_is_refused(tmp_path: Path, redis_url: str, key_prefix: str,
                                                 example_repository: Path) -> None:
    served = start_server(example_repository, tmp_path, redis_url, key_prefix, wait_models=("add_sub",))
    try:
        c = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
        for model in (None, "add_sub"):
            why = refusal(c, {"trace_level": ["TIMESTAMPS"]}, model)
            assert "--trace-file" in why and "DESPINA_TRACE_FILE" in why, why
            assert FIXED in refusal(c, {"trace_file": str(tmp_path / "t.json"), "trace_level": ["TIMESTAMPS"]},
                                    model, "501")
        assert c.get_trace_settings() == DEFAULTS and c.get_trace_settings("add_sub") == DEFAULTS
        assert c.update_trace_settings(settings={"trace_rate": "5"}) == {**DEFAULTS, "trace_rate": "5"}  # level OFF
        c.close()
        assert not (tmp_path / "t.json").exists()
    finally:
        stop_server(served)


def test_a_model_not_loaded_has_no_trace_settings(tmp_path: Path, redis_url: str, key_prefix: str,
                                                  example_repository: Path) -> None:
    # Triton 2.51 answers a model of its repository that is not loaded as one it lacks: 400 "Request for
    # unknown model : mlp" to GET and POST of its settings, until a load
    served = start_server(example_repository, tmp_path, redis_url, key_prefix, "--model-control-mode",
                          "explicit", "--load-model", "add_sub", wait_models=("add_sub",))
    c = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
    try:
        for ask in (lambda: c.get_trace_settings("mlp"),
                    lambda: c.update_trace_settings("mlp", {"trace_rate": "3"}),
                    lambda: c.update_trace_settings("mlp", {"trace_rate": None})):
            with pytest.raises(InferenceServerException) as raised:
                ask()
            assert (raised.value.status(), raised.value.message()) == ("400", "Request for unknown model : mlp")
        c.load_model("mlp")
        assert c.get_trace_settings("mlp") == DEFAULTS
        c.unload_model("mlp")
        with pytest.raises(InferenceServerException, match="Request for unknown model : mlp"):
            c.get_trace_settings("mlp")
    finally:
        c.close()
        stop_server(served)


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    (["--trace-file", "/srv/t.json"], {}, "/srv/t.json"),
    ([], {"DESPINA_TRACE_FILE": "/srv/e.json"}, "/srv/e.json"),
    (["--trace-config", "triton,file=/srv/c.json"], {"DESPINA_TRACE_FILE": "/srv/e.json"}, "/srv/c.json"),
    (["--trace-config", "file=/a", "--trace-config", "triton,file=/b"], {}, "/b"),
    (["--trace-file", "/srv/t.json", "--trace-config", "triton,file=/srv/c.json"], {}, "/srv/t.json"),
    ([], {}, ""),
])
def test_the_trace_file_is_a_start_up_setting(argv: list[str], environ: dict[str, str], expected: str) -> None:
    for command in ("serve", "gateway"):
        assert settings_of(parser().parse_args([command, *argv]), environ).trace_file == expected


def test_trace_config_takes_the_file_only() -> None:
    for entry in ("level=TIMESTAMPS", "triton,file=", "opentelemetry,url=http://x"):
        with pytest.raises(BadSetting, match="only triton,file=PATH"):
            settings_of(parser().parse_args(["serve", "--trace-config", entry]), {})


def test_a_gateway_run_ensemble_writes_a_child_trace_per_step(tmp_path: Path, redis_url: str, key_prefix: str,
                                                             example_repository: Path) -> None:
    """As Triton 2.51's: the ensemble's trace has no compute of its own; each step's request has a trace of
    its own, with the ensemble's as parent_id and its request_id, inside the ensemble's time, not counted
    by trace_count. (A gateway runs the steps when no worker runs the ensemble: DESPINA_HOST_ENSEMBLES.)"""
    base = tmp_path / "traces" / "e.json"
    served = start_server(example_repository, tmp_path, redis_url, key_prefix, "--trace-file", str(base),
                          env={"DESPINA_HOST_ENSEMBLES": "false"}, wait_models=("mlp", "classify_post"))
    try:
        c = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
        c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1",
                                          "log_frequency": "1"})
        x = httpclient.InferInput("x", [1, 256], "FP32")
        x.set_data_from_numpy(np.zeros((1, 256), np.float32))
        for i in range(2):
            c.infer("mlp_classify", [x], request_id=f"e-{i}")
        c.close()
        found = {t["id"]: t for t in traced(base, 3)}
        time.sleep(0.3)
        assert len(traces(base)) == 3  # the first request's three: trace_count 1 counts the ensemble's alone
        parent = next(t for t in found.values() if "parent_id" not in t)
        assert parent["model_name"] == "mlp_classify" and parent["request_id"] == "e-0"
        check_timestamps(parent, [n for n in ORDER if not n.startswith("COMPUTE")])
        steps = sorted((t for t in found.values() if "parent_id" in t), key=lambda t: t["id"])
        assert [t["model_name"] for t in steps] == ["mlp", "classify_post"]
        assert [t["id"] for t in steps] == [parent["id"] + 1, parent["id"] + 2]  # as Triton numbers them
        stamps = {n["name"]: n["ns"] for n in parent["timestamps"]}
        for step in steps:
            assert list(step) == ["id", "model_name", "model_version", "request_id", "parent_id", "timestamps"]
            assert step["parent_id"] == parent["id"] and step["request_id"] == "e-0" and step["model_version"] == 1
            check_timestamps(step, STEP)
            assert stamps["QUEUE_START"] <= step["timestamps"][0]["ns"]
            assert step["timestamps"][-1]["ns"] <= stamps["INFER_RESPONSE_COMPLETE"]
    finally:
        stop_server(served)


def test_trace_count_is_the_servers_across_its_gateways(tmp_path: Path, redis_url: str, key_prefix: str,
                                                         example_repository: Path) -> None:
    """As one Triton server counts it: trace_count 3 with `--gateways 2` gives 3 traces in all, not 3 on
    each gateway, and GET answers what is left of it on either."""
    base = tmp_path / "traces" / "gw.json"
    served = start_server(example_repository, tmp_path, redis_url, key_prefix, "--gateways", "2",
                          "--trace-file", str(base), wait_models=("add_sub",))
    try:
        c = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
        c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "1"})
        send = both_gateways_tracing(served.url, base)
        time.sleep(0.5)
        before = len(traces(base))
        c.update_trace_settings(settings={"trace_count": "3"})
        time.sleep(0.5)  # the other gateway hears of it through the events channel
        send(30)
        time.sleep(1)
        assert len(traces(base)) - before == 3
        for _ in range(4):  # whichever gateway answers
            with httpx.Client() as fresh:
                assert fresh.get(f"{served.url}/v2/trace/setting").json()["trace_count"] == "0"
        c.close()
    finally:
        stop_server(served)


def _tracer(tmp_path: Path, frequency: int, count: int = -1) -> object:
    from despina.gateway.trace import Tracer

    tracer = Tracer(str(tmp_path / "trace.json"))
    tracer.follow({"global": {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": str(count),
                              "log_frequency": str(frequency)}})
    return tracer


async def test_a_step_trace_opened_after_its_ensemble_ended_is_written_alone(tmp_path: Path) -> None:
    """A gateway-run ensemble's step queued after the request ended (a decoupled step's branch whose next
    model was woken after another response failed the run) re-opened its parent's holding list, which
    nothing then emptied: the step's trace was never written and the list stayed for good."""
    from despina.contract.records import InferReply

    tracer: Any = _tracer(tmp_path, 1)
    parent = tracer.begin("e", 1, "", time.time_ns())
    first = tracer.child(parent, "a", 1)
    tracer.ending(first, lambda _: None)(InferReply(""))
    tracer.ending(parent, lambda _: None, computes=False)(InferReply(""))
    late = tracer.child(parent, "b", 1)
    tracer.ending(late, lambda _: None)(InferReply(""))
    assert tracer._children == {}
    parts = sorted(tmp_path.glob("trace.json.*"))
    models = [[e["model_name"] for e in json.loads(p.read_text()) if "model_name" in e] for p in parts]
    assert models == [["a", "e"], ["b"]]


async def test_a_step_trace_waiting_for_the_claim_goes_with_its_ensemble(tmp_path: Path) -> None:
    """A step's trace that ended while the server's trace_count claim was out waits for the claim's
    callback; its ensemble's trace ending in a callback queued before that one went without it (two parts
    where log_frequency 1 asks for one)."""
    from despina.contract.records import InferReply

    tracer: Any = _tracer(tmp_path, 1, count=10)
    go = asyncio.Event()

    async def claimer(counter: str, first: int) -> int:
        await go.wait()
        return 5

    tracer.claimer = claimer
    parent = tracer.begin("e", 1, "", time.time_ns())
    step = tracer.child(parent, "a", 1)
    tracer.ending(step, lambda _: None)(InferReply(""))  # the claim is out: its settling waits
    end_parent = tracer.ending(parent, lambda _: None, computes=False)
    go.set()  # the claim's task runs next, and as it ends it queues the step's settling...
    asyncio.get_running_loop().call_soon(end_parent, InferReply(""))  # ...after the ensemble's end
    for _ in range(100):
        await asyncio.sleep(0)
    parts = sorted(tmp_path.glob("trace.json.*"))
    models = [[e["model_name"] for e in json.loads(p.read_text()) if "model_name" in e] for p in parts]
    assert models == [["a", "e"]]
