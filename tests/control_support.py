"""Small model folders and helpers shared by the control-plane tests."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import redis

from despina.contract.catalog import CatalogEntry
from despina.contract.keys import Keys
from despina.examples import build_mlp, mlp_numpy

T = TypeVar("T")

MLP_CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 10 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
{extra}"""

ROW = [0.25] * 256


def mlp_folder(root: Path, name: str = "mlp", versions: dict[int, int] | None = None, extra: str = "",
               delay_us: int = 100) -> Path:
    """<root>/<name>/config.pbtxt and one folder per version (version -> weight seed)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(MLP_CONFIG.format(name=name, extra=extra, delay_us=delay_us))
    for version, seed in (versions or {1: 0}).items():
        (folder / str(version)).mkdir(exist_ok=True)
        build_mlp(folder / str(version) / "model.onnx", seed=seed)
    return folder


def expected(seed: int) -> np.ndarray:
    """What the MLP built with `seed` answers for ROW."""
    if seed == 0:
        return mlp_numpy(np.array([ROW], np.float32))[0]
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        build_mlp(path, seed=seed)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"x": np.array([ROW], np.float32)})[0][0]


def infer(url: str, model: str = "mlp", version: int | None = None, timeout: float = 30.0,
          client: httpx.Client | None = None) -> httpx.Response:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": ROW}]}
    return (client or httpx).post(url + path, json=body, timeout=timeout)  # type: ignore[union-attr]


def wait_until(check: Callable[[], T], timeout: float = 30.0, every: float = 0.1, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or check}")
        time.sleep(every)


def index(url: str, ready: bool | None = None) -> list[dict[str, Any]]:
    body = {} if ready is None else {"ready": ready}
    r = httpx.post(f"{url}/v2/repository/index", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def catalog_entry(redis_url: str, prefix: str, name: str) -> CatalogEntry | None:
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.hget(Keys(prefix).catalog, name)
    finally:
        client.close()
    return CatalogEntry.loads(raw) if raw else None


def worker_hashes(redis_url: str, prefix: str) -> dict[str, dict[bytes, bytes]]:
    keys = Keys(prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        return {w.decode(): client.hgetall(keys.worker(w.decode())) for w in client.smembers(keys.workers)}
    finally:
        client.close()
