"""A worker told to stop (SIGTERM: a rolling update, a scale-in) hands its models over before it lets go: the
control plane loads them on another worker while it serves on, so a model of `replicas` 1 does not pause."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from .conftest import Server
from .control_support import catalog_entry, wait_until, worker_hashes

# Its load waits while the file HOLD exists (as slow as the test wants), and fails while FAIL does.
MODEL = """
import os
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        while os.path.exists({hold!r}):
            time.sleep(0.05)
        if os.path.exists({fail!r}):
            raise RuntimeError("this model cannot load here")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
"""
BODY = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.5]}]}'
REQUEST_TIMEOUT_S = 2.0  # a request the model's move holds up longer than this gets 504


@contextmanager
def cluster(serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str,
            handover_s: float) -> Iterator[tuple[Server, Callable[[str], subprocess.Popen[bytes]]]]:
    """A gateway and control plane (`serve --workers 0`) on a repository of one model, "held", and a way to
    start `despina worker`s, killed at the end if still running."""
    repo = tmp_path / "repo"
    (repo / "held" / "1").mkdir(parents=True)
    (repo / "held" / "1" / "model.py").write_text(
        MODEL.format(hold=str(tmp_path / "hold"), fail=str(tmp_path / "fail")))
    (repo / "held" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n')
    server = serve(repo, "--workers", "0", "--model-replicas", "1", health="live",
                   env={"DESPINA_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)})
    env = {**os.environ, "DESPINA_WORKER_HANDOVER_S": str(handover_s), "DESPINA_WORKER_TTL_S": "2"}
    started: list[subprocess.Popen[bytes]] = []

    def worker(name: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"{name}.log").open("wb") as log:
            started.append(subprocess.Popen([sys.executable, "-m", "despina", "worker", "--redis-url", redis_url,
                                             "--key-prefix", key_prefix, "--worker-id", name],
                                            stdout=log, stderr=subprocess.STDOUT, env=env))
        wait_until(lambda: any(w.startswith(f"{name}.") for w in worker_hashes(redis_url, key_prefix)), 30,
                   what=f"worker {name}'s heartbeat")
        return started[-1]

    try:
        yield server, worker
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait()


def placed_on(redis_url: str, key_prefix: str) -> list[str]:
    """The workers the catalog places "held" on, by the name each was started with."""
    entry = catalog_entry(redis_url, key_prefix, "held")
    return [w.split(".")[0] for w in entry.workers] if entry is not None else []


def worker_states(server: Server) -> dict[str, str]:
    """The control plane's status page's workers, by the name each was started with: their state."""
    status = httpx.get(f"{server.metrics_url.removesuffix('/metrics')}/status.json", timeout=5).json()
    return {w["id"].split(".")[0]: w.get("state", "") for w in status["workers"]}


def ready(server: Server) -> bool:
    return httpx.get(f"{server.url}/v2/models/held/ready", timeout=5).status_code == 200


@contextmanager
def traffic(server: Server) -> Iterator[list[int | str]]:
    """Two clients sending requests one after the other while the block runs; yields every answer's status
    (or the error that came instead)."""
    answers: list[int | str] = []
    done = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                try:
                    answers.append(http.post(f"{server.url}/v2/models/held/infer", content=BODY,
                                             headers={"content-type": "application/json"}).status_code)
                except httpx.HTTPError as exc:
                    answers.append(repr(exc))
                time.sleep(0.02)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield answers
    finally:
        done.set()
        for thread in threads:
            thread.join()


def test_a_stopped_workers_model_of_one_replica_serves_on_while_it_moves(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """Worker A serves a model of `replicas` 1 under steady traffic; B runs beside it. A gets SIGTERM, and
    B's load of the model takes 3 s. A drained at once: the model had no worker until B loaded it, and
    the requests of those 3 s waited past their timeout, 504. Now A says it is leaving, the control plane
    loads the model on B, A serves meanwhile and lets go once B serves: every request is answered 200."""
    with cluster(serve, tmp_path, redis_url, key_prefix, handover_s=20) as (server, worker):
        a = worker("a")
        wait_until(lambda: ready(server), 30, what="the model to load on A")
        worker("b")
        time.sleep(1.0)  # B has been seen, and the model stays on A alone
        assert placed_on(redis_url, key_prefix) == ["a"]
        (tmp_path / "hold").touch()  # B's load waits
        with traffic(server) as answers:
            wait_until(lambda: len(answers) >= 10, 10, what="the first answers")
            a.send_signal(signal.SIGTERM)
            wait_until(lambda: "b" in placed_on(redis_url, key_prefix), 10, what="the model placed on B")
            # the status page says A is leaving (it showed A as any other worker), B serving
            wait_until(lambda: worker_states(server) == {"a": "leaving", "b": "serving"}, 10,
                       what="the status page to show A leaving")
            time.sleep(REQUEST_TIMEOUT_S + 1.0)
            left_early = a.poll() is not None  # before B could serve the model
            (tmp_path / "hold").unlink()
            assert a.wait(20) == 0
            sent = len(answers)
            wait_until(lambda: len(answers) >= sent + 10, 10, what="answers after A exited")
        assert placed_on(redis_url, key_prefix) == ["b"]
        failed = [a for a in answers if a != 200]
        assert not failed, (failed[:5], len(failed), len(answers), (tmp_path / "a.log").read_text()[-3000:])
        assert not left_early


def test_a_single_worker_stopped_drains_at_once(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """With no other worker to take its models, a worker stopped does not wait for one: it drains and exits
    at once, as before (not after DESPINA_WORKER_HANDOVER_S)."""
    with cluster(serve, tmp_path, redis_url, key_prefix, handover_s=60) as (server, worker):
        a = worker("a")
        wait_until(lambda: ready(server), 30, what="the model to load on A")
        stopped = time.monotonic()
        a.send_signal(signal.SIGTERM)
        assert a.wait(70) == 0
        assert time.monotonic() - stopped < 20, (tmp_path / "a.log").read_text()[-3000:]


def test_a_handover_whose_load_fails_lets_the_worker_go(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The model cannot load on B: A, stopped, exits once B's load failed, before its handover's deadline."""
    with cluster(serve, tmp_path, redis_url, key_prefix, handover_s=30) as (server, worker):
        a = worker("a")
        wait_until(lambda: ready(server), 30, what="the model to load on A")
        worker("b")
        (tmp_path / "fail").touch()
        stopped = time.monotonic()
        a.send_signal(signal.SIGTERM)
        assert a.wait(40) == 0
        # well before the deadline (a loaded machine's load and drain take seconds): B's failure let it go
        assert time.monotonic() - stopped < 20, (tmp_path / "a.log").read_text()[-3000:]
        assert "failed" in (tmp_path / "b.log").read_text()


def test_a_handover_whose_load_hangs_ends_at_its_deadline(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """B's load of the model hangs: A, stopped, serves on until DESPINA_WORKER_HANDOVER_S, then drains
    and exits."""
    with cluster(serve, tmp_path, redis_url, key_prefix, handover_s=3) as (server, worker):
        a = worker("a")
        wait_until(lambda: ready(server), 30, what="the model to load on A")
        worker("b")
        (tmp_path / "hold").touch()
        stopped = time.monotonic()
        a.send_signal(signal.SIGTERM)
        assert a.wait(20) == 0
        took = time.monotonic() - stopped
        assert 2.5 < took < 10, (took, (tmp_path / "a.log").read_text()[-3000:])
        assert "b" in placed_on(redis_url, key_prefix)
