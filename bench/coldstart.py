"""Cold start of the reference MLP: the first request after scale-to-zero, from the local artifact cache
and from S3 (SeaweedFS on loopback), end to end through the gateway.

usage: .venv/bin/python -m bench.coldstart [--rounds 5]   (from the repository root; ~1 min;
       BENCH_LOG_LEVEL=info shows the roles' logs)

Control plane, one worker and one gateway run as separate processes against one Valkey; the worker has
a cache folder of its own, so a cold start "from S3" (its cache emptied first) downloads the model.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import redis

from despina.contract.keys import Keys
from despina.embedded import EmbeddedValkey, free_port
from despina.registry.transfer import push
from tests.control_support import ROW, mlp_folder
from tests.seaweed import start_weed

IDLE_S = 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    tmp = Path(tempfile.mkdtemp(prefix="despina-coldstart-"))
    weed = start_weed(tmp / "s3")
    valkey = EmbeddedValkey()
    valkey.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        os.environ.update(weed.env)
        url = weed.url("bench")
        folder = mlp_folder(tmp / "src", extra=f'parameters {{ key: "idle_timeout_s" value: '
                                                f'{{ string_value: "{IDLE_S}" }} }}')
        # the reference MLP's batching, as model_repository/mlp has it
        config = folder / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 128"))
        push(folder, url, weed.settings(), out=io.StringIO())
        port = free_port()
        env = {**os.environ, "DESPINA_REDIS_URL": valkey.url, "DESPINA_MODEL_REPOSITORY": url,
               "DESPINA_HTTP_PORT": str(port), "DESPINA_METRICS_PORT": "0",
               "DESPINA_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "warning")}
        worker_cache = tmp / "worker-cache"
        for role, cache in (("control", tmp / "control-cache"), ("worker", worker_cache), ("gateway", tmp)):
            procs.append(subprocess.Popen([sys.executable, "-m", "despina", role],
                                          env={**env, "DESPINA_CACHE_DIR": str(cache)}))
        base = f"http://127.0.0.1:{port}"
        wait(lambda: ok(base), "the gateway")
        wait(lambda: httpx.post(f"{base}/fn/mlp", json=ROW, timeout=30).status_code == 200, "mlp")
        results: dict[str, list[tuple[float, float, float]]] = {"local cache": [], "S3": []}
        http = httpx.Client(timeout=30)  # one client, kept alive: a new one costs ~30 ms of TLS set-up
        for source in ("local cache", "S3"):
            for _ in range(rounds):
                wait(lambda: idle(base), "mlp to idle out", 30)
                if source == "S3":  # the worker's cache emptied: the files come from the store
                    for sub in ("models", "blobs"):
                        shutil.rmtree(worker_cache / sub, ignore_errors=True)
                        (worker_cache / sub).mkdir()
                http.get(f"{base}/v2/health/live")  # the connection is up before the clock starts
                started = time.perf_counter()
                r = http.post(f"{base}/fn/mlp", json=ROW)
                client_ms = (time.perf_counter() - started) * 1000
                assert r.status_code == 200, r.text
                started = time.perf_counter()
                assert http.post(f"{base}/fn/mlp", json=ROW).status_code == 200
                warm_ms = (time.perf_counter() - started) * 1000
                results[source].append((client_ms, last_cold_start(valkey.url), warm_ms))
        print(f"cold start of the reference MLP (1.1 MB ONNX), {rounds} rounds each, median (min-max):")
        for source, rows in results.items():
            client, control, warm = ([row[i] for row in rows] for i in range(3))
            print(f"  from {source:<11}: first request answered in {statistics.median(client):6.1f} ms "
                  f"({min(client):.1f}-{max(client):.1f}); load as the control plane saw it "
                  f"{statistics.median(control):6.1f} ms; the next request {statistics.median(warm):.1f} ms")
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        valkey.stop()
        weed.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def ok(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v2/health/live", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def idle(base: str) -> bool:
    rows = httpx.post(f"{base}/v2/repository/index", json={}, timeout=10).json()
    return any(r["name"] == "mlp" and r.get("reason", "").startswith("idle") for r in rows)


def last_cold_start(redis_url: str) -> float:
    client = redis.Redis.from_url(redis_url)
    try:
        return float(orjson.loads(client.hget(Keys().cold_starts, "mlp"))["last_ms"])
    finally:
        client.close()


def wait(check, what: str, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


if __name__ == "__main__":
    main()
