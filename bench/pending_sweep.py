"""What a worker of many idle models asks Redis for its pending-entry sweep (workers/sweep.py).

A `despina worker` (in this process) with MODELS identity models placed on it, all idle, against a Redis of
its own (give one that nothing else uses: the figures are the server's). After every model is READY and
a settling pause, it counts over SECONDS: XPENDING calls (INFO commandstats), the server's read events
(INFO stats total_reads_processed: each round trip a client starts is at least one; the two INFO
reads of the count itself are taken off) and the worker's
event-loop wake-ups (its main thread's voluntary context switches).

    redis-server --port 19101 --save '' --appendonly no &
    .venv/bin/python bench/pending_sweep.py redis://127.0.0.1:19101/0 --models 400 --visibility 4
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

import redis.asyncio as aioredis
from onnx import TensorProto

from despina.control.repository import load_model
from despina.examples import build_identity
from despina.redis_client import connect_worker
from despina.settings import Settings
from despina.workers.worker import Worker


def wakeups() -> int:
    """The voluntary context switches of this process's main thread (its event loop's sleeps)."""
    status = Path(f"/proc/self/task/{threading.get_native_id()}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:", 1)[1].split()[0])


async def figures(redis: aioredis.Redis) -> tuple[int, int]:
    stats = await redis.info("commandstats")
    server = await redis.info("stats")
    return int(stats.get("cmdstat_xpending", {}).get("calls", 0)), int(server["total_reads_processed"])


async def main(url: str, models: int, visibility_s: float, seconds: float, settle_s: float) -> None:
    redis = connect_worker(url)
    await redis.flushdb()
    worker = Worker(Settings(key_prefix="sweep", visibility_timeout_s=visibility_s), redis)
    with tempfile.TemporaryDirectory() as tmp:
        entries = []
        for i in range(models):
            folder = Path(tmp) / f"m{i}"
            build_identity(folder / "1" / "model.onnx", TensorProto.FLOAT)
            (folder / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n')
            entries.append(replace(load_model(folder), workers=(worker.id,)))
        await redis.hset(worker.keys.catalog, mapping={e.name: e.dumps() for e in entries})
        running = asyncio.create_task(worker.run())
        while sum(r.state == "READY" for r in worker.runners.values()) < models:
            await asyncio.sleep(0.5)
        await asyncio.sleep(settle_s)
        (xpending, reads), woken = await figures(redis), wakeups()
        await asyncio.sleep(seconds)
        (xpending2, reads2), woken2 = await figures(redis), wakeups()
        print(f"{models} idle models, visibility timeout {visibility_s:g} s, {seconds:g} s: "
              f"XPENDING calls {xpending2 - xpending}, Redis read events {reads2 - reads - 2}, "
              f"worker wake-ups {woken2 - woken}")
        worker.stop()
        await running
    await redis.flushdb()
    await redis.aclose(close_connection_pool=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--models", type=int, default=400)
    parser.add_argument("--visibility", type=float, default=4.0, help="DESPINA_VISIBILITY_TIMEOUT_S")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=3.0)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.models, args.visibility, args.seconds, args.settle))
