"""Serving from S3 (SeaweedFS) in poll mode: new versions switch in without a failed request, a broken
version leaves the old one serving, reloads come from the cache, and a dead store harms nothing loaded."""
from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from despina.control.commands import LOAD_LOOK_S
from despina.control.registration import SCAN_LOOK_S
from despina.examples import build_mlp
from despina.registry import open_registry
from despina.registry.transfer import push

from .conftest import Server
from .control_support import expected, index, infer, mlp_folder, wait_until, worker_hashes
from .seaweed import ACCESS_KEY, SECRET_KEY, Weed, start_weed


class Load:
    """Light traffic in a thread: one request every few milliseconds, every answer kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str, list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                r = infer(self.url, client=client)
                doc = r.json()
                self.answers.append((r.status_code, doc.get("model_version", doc.get("error", "")),
                                     doc["outputs"][0]["data"] if r.status_code == 200 else []))
                time.sleep(0.01)

    def versions(self) -> set[str]:
        return {v for _, v, _ in self.answers[-5:]}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_poll_switches_versions_without_a_failed_request(
        serve: Callable[..., Server], s3_env: Weed, tmp_path: Path) -> None:
    s3_store = s3_env
    url = s3_store.url()
    settings = s3_store.settings()
    push(mlp_folder(tmp_path / "v1"), url, settings, out=io.StringIO())
    server = serve(url, "--model-control-mode", "poll", "--repository-poll-secs", "0.3", wait_models=("mlp",),
                   env={**s3_store.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    load = Load(server.url)
    try:
        wait_until(lambda: len(load.answers) > 10, what="traffic")
        push(mlp_folder(tmp_path / "v2", versions={1: 1}), url, settings, version=2, out=io.StringIO())
        wait_until(lambda: load.versions() == {"2"}, 30, what="version 2 to serve")
        wait_until(lambda: {(r.get("state"), r.get("reason")) for r in index(server.url)
                            if r["name"] == "mlp" and r.get("version") == "1"} == {("UNAVAILABLE", "unloaded")},
                   10, what="version 1 to be unloaded (listed UNAVAILABLE 'unloaded', as Triton lists it)")

        broken = tmp_path / "v3" / "mlp"
        mlp_folder(tmp_path / "v3")
        (broken / "1" / "model.onnx").write_bytes(b"not an onnx file")
        push(broken, url, settings, version=3, out=io.StringIO())
        rows = wait_until(lambda: [r for r in index(server.url) if r.get("version") == "3"
                                   and r.get("state") == "UNAVAILABLE"], 30, what="version 3 to fail")
        assert "failed" in rows[0]["reason"] or "onnx" in rows[0]["reason"].lower(), rows
        ready = [r for r in index(server.url, ready=True) if r["name"] == "mlp"]
        assert [r["version"] for r in ready] == ["2"]
        count = len(load.answers)
        wait_until(lambda: len(load.answers) > count + 10, what="more traffic")
    finally:
        load.stop()
    statuses = [s for s, _, _ in load.answers]
    assert statuses == [200] * len(statuses), {s: v for s, v, _ in load.answers if s != 200}
    seen = [v for _, v, _ in load.answers]
    assert seen[0] == "1" and seen[-1] == "2" and "3" not in seen
    first = seen.index("2")
    assert all(v == "2" for v in seen[first:])  # once the new version serves, the old is never used again
    for _, version, data in (load.answers[0], load.answers[-1]):
        assert np.allclose(data, expected(0 if version == "1" else 1), atol=1e-4)
    assert "version 3 failed to load" in server.logs()


def test_reloads_come_from_the_cache_and_a_dead_store_harms_nothing_loaded(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    weed = start_weed(tmp_path / "own-s3")   # this test kills it
    for key, value in weed.env.items():
        monkeypatch.setenv(key, value)
    try:
        url = weed.url()
        push(mlp_folder(tmp_path / "src", extra='parameters { key: "idle_timeout_s" value: { string_value: '
                                                  '"1" } }'), url, weed.settings(), out=io.StringIO())
        cache = tmp_path / "cache"
        server = serve(url, "--model-control-mode", "poll", "--repository-poll-secs", "0.3",
                       wait_models=("mlp",), env={**weed.env, "DESPINA_CACHE_DIR": str(cache)})
        blobs = sorted(p.name for p in (cache / "blobs").glob("*/*"))
        assert len(blobs) == 2                    # config.pbtxt and model.onnx, fetched once for all
        assert infer(server.url).status_code == 200

        def downloads() -> int:
            return sum(orjson.loads(h.get(b"cache", b"{}")).get("downloads", 0)
                       for h in worker_hashes(redis_url, key_prefix).values())

        before = downloads()
        wait_until(lambda: any(r.get("reason", "").startswith("idle") for r in index(server.url)), 15,
                   what="mlp to idle out")
        assert infer(server.url).status_code == 200   # a cold start: the files come from the cache
        assert downloads() == before and sorted(p.name for p in (cache / "blobs").glob("*/*")) == blobs

        weed.stop(signal.SIGKILL)
        wait_until(lambda: "is unreachable" in server.logs(), 15, what="a failed poll in the logs")
        row = wait_until(lambda: next((r for r in index(server.url) if r["name"] == "mlp"
                                       and "cannot be read" in r.get("reason", "")), None), 15,
                         what="the index to tell")
        assert "unreachable" in row["reason"]
        r = infer(server.url)
        assert r.status_code == 200, r.text
    finally:
        weed.stop()


def test_a_worker_that_cannot_fetch_waits_for_the_store_and_loads_once_it_is_back(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker with a cache of its own (another machine) joins while the store is down: the version was
    failed for good, so that only a restart or new files brought it back; it waits, LOADING, saying why."""
    weed = start_weed(tmp_path / "own-s3")   # this test stops it
    for key, value in weed.env.items():
        monkeypatch.setenv(key, value)
    worker: subprocess.Popen[bytes] | None = None
    try:
        url = weed.url()
        push(mlp_folder(tmp_path / "src"), url, weed.settings(), out=io.StringIO())
        server = serve(url, "--model-control-mode", "poll", "--repository-poll-secs", "0.5", "--workers", "0",
                       health="live", env={**weed.env, "DESPINA_CACHE_DIR": str(tmp_path / "control-cache")})
        wait_until(lambda: any(r.get("version") == "1" for r in index(server.url)), 30, what="mlp in the catalog")
        weed.stop()
        with (tmp_path / "worker.log").open("wb") as log:
            worker = subprocess.Popen([sys.executable, "-m", "despina", "worker", "--redis-url", redis_url,
                                       "--key-prefix", key_prefix], stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, **weed.env, "DESPINA_CACHE_DIR": str(tmp_path / "worker")})
        wait_until(lambda: "unreachable" in (tmp_path / "worker.log").read_text(), 30, what="a failed fetch")
        row = wait_until(lambda: next((r for r in index(server.url) if r.get("version") == "1"
                                       and (r.get("state") != "LOADING" or "waits" in r.get("reason", ""))), None),
                         30, what="the index to say why mlp cannot load")
        assert row["state"] == "LOADING" and "unreachable" in row["reason"], row
        weed.restart()
        wait_until(lambda: [r["version"] for r in index(server.url, ready=True) if r["name"] == "mlp"] == ["1"],
                   60, what="mlp to load once the store is back")
        r = infer(server.url)
        assert r.status_code == 200 and np.allclose(r.json()["outputs"][0]["data"], expected(0), atol=1e-4)
        assert "Traceback" not in (tmp_path / "worker.log").read_text()
        wait_until(lambda: "can be read again" in server.logs(), 10, what="the control plane to say the store is back")
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
        weed.stop()


def test_load_model_at_start_waits_for_a_store_that_is_down(
        serve: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # explicit mode's --load-model was tried once: a store down at start left the model unloaded for good
    weed = start_weed(tmp_path / "own-s3")   # this test stops it
    for key, value in weed.env.items():
        monkeypatch.setenv(key, value)
    try:
        url = weed.url()
        push(mlp_folder(tmp_path / "src"), url, weed.settings(), out=io.StringIO())
        weed.stop()
        server = serve(url, "--model-control-mode", "explicit", "--load-model", "mlp", health="live",
                       env={**weed.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
        wait_until(lambda: "--load-model mlp: registry" in server.logs(), 30, what="the failed load in the logs")
        weed.restart()
        wait_until(lambda: [r["version"] for r in index(server.url, ready=True) if r["name"] == "mlp"] == ["1"],
                   60, what="mlp to load once the store is back")
        assert infer(server.url).status_code == 200
        assert server.logs().count("--load-model mlp") == 1   # said once, not at every try
    finally:
        weed.stop()


def test_loading_from_a_dead_store_fails_clearly(serve: Callable[..., Server], tmp_path: Path) -> None:
    from despina.embedded import free_port

    server = serve("s3://models/nowhere", "--model-control-mode", "explicit",
                   env={"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
                        "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
                        "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
    assert r.status_code == 503 and "unreachable" in r.json()["error"]


def test_a_store_that_refuses_the_keys_is_unavailable_not_an_internal_error(
        serve: Callable[..., Server], s3_env: Weed, tmp_path: Path) -> None:
    # SignatureDoesNotMatch (and AccessDenied, InternalError...) answered the load API 500
    url = s3_env.url()
    push(mlp_folder(tmp_path / "src"), url, s3_env.settings(), out=io.StringIO())
    server = serve(url, "--model-control-mode", "explicit",
                   env={**s3_env.env, "AWS_SECRET_ACCESS_KEY": "wrong", "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
    assert r.status_code == 503 and "SignatureDoesNotMatch" in r.json()["error"], r.text
    assert "Traceback" not in server.logs()


@contextlib.contextmanager
def served_by_a_hung_store(serve: Callable[..., Server], tmp_path: Path, *extra: str,
                           health: str = "ready") -> Iterator[Server]:
    """serve (in explicit mode, unless `extra` says otherwise) on a store that takes connections and never
    answers them."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)   # connections complete in the backlog; nothing ever reads them
        yield serve("s3://models/hung", *(extra or ("--model-control-mode", "explicit")), health=health,
                    env={"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{hung.getsockname()[1]}",
                         "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
                         "DESPINA_CACHE_DIR": str(tmp_path / "cache")})


def test_the_index_answers_while_the_store_hangs(serve: Callable[..., Server], tmp_path: Path) -> None:
    """A store that takes connections and never answers held each index for boto3's read timeout: the
    gateway gave up after 30 s, blaming the control plane; an empty catalog answered [] as if all was well."""
    with served_by_a_hung_store(serve, tmp_path) as server:
        for _ in range(2):  # the second one shares the first one's listing, still hanging
            r = httpx.post(f"{server.url}/v2/repository/index", timeout=60)
            assert r.status_code == 503, r.text
            assert "s3://models/hung did not list its models" in r.json()["error"], r.text


def test_a_load_answers_503_in_time_while_the_store_hangs(serve: Callable[..., Server], tmp_path: Path) -> None:
    """A load against a store that takes connections and never answers waited boto3's read timeout three
    times (~3 min) before its 503, past most clients' timeouts: its registry reads are bounded by
    LOAD_LOOK_S (and by the request's time, when shorter). Calls meanwhile are refused at once rather than
    each holding another thread on the hung store."""
    with served_by_a_hung_store(serve, tmp_path) as server:
        r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
        assert r.status_code == 503, r.text
        said = f"s3://models/hung did not answer the load of model 'mlp' within {LOAD_LOOK_S:.3g} s"
        assert said in r.json()["error"], r.text
        r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
        assert r.status_code == 503, r.text
        assert "has not yet answered an earlier read of model 'mlp'" in r.json()["error"], r.text
        assert "Traceback" not in server.logs()


def test_a_load_with_files_does_not_touch_the_store(serve: Callable[..., Server], tmp_path: Path) -> None:
    """A load with `file:` entries wrote them into the store before it read the model (and against a store
    that hangs, waited for those writes). As Triton's, which loads such files from a temporary folder, the
    files given are the model alone and the store is neither written nor read: against a store that takes
    connections and never answers, the load serves them."""
    config = orjson.dumps({"backend": "onnxruntime", "max_batch_size": 4}).decode()
    build_mlp(tmp_path / "model.onnx")
    onnx = base64.b64encode((tmp_path / "model.onnx").read_bytes()).decode()
    with served_by_a_hung_store(serve, tmp_path) as server:
        started = time.monotonic()
        r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60,
                       json={"parameters": {"config": config, "file:1/model.onnx": onnx}})
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < LOAD_LOOK_S
        r = infer(server.url)
        assert r.status_code == 200 and np.allclose(r.json()["outputs"][0]["data"], expected(0), atol=1e-4)
        assert "Traceback" not in server.logs()


def test_a_load_with_files_leaves_the_store_as_it_was(serve: Callable[..., Server], s3_env: Weed,
                                                      tmp_path: Path) -> None:
    url, settings = s3_env.url(), s3_env.settings()
    push(mlp_folder(tmp_path / "repo", versions={1: 0}), url, settings, out=io.StringIO())
    before = open_registry(url, settings).model("mlp").files
    server = serve(url, "--model-control-mode", "explicit", "--load-model", "mlp", wait_models=("mlp",),
                   env={**s3_env.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    build_mlp(tmp_path / "two.onnx", seed=1)
    config = orjson.dumps({"backend": "onnxruntime", "max_batch_size": 8}).decode()
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60, json={"parameters": {
        "config": config, "file:2/model.onnx": base64.b64encode((tmp_path / "two.onnx").read_bytes()).decode()}})
    assert r.status_code == 200, r.text
    assert open_registry(url, settings).model("mlp").files == before
    wait_until(lambda: httpx.get(f"{server.url}/v2/models/mlp/versions/1/ready").status_code == 400,
               what="version 1 to go (only the files given are the model)")
    r = infer(server.url)
    assert r.json()["model_version"] == "2" and np.allclose(r.json()["outputs"][0]["data"], expected(1), atol=1e-4)
    assert httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60).status_code == 200
    wait_until(lambda: infer(server.url).json().get("model_version") == "1", what="the store's version 1 again")


def test_a_poll_whose_scan_hangs_is_logged_and_skipped(serve: Callable[..., Server], tmp_path: Path) -> None:
    """A look at a store that takes connections and never answers held the registry's loop for boto3's read
    timeout three times (and the same again for each poll), saying nothing. A scan is bounded by SCAN_LOOK_S,
    logged; the polls while it is still out are skipped rather than queued behind it."""
    with served_by_a_hung_store(serve, tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "1",
                                health="live") as server:
        said = f"s3://models/hung did not answer a scan of the repository within {SCAN_LOOK_S:g} s"
        wait_until(lambda: said in server.logs(), SCAN_LOOK_S + 15, what="the scan's bound")
        assert "Traceback" not in server.logs()


def test_a_model_whose_files_the_store_refuses_says_why_and_is_tried_again(
        serve: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys that may list but not read: the model was marked UNAVAILABLE for good (its files taken for
    bad); now it is tried again at each poll, and meanwhile the index says why."""
    identities = {"identities": [
        {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
         "actions": ["Admin", "Read", "Write", "List"]},
        {"name": "lister", "credentials": [{"accessKey": "lister", "secretKey": "lister-secret"}], "actions": ["List"]}]}
    (tmp_path / "s3.json").write_bytes(orjson.dumps(identities))
    weed = start_weed(tmp_path / "own-s3", 30.0, f"-s3.config={tmp_path / 's3.json'}")
    for key, value in weed.env.items():
        monkeypatch.setenv(key, value)
    try:
        url = weed.url()
        push(mlp_folder(tmp_path / "src"), url, weed.settings(), out=io.StringIO())
        server = serve(url, "--model-control-mode", "poll", "--repository-poll-secs", "0.3", health="live",
                       env={**weed.env, "AWS_ACCESS_KEY_ID": "lister", "AWS_SECRET_ACCESS_KEY": "lister-secret",
                            "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
        row = wait_until(lambda: next((r for r in index(server.url) if r["name"] == "mlp" and "state" in r), None),
                         30, what="the index to say why mlp cannot load")
        assert row["state"] == "UNAVAILABLE" and "AccessDenied" in row["reason"], row
        count = server.logs().count("AccessDenied")
        wait_until(lambda: server.logs().count("AccessDenied") > count, 30, what="another try")
    finally:
        weed.stop()


def test_a_repository_never_read_is_not_ready(serve: Callable[..., Server], tmp_path: Path) -> None:
    """Until the control plane has read the repository once, the empty catalog means nothing: live, not
    ready (the first read of a dead store never succeeds here)."""
    from despina.embedded import free_port

    server = serve("s3://models/nowhere", "--model-control-mode", "poll", health="live",
                   env={"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
                        "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
                        "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    wait_until(lambda: "unreachable" in server.logs(), 30)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 400  # as Triton says not ready
        assert httpx.get(f"{server.url}/readyz").status_code == 503  # nothing this gateway could route
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_a_worker_keeps_the_files_it_serves_and_the_cache_lets_the_rest_go(
        serve: Callable[..., Server], s3_env: Weed, tmp_path: Path) -> None:
    """A cache limit of ~1 KB: always full. The folder a worker serves from stays however old its
    files look (the worker marks it at every heartbeat); once nothing serves from it, the next fetch
    evicts it, and what serves now keeps answering."""
    url, settings = s3_env.url(), s3_env.settings()
    push(mlp_folder(tmp_path / "v1"), url, settings, out=io.StringIO())
    cache = tmp_path / "cache"
    server = serve(url, "--model-control-mode", "poll", "--repository-poll-secs", "0.3", wait_models=("mlp",),
                   env={**s3_env.env, "DESPINA_CACHE_DIR": str(cache), "DESPINA_CACHE_MAX_GB": "0.000001"})
    models = cache / "models" / "mlp"
    [v1] = [f for f in models.iterdir() if (f / "1" / "model.onnx").exists()]  # (the control plane reads the config)
    hour_ago = time.time() - 3600

    def age(folder: Path) -> None:
        for path in [folder, *folder.rglob("*")]:
            os.utime(path, (hour_ago, hour_ago))

    age(v1)
    wait_until(lambda: v1.stat().st_mtime > time.time() - 30, 10, what="the worker to mark its folder in use")
    push(mlp_folder(tmp_path / "v2", versions={2: 1}), url, settings, out=io.StringIO())
    wait_until(lambda: [r["version"] for r in index(server.url, ready=True) if r["name"] == "mlp"] == ["2"], 30,
               what="version 2 alone to serve")
    assert v1.is_dir()  # fetched while version 1 still served: kept
    age(v1)
    time.sleep(3)       # past a few heartbeats: nothing marks it any more
    assert v1.stat().st_mtime < time.time() - 3000
    push(mlp_folder(tmp_path / "v3", versions={3: 2}), url, settings, out=io.StringIO())
    wait_until(lambda: [r["version"] for r in index(server.url, ready=True) if r["name"] == "mlp"] == ["3"], 30,
               what="version 3 alone to serve")
    assert not v1.exists(), sorted(p.name for p in models.iterdir())
    assert "cache: evicted mlp/" in server.logs()
    metrics = httpx.get(server.metrics_url).text
    evicted = {line.split("}")[0].split("=")[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("despina_artifact_cache_evicted_bytes{")}
    assert '"control"' in evicted and len(evicted) == 2 and sum(evicted.values()) > 0, metrics  # control, the worker
    r = infer(server.url)
    assert r.status_code == 200 and np.allclose(r.json()["outputs"][0]["data"], expected(2), atol=1e-4)


def test_the_checksum_agent_checks_files_of_other_versions_fetched_from_s3(
        serve: Callable[..., Server], s3_env: Weed, tmp_path: Path) -> None:
    """Triton copies the whole model folder out of S3 before its checksum agent runs; a worker fetched only
    the files of the version it loads (and those outside version folders), so a digest listed for a file
    of another version failed the load: "checksum agent: cannot read file 1/model.onnx"."""
    import hashlib

    src = mlp_folder(tmp_path / "src", versions={1: 0, 2: 1})
    digests = {v: hashlib.md5((src / str(v) / "model.onnx").read_bytes()).hexdigest() for v in (1, 2)}

    def agent(md5_of_1: str) -> str:
        return ('model_repository_agents { agents [ { name: "checksum" parameters [ '
                f'{{ key: "MD5:1/model.onnx" value: "{md5_of_1}" }}, '
                f'{{ key: "MD5:2/model.onnx" value: "{digests[2]}" }} ] }} ] }}')

    url = s3_env.url()
    push(mlp_folder(tmp_path / "src", versions={1: 0, 2: 1}, extra=agent(digests[1])), url, s3_env.settings(),
         out=io.StringIO())
    server = serve(url, "--model-control-mode", "explicit",
                   env={**s3_env.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
    assert r.status_code == 200, r.text
    answer = infer(server.url)
    assert answer.status_code == 200 and answer.json()["model_version"] == "2"   # the latest only serves
    # the other version's file is read, not skipped: a wrong digest for it fails the load
    push(mlp_folder(tmp_path / "src", versions={1: 0, 2: 1}, extra=agent("0" * 32)), url, s3_env.settings(),
         out=io.StringIO())
    r = httpx.post(f"{server.url}/v2/repository/models/mlp/load", timeout=60)
    assert r.status_code == 400 and "mismatched MD5 hash for file 1/model.onnx" in r.json()["error"], r.text


def test_a_prefix_holding_no_models_says_so_at_start(serve: Callable[..., Server], s3_env: Weed,
                                                     tmp_path: Path) -> None:
    """A mistyped prefix served nothing, ready, and said only "catalog: 0 models, 0 usable (none)". As
    Triton's, an empty repository still starts; the log now says what is wrong, in one line."""
    url = s3_env.url()
    server = serve(url, env={**s3_env.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    wait_until(lambda: "catalog: 0 models" in server.logs(), 30, what="the first read of the repository")
    assert f"WARNING repository {url} holds no model folders: nothing to serve" in server.logs()
    assert "Traceback" not in server.logs()
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
