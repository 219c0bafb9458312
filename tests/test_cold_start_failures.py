"""A cold start that fails: its callers hear the load's error with a Retry-After that is true, later
requests hear the same until a request may try again (a backoff doubling with each failure in a row), and
a failure that passes heals with a later request, with nobody loading the model by hand."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import redis

from despina.contract.catalog import IDLE, CatalogEntry, cold_start_failed
from despina.contract.commands import Answer
from despina.contract.errors import DespinaError
from despina.contract.keys import Keys
from despina.control.idle import backoff_s
from despina.gateway.http import error_parts

from .conftest import Server, stop_server
from .control_support import index, wait_until
from .test_control_scale import loaded_models

# initialize fails while the marker file exists: a load that fails, then heals when the marker goes
FLAKY = """
import os
import triton_python_backend_utils as pb_utils

BROKEN = {broken!r}


class TritonPythonModel:
    def initialize(self, args):
        if os.path.exists(BROKEN):
            raise RuntimeError("the marker says this load fails")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
"""
CONFIG = ('backend: "python"\nmax_batch_size: 0\n'
          'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
          'output [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
          'parameters { key: "idle_timeout_s" value: { string_value: "1" } }\n')
PIPE = ('platform: "ensemble"\nmax_batch_size: 0\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n'
        'ensemble_scheduling { step [ { model_name: "flaky" model_version: -1 '
        'input_map { key: "x" value: "x" } output_map { key: "x" value: "y" } } ] }\n')
BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
ERROR = "initialize failed: RuntimeError: the marker says this load fails"


def flaky_repository(repo: Path, broken: Path) -> None:
    (repo / "flaky" / "1").mkdir(parents=True)
    (repo / "flaky" / "1" / "model.py").write_text(FLAKY.format(broken=str(broken)))
    (repo / "flaky" / "config.pbtxt").write_text(CONFIG)
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.pbtxt").write_text(PIPE)


def refused(r: httpx.Response, most_s: int) -> int:
    """The Retry-After of a refusal that carries the load's error: at most the backoff left."""
    assert r.status_code == 503 and ERROR in r.json()["error"], r.text
    after = int(r.headers["retry-after"])
    assert 1 <= after <= most_s, (after, r.text)
    return after


def cold_starts(redis_url: str, prefix: str) -> dict[str, object]:
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.hget(Keys(prefix).cold_starts, "flaky")
    finally:
        client.close()
    return orjson.loads(raw) if raw else {}


def test_a_failed_cold_start_says_why_backs_off_and_heals(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo, broken = tmp_path / "repo", tmp_path / "broken"
    flaky_repository(repo, broken)
    server = serve(repo, wait_models=("flaky", "pipe"))
    wait_until(lambda: "flaky" not in loaded_models(redis_url, key_prefix), 15, what="flaky to be unloaded")
    broken.touch()

    async def first_callers() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return list(await asyncio.gather(*(client.post("/v2/models/flaky/infer", json=BODY)
                                               for _ in range(3))))

    for r in asyncio.run(first_callers()):  # each hears the load's error, and when a retry may succeed
        refused(r, 2)
    # a retry within the backoff hears the same at once (it was a 404 "has no available versions"), and so
    # do the function URL and an ensemble that calls the model
    r = httpx.post(f"{server.url}/v2/models/flaky/infer", json=BODY, timeout=30)
    refused(r, 2)
    assert r.json()["error"].startswith(
        "load failed for model 'flaky': version 1 is at UNAVAILABLE state: model 'flaky': initialize failed"), r.text
    r = httpx.post(f"{server.url}/v2/models/pipe/infer", json=BODY, timeout=30)
    assert "ensemble 'pipe'" in r.json()["error"], r.text
    refused(r, 2)
    assert httpx.get(f"{server.url}/v2/models/flaky").status_code == 200  # still registered
    assert httpx.get(f"{server.url}/v2/models/flaky/ready").status_code != 200
    rows = {r["name"]: r for r in index(server.url)}
    assert rows["flaky"]["state"] == "UNAVAILABLE" and ERROR in rows["flaky"]["reason"], rows
    assert rows["pipe"]["state"] == "UNAVAILABLE" and ERROR in rows["pipe"]["reason"], rows
    assert server.logs().count("loading flaky version 1") == 2  # at start, and one cold start for them all

    # past the backoff a request tries again; it fails again, and the next backoff is twice as long
    time.sleep(2.1)
    after = refused(httpx.post(f"{server.url}/fn/flaky", json={"x": [1.0]}, timeout=30), 4)
    assert after > 2, after
    assert server.logs().count("loading flaky version 1") == 3
    doc = cold_starts(redis_url, key_prefix)
    assert doc.get("failed") == 2 and ERROR in str(doc.get("last_error")), doc
    metrics = httpx.get(server.metrics_url).text
    assert 'despina_cold_start_failures_total{model="flaky",version="1"} 2' in metrics
    status = server.metrics_url.removesuffix("/metrics") + "/status.json"

    def status_row() -> dict[str, object] | None:  # (the control plane samples every 2 s)
        row = next((m for m in httpx.get(status).json()["models"] if m["name"] == "flaky"), None)
        return row if row is not None and row["cold_start_failures"] == 2 else None

    row = wait_until(status_row, 10, what="the status page's row")
    assert row["target"] == "idle" and ERROR in str(row["reason"]), row

    broken.unlink()  # the failure passes: a request after the backoff loads the model, nobody else does
    time.sleep(after + 0.1)
    r = httpx.post(f"{server.url}/v2/models/flaky/infer", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/v2/models/pipe/infer", json=BODY, timeout=30).status_code == 200
    row = next(r for r in index(server.url) if r["name"] == "flaky")
    assert row["state"] == "READY", row
    doc = cold_starts(redis_url, key_prefix)
    assert doc.get("count") == 1 and doc.get("failed") == 2, doc


def test_a_cold_start_failure_travels_with_its_backoff() -> None:
    """Through the catalog (where gateways read it) and the control plane's answers (a wake's), and out as
    Retry-After: the seconds left, rounded up, not the UNAVAILABLE code's 1."""
    e = CatalogEntry("m", "/r/m", {}, (1,), target=IDLE, cold_error="load failed for model 'm'",
                     cold_failures=2, cold_retry_at=100.0)
    assert CatalogEntry.loads(e.dumps()) == e
    failed = cold_start_failed(e, 96.5)
    assert failed is not None and failed.retry_after == 3.5
    assert cold_start_failed(e, 100.0) is None  # a request may try again
    try:
        Answer.loads(Answer.error(failed).dumps()).result()
    except DespinaError as exc:
        status, body, headers = error_parts(exc)
    assert status == 503 and b"load failed for model 'm'" in body
    assert headers == [(b"retry-after", b"4")]


def test_new_files_end_a_failed_cold_starts_backoff(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The backoff is for the files that failed: new ones are tried by the next request, at once."""
    repo, broken = tmp_path / "repo", tmp_path / "broken"
    flaky_repository(repo, broken)
    server = serve(repo, "--model-control-mode", "poll", "--repository-poll-secs", "1",
                   wait_models=("flaky", "pipe"))
    wait_until(lambda: "flaky" not in loaded_models(redis_url, key_prefix), 15, what="flaky to be unloaded")
    broken.touch()
    after = 0
    for most_s in (2, 4, 8):  # three failures in a row: the next try is 8 s off
        time.sleep(after)
        after = refused(httpx.post(f"{server.url}/v2/models/flaky/infer", json=BODY, timeout=30), most_s)
    assert after > 4, after
    model = repo / "flaky" / "1" / "model.py"
    model.write_text(model.read_text() + "\n# mended\n")
    broken.unlink()
    wait_until(lambda: "model flaky changed in the repository" in server.logs(), 10, what="the poll to see it")
    row = next(r for r in index(server.url) if r["name"] == "flaky")
    assert row["reason"].startswith("idle"), row  # the failure is forgotten, its backoff with it
    r = httpx.post(f"{server.url}/v2/models/flaky/infer", json=BODY, timeout=30)
    assert r.status_code == 200, r.text


def test_a_restarted_control_plane_keeps_a_failed_cold_starts_backoff(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A control plane that starts (a restart, a new leader) reads the same files: the backoff goes on. It
    was forgotten: a crash-looping control plane had a broken model loaded again every 2 s, the first
    request after each start trying it."""
    repo, broken = tmp_path / "repo", tmp_path / "broken"
    flaky_repository(repo, broken)
    server = serve(repo, wait_models=("flaky", "pipe"))
    wait_until(lambda: "flaky" not in loaded_models(redis_url, key_prefix), 15, what="flaky to be unloaded")
    broken.touch()
    after = 0
    for most_s in (2, 4, 8, 16):  # four failures in a row: the next try is 16 s off
        time.sleep(after)
        after = refused(httpx.post(f"{server.url}/v2/models/flaky/infer", json=BODY, timeout=30), most_s)
    assert after > 8, after
    stop_server(server)
    server = serve(repo)  # the same Redis and keys: the catalog as the last one left it
    r = httpx.post(f"{server.url}/v2/models/flaky/infer", json=BODY, timeout=30)
    refused(r, 16)
    assert "4 times in a row" in r.json()["error"], r.text
    assert "loading flaky version 1" not in server.logs()  # not tried again
    assert cold_starts(redis_url, key_prefix).get("failed") == 4


def test_the_backoff_stops_doubling_at_its_cap() -> None:
    """Doubled past 1,024 failures in a row, 2.0 ** n overflowed: the tick that met it failed, and the
    model stayed loaded with its versions failed (404) for good."""
    assert [backoff_s(n) for n in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert backoff_s(9) == backoff_s(1025) == backoff_s(10**6) == 300.0
