"""Scale-to-zero: an idle model is unloaded from every worker, and the next requests bring it back."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import orjson
import redis

from despina.contract.keys import Keys

from .conftest import Server
from .control_support import ROW, expected, index, mlp_folder, wait_until, worker_hashes

IDLE = 'parameters { key: "idle_timeout_s" value: { string_value: "1" } }'


def loaded_models(redis_url: str, prefix: str) -> set[str]:
    """What the workers' model tables hold."""
    return {name for h in worker_hashes(redis_url, prefix).values()
            for name in orjson.loads(h.get(b"models", b"{}"))}


def test_an_idle_model_unloads_and_fifty_first_requests_cause_one_load(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    repo = tmp_path / "repo"
    mlp_folder(repo, "mlp", extra=IDLE)
    mlp_folder(repo, "steady")  # no idle timeout: stays
    server = serve(repo, wait_models=("mlp", "steady"))
    assert httpx.post(f"{server.url}/fn/mlp", json=ROW).status_code == 200

    wait_until(lambda: "mlp" not in loaded_models(redis_url, key_prefix), 15, what="mlp to be unloaded")
    assert "steady" in loaded_models(redis_url, key_prefix)
    row = next(r for r in index(server.url) if r["name"] == "mlp")
    assert row["state"] == "UNAVAILABLE" and row["reason"].startswith("idle")
    assert httpx.get(f"{server.url}/v2/models/mlp").status_code == 200   # still registered
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(f"{server.url}/fn/mlp", json=ROW) for _ in range(50)))

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 50
    assert all(np.allclose(r.json()["y"], expected(0), atol=1e-4) for r in answers)
    assert server.logs().count("loaded mlp version 1 in") == 2   # at start, and one cold start

    client = redis.Redis.from_url(redis_url)
    try:
        cold = orjson.loads(client.hget(Keys(key_prefix).cold_starts, "mlp"))
    finally:
        client.close()
    assert cold["count"] == 1 and 0 < cold["last_ms"] < 5000
    print(f"cold start of mlp from the local registry: {cold['last_ms']} ms "
          f"(the worker's load {cold['last_load_ms']} ms)")
    assert "mlp: cold start took" in server.logs()
