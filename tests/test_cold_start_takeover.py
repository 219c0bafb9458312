"""A cold start under way when its control plane goes (SIGKILLed; a standby takes over): the control plane
that leads next knows it for one, from the catalog. It did not (the cold start lived in the old leader's
memory): a load that then failed left the model loaded with its version failed and placed on no worker, with
no backoff and no later request trying it again until someone loaded it by hand (a failed cold start backs off
and heals), and one that served was never timed."""
from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

from despina.contract.keys import Keys

from .control_support import catalog_entry, index, wait_until
from .test_cold_start_failures import BODY, CONFIG, ERROR, cold_starts, refused
from .test_control_absence import Roles, roles  # noqa: F401 (the fixture)

# initialize waits while the marker `hold` exists, then fails while `broken` does
SLOW_FLAKY = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        while os.path.exists({hold!r}):
            time.sleep(0.05)
        if os.path.exists({broken!r}):
            raise RuntimeError("the marker says this load fails")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
"""


def slow_flaky(started: Roles, tmp_path: Path, redis_url: str, key_prefix: str, *control: str
               ) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """The model SLOW_FLAKY (idle after 1 s) served by a control plane (the leader), a worker and a gateway,
    once scaled to zero: the leader, and the markers that hold its load and fail it."""
    hold, broken = tmp_path / "hold", tmp_path / "broken"
    (started.repo / "flaky" / "1").mkdir(parents=True)
    (started.repo / "flaky" / "1" / "model.py").write_text(SLOW_FLAKY.format(hold=str(hold), broken=str(broken)))
    (started.repo / "flaky" / "config.pbtxt").write_text(CONFIG)
    first = started.control(*control)
    started.start("worker")
    started.gateway("--request-timeout", "60")
    wait_until(lambda: (e := catalog_entry(redis_url, key_prefix, "flaky")) is not None and e.target == "idle"
               and b"model flaky: cold start" not in started.log("control"), 30, what="flaky to load and go idle")
    return first, hold, broken


def test_a_cold_start_whose_leader_died_fails_as_a_cold_start_and_heals(
        roles: Roles, tmp_path: Path, redis_url: str, key_prefix: str) -> None:  # noqa: F811
    first, hold, broken = slow_flaky(roles, tmp_path, redis_url, key_prefix)
    hold.touch()
    broken.touch()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{roles.url}/v2/models/flaky/infer", json=BODY, timeout=60)
        wait_until(lambda: b"model flaky: cold start" in roles.log("control"), 15, what="the cold start")
        wait_until(lambda: roles.log("worker").count(b"loading flaky version 1") >= 2, 15,
                   what="the worker to load it again")
        roles.kill(first)
        # two takeovers: the second leader's first read of the repository kept the mark (it dropped it, and
        # the third leader knew nothing of the cold start)
        second = roles.control(log="second")
        wait_until(lambda: b"catalog: 1 models" in roles.log("second"), 15, what="the second's repository read")
        entry = catalog_entry(redis_url, key_prefix, "flaky")
        assert entry is not None and entry.cold_since > 0, entry
        roles.kill(second)
        roles.control(log="next")
        hold.unlink()  # the load goes on, and fails, under the third leader
        r = waiting.result(timeout=60)
    refused(r, 2)  # the load's error, with the backoff's Retry-After
    assert b"cold start failed (1 in a row)" in roles.log("next"), roles.log("next").decode()[-3000:]
    entry = catalog_entry(redis_url, key_prefix, "flaky")
    assert entry is not None and entry.target == "idle" and entry.cold_failures == 1, entry
    assert cold_starts(redis_url, key_prefix).get("failed") == 1
    row = next(r for r in index(roles.url) if r["name"] == "flaky")
    assert row["state"] == "UNAVAILABLE" and ERROR in row["reason"], row

    broken.unlink()  # it heals: a request past the backoff loads it, and the cold start is timed from its start
    time.sleep(2.1)
    r = httpx.post(f"{roles.url}/v2/models/flaky/infer", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    doc = cold_starts(redis_url, key_prefix)
    assert doc.get("count") == 1 and doc.get("failed") == 1, doc


def test_a_cold_start_that_serves_under_the_next_leader_is_timed_from_its_start(
        roles: Roles, tmp_path: Path, redis_url: str, key_prefix: str) -> None:  # noqa: F811
    """The cold start's time, counted in despina:coldstart and the statistics, spans both leaders; and the
    catalog's mark of it goes once it serves."""
    first, hold, _ = slow_flaky(roles, tmp_path, redis_url, key_prefix)
    hold.touch()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{roles.url}/v2/models/flaky/infer", json=BODY, timeout=60)
        # its mark in the catalog, not the log line: the leader writes the line, then publishes the mark at
        # its tick's end; killed between the two, the next leader knows of no cold start (and times its own)
        wait_until(lambda: (e := catalog_entry(redis_url, key_prefix, "flaky")) is not None and e.cold_since > 0,
                   15, what="the cold start's mark")
        began = time.monotonic()
        roles.kill(first)
        roles.control(log="next")
        time.sleep(max(0.0, 1.5 - (time.monotonic() - began)))
        hold.unlink()
        r = waiting.result(timeout=60)
    assert r.status_code == 200, r.text
    wait_until(lambda: cold_starts(redis_url, key_prefix).get("count") == 1, 10, what="the cold start's record")
    doc = cold_starts(redis_url, key_prefix)
    assert float(doc["last_ms"]) >= 1500, doc  # type: ignore[arg-type]
    wait_until(lambda: (e := catalog_entry(redis_url, key_prefix, "flaky")) is not None and e.cold_since == 0.0,
               10, what="the cold start's mark to go")  # (the catalog goes out at the tick's end)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hget(Keys(key_prefix).stats("flaky", 1), "cold_count") == b"1"
    finally:
        client.close()


def test_a_load_that_fails_during_a_cold_start_leaves_no_mark_of_it(
        roles: Roles, tmp_path: Path, redis_url: str, key_prefix: str) -> None:  # noqa: F811
    """A load is no cold start: one that fails puts the entry back as it was, less the cold start's mark.
    It put the mark back too, and the next leader took the model that failed its load (400) for a cold start
    that failed: scaled to zero, backing off."""
    explicit = ("--model-control-mode", "explicit")
    first, hold, broken = slow_flaky(roles, tmp_path, redis_url, key_prefix, *explicit, "--load-model", "flaky")
    hold.touch()
    broken.touch()
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(httpx.post, f"{roles.url}/v2/models/flaky/infer", json=BODY, timeout=60)
        wait_until(lambda: b"model flaky: cold start" in roles.log("control"), 15, what="the cold start")
        loading = pool.submit(httpx.post, f"{roles.url}/v2/repository/models/flaky/load", json={}, timeout=60)
        wait_until(lambda: b"model flaky: loading version" in roles.log("control"), 15, what="the load")
        hold.unlink()
        waiting.result(timeout=60)
        assert loading.result(timeout=60).status_code == 400
    entry = catalog_entry(redis_url, key_prefix, "flaky")
    assert entry is not None and entry.cold_since == 0.0, entry
    roles.kill(first)
    roles.control(*explicit, log="next")
    wait_until(lambda: b"model flaky placed" in roles.log("next"), 15, what="the next leader's first placement")
    assert b"its cold start goes on" not in roles.log("next")
    entry = catalog_entry(redis_url, key_prefix, "flaky")
    assert entry is not None and entry.target == "loaded" and entry.cold_failures == 0, entry
