"""Two workers; the one serving the model is killed with SIGKILL while requests flow. The model is placed
on another worker, the requests the dead one had read are requeued, and every request is answered."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from .conftest import FULL_QUEUE_DELAY, Server
from .control_support import catalog_entry, mlp_folder, wait_until, worker_hashes
from .test_control_s3 import Load


def test_a_killed_worker_loses_no_request(serve: Callable[..., Server], tmp_path: Path, redis_url: str,
                                          key_prefix: str) -> None:
    repo = tmp_path / "repo"
    # a slow batch (max_queue_delay 0.3 s) so that the killed worker dies holding requests it had read
    mlp_folder(repo, delay_us=300_000)
    server = serve(repo, "--workers", "2", wait_models=("mlp",), env={"DESPINA_WORKER_TTL_S": "2", **FULL_QUEUE_DELAY})
    wait_until(lambda: len(worker_hashes(redis_url, key_prefix)) == 2, what="two workers")
    entry = catalog_entry(redis_url, key_prefix, "mlp")
    assert entry is not None and len(entry.workers) == 1          # one replica by default
    victim = entry.workers[0]
    pid = orjson.loads(worker_hashes(redis_url, key_prefix)[victim][b"info"])["pid"]

    load = [Load(server.url) for _ in range(4)]
    try:
        wait_until(lambda: sum(len(x.answers) for x in load) > 8, what="traffic")
        time.sleep(0.15)  # mid-batch
        os.kill(pid, signal.SIGKILL)
        moved = wait_until(lambda: (e := catalog_entry(redis_url, key_prefix, "mlp")) is not None
                           and e.workers and victim not in e.workers and e, 30, what="the model to move")
        count = sum(len(x.answers) for x in load)
        wait_until(lambda: sum(len(x.answers) for x in load) > count + 20, 30, what="traffic after the move")
    finally:
        for x in load:
            x.stop()
    statuses = [s for x in load for s, _, _ in x.answers]
    assert statuses == [200] * len(statuses), [a for x in load for a in x.answers if a[0] != 200][:3]
    assert moved.workers[0] != victim
    assert f"worker {victim} stopped sending heartbeats" in server.logs()
    assert "requeued" in server.logs()


FIRST_LOAD_FAILS = '''import os
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        try:  # the first instance to start, on whichever worker, fails; every later one loads
            os.close(os.open({marker!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        raise RuntimeError("the first load fails")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
'''


def test_a_load_that_fails_on_one_worker_is_answered_by_the_next_try(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """A model that fails on a worker is tried on another: the load answers once that try is over, not
    with the first worker's error while the second loads it."""
    repo = tmp_path / "repo"
    (repo / "flaky" / "1").mkdir(parents=True)
    (repo / "flaky" / "config.pbtxt").write_text(
        'name: "flaky"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        'output [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        'instance_group [ { count: 1, kind: KIND_CPU } ]\n')
    (repo / "flaky" / "1" / "model.py").write_text(FIRST_LOAD_FAILS.format(marker=str(tmp_path / "tried")))
    server = serve(repo, "--workers", "2", "--model-control-mode", "explicit")
    wait_until(lambda: server.logs().count("for models") >= 2, what="two workers")
    r = httpx.post(f"{server.url}/v2/repository/models/flaky/load", timeout=60)
    assert r.status_code == 200, r.text
    assert (tmp_path / "tried").exists()  # the first try did fail
    r = httpx.post(f"{server.url}/v2/models/flaky/infer", timeout=30,
                   json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1.0, 2.0], r.text
