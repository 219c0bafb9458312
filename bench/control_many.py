"""What the control plane costs with many models: Redis commands (INFO commandstats deltas), round trips
and wall time of one operation, not throughput.

usage: .venv/bin/python -m bench.control_many [--models 1000] [--port 19301]   (from the repository root)

A redis-server of its own on --port (its commandstats count the control plane alone), a repository of
--models copies of a tiny ONNX model, the control plane in this process, and two workers that are only
their heartbeat hashes (they report READY what the catalog places on them, and write nothing while a
window is measured). Every model's stream has its consumer group, as the workers' loads leave them.

  idle:       10 s of an idle control plane, without and with scale-to-zero (idle_timeout_s 3600);
  all idle:   10 s with every model just scaled to zero, 10 s with all scaled to zero long ago;
  dead:       worker b (half the models) dies holding 3 read entries on each of --busy streams (20):
              the pass that requeues them, timed, with its commands and round trips; then that every
              entry is back.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
from onnx import TensorProto

from despina.contract import records
from despina.contract.catalog import IDLE
from despina.contract.cluster import VersionStatus, WorkerInfo, pack_detail, state_digest
from despina.contract.keys import FIELD, GROUP, Keys
from despina.contract.records import InferRequest
from despina.control.plane import ControlPlane
from despina.embedded import die_with_parent
from despina.examples import build_identity
from despina.redis_client import connect
from despina.settings import Settings

PREFIX = "cm"
WORKERS = ("a", "b")
WINDOW_S = 10.0
DEAD_ENTRIES = 3


def repository(root: Path, n: int) -> Path:
    one = root / "one"
    build_identity(one / "1" / "model.onnx", TensorProto.FLOAT)
    (one / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n')
    repo = root / "repo"
    for i in range(n):
        shutil.copytree(one, repo / f"m{i:04d}")
    return repo


async def commandstats(redis: aioredis.Redis) -> Counter[str]:
    info = await redis.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()})


def show(title: str, counts: Counter[str], seconds: float | None = None) -> None:
    total = sum(counts.values())
    per = f", {total / seconds:.0f}/s" if seconds else ""
    print(f"  {title}: {total} commands{per}: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))


async def heartbeat(redis: aioredis.Redis, keys: Keys, plane: ControlPlane, dead: set[str]) -> None:
    """Each worker's hash: READY every model version the catalog places on it."""
    pipe = redis.pipeline(transaction=False)
    for wid in WORKERS:
        if wid in dead:
            continue
        detail = {e.name: {v: VersionStatus("READY", e.revisions.get(v, "")) for v in e.versions}
                  for e in plane.catalog.entries.values() if wid in e.workers}
        models = orjson.dumps({n: {str(v): "READY" for v in vs} for n, vs in detail.items()})
        packed = pack_detail(detail)
        pipe.hset(keys.worker(wid), mapping={
            "info": WorkerInfo(wid, memory_bytes=1 << 40).dumps(), "models": models, "detail": packed,
            "state": state_digest(models, packed)})
        pipe.pexpire(keys.worker(wid), 600_000)
        pipe.sadd(keys.workers, wid)
    pipe.publish(keys.events, b"worker")
    await pipe.execute()


async def settle(redis: aioredis.Redis, keys: Keys, plane: ControlPlane, dead: set[str],
                 done: Callable[[], bool]) -> None:
    for _ in range(300):
        await heartbeat(redis, keys, plane, dead)
        await asyncio.sleep(0.3)
        if done():
            await heartbeat(redis, keys, plane, dead)
            await asyncio.sleep(1.5)  # the ticks that follow READY (a cold start's record) are done
            return
    raise SystemExit("the catalog did not settle")


@contextmanager
def round_trips(plane: ControlPlane, counts: Counter[str]) -> Iterator[None]:
    """Count the control plane's round trips to Redis: single commands and pipelines."""
    client_cls, pipe_cls = type(plane.redis), type(plane.redis.pipeline())
    single, execute = client_cls.execute_command, pipe_cls.execute

    async def counted_single(self: Any, *args: Any, **kw: Any) -> Any:
        counts["single"] += 1
        return await single(self, *args, **kw)

    async def counted_execute(self: Any, *args: Any, **kw: Any) -> Any:
        counts["pipeline"] += bool(len(self))
        return await execute(self, *args, **kw)

    client_cls.execute_command, pipe_cls.execute = counted_single, counted_execute  # type: ignore[method-assign]
    try:
        yield
    finally:
        client_cls.execute_command, pipe_cls.execute = single, execute  # type: ignore[method-assign]


def timed(obj: Any, name: str, log: list[float]) -> None:
    method: Callable[..., Awaitable[Any]] = getattr(obj, name)

    async def wrapper(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return await method(*args, **kw)
        finally:
            log.append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def show_checks(checks: list[float]) -> None:
    if checks:
        print(f"    scale-to-zero checks: {len(checks)}, {1000 * sum(checks) / len(checks):.1f} ms each")


async def window(redis: aioredis.Redis, plane: ControlPlane, title: str) -> None:
    before, cpu = await commandstats(redis), time.process_time()
    trips: Counter[str] = Counter()
    with round_trips(plane, trips):
        await asyncio.sleep(WINDOW_S)
    used = time.process_time() - cpu
    delta = await commandstats(redis) - before
    delta.pop("info", None)
    show(f"{title} ({WINDOW_S:.0f} s)", delta, WINDOW_S)
    print(f"    round trips {sum(trips.values())} ({dict(trips)}), this process's CPU {used * 1000:.0f} ms")


async def scenario(url: str, repo: Path, n: int, idle_timeout_s: float, dead_worker: int) -> None:
    redis = connect(url)
    keys = Keys(PREFIX)
    await redis.flushdb()
    settings = Settings(model_repository=str(repo), key_prefix=PREFIX, idle_timeout_s=idle_timeout_s,
                        worker_ttl_s=600)
    plane = ControlPlane(settings, connect(url))
    checks: list[float] = []
    requeues: list[float] = []
    timed(plane.lifecycle, "_scale_to_zero", checks)
    timed(plane.lifecycle, "_requeue_from", requeues)
    await heartbeat(redis, keys, plane, set())
    task = asyncio.create_task(plane.run())
    try:
        def ready() -> bool:
            es = list(plane.catalog.entries.values())
            return len(es) == n and all(e.workers and plane.workers.ready_on(e.name, 1) for e in es)

        await settle(redis, keys, plane, set(), ready)
        pipe = redis.pipeline(transaction=False)
        for e in plane.catalog.entries.values():  # each loaded model's group, as a worker's load makes it
            pipe.xgroup_create(keys.request_stream(e.name, 1), GROUP, id="0", mkstream=True)
        await pipe.execute()
        print(f"== {n} models on {len(WORKERS)} workers, idle_timeout_s {idle_timeout_s:g}")
        checks.clear()
        await window(redis, plane, "idle, loaded")
        show_checks(checks)
        if dead_worker:
            await dead(redis, keys, plane, requeues, dead_worker)
        if idle_timeout_s:
            for e in list(plane.catalog.entries.values()):
                plane.catalog.put(replace(e, target=IDLE, workers=()))
            plane.kick()
            await settle(redis, keys, plane, set(WORKERS) if dead_worker else set(),
                         lambda: not plane.catalog.changed)
            checks.clear()
            await window(redis, plane, "idle, every model just scaled to zero")
            show_checks(checks)
            idle = getattr(plane.lifecycle, "idle", None)
            if idle is not None:  # (a tree before it reads them all at every check)
                idle.watch_s = 0.0
                checks.clear()
                await window(redis, plane, "idle, every model scaled to zero long ago")
                show_checks(checks)
    finally:
        plane.stop()
        await task
        await plane.redis.aclose(close_connection_pool=True)
        await redis.flushdb()
        await redis.aclose(close_connection_pool=True)


async def dead(redis: aioredis.Redis, keys: Keys, plane: ControlPlane, requeues: list[float],
               busy: int) -> None:
    on_b = sorted(e.name for e in plane.catalog.entries.values() if e.workers == ("b",))
    streams = [keys.request_stream(name, 1) for name in on_b[:busy]]
    for stream in streams:
        for i in range(DEAD_ENTRIES):
            request = InferRequest(f"{stream}/{i}", "r", time.time() + 600, ())
            await redis.xadd(stream, {FIELD: records.encode([request])})
        await redis.xreadgroup(GROUP, "b", {stream: ">"}, count=DEAD_ENTRIES)
    requeues.clear()
    trips: Counter[str] = Counter()
    before = await commandstats(redis)
    with round_trips(plane, trips):
        await redis.delete(keys.worker("b"))
        await redis.publish(keys.events, b"worker")
        for _ in range(200):
            await asyncio.sleep(0.05)
            if requeues:
                break
    delta = await commandstats(redis) - before
    for noise in ("info", "del", "publish", "hset", "pexpire", "sadd"):
        delta.pop(noise, None)
    print(f"  dead worker b ({len(on_b)} models; {DEAD_ENTRIES} read entries on each of {len(streams)} "
          f"streams): requeued in {1000 * requeues[0]:.0f} ms" if requeues else "  dead worker: not requeued")
    show("    commands (the tick's and the requeue's)", delta)
    print(f"    round trips {sum(trips.values())} ({dict(trips)})")
    left = 0
    for stream in streams:
        consumers = await redis.xinfo_consumers(stream, GROUP)
        left += sum(int(c["pending"]) for c in consumers if c["name"] == b"b")
    back = sum([await redis.xlen(s) for s in streams])
    print(f"    still pending for b: {left}; entries on the streams: {back} of {len(streams) * DEAD_ENTRIES}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--port", type=int, default=19301)
    parser.add_argument("--busy", type=int, default=20, help="streams the dead worker had read entries of")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="despina-control-many-"))
    server = subprocess.Popen(["redis-server", "--port", str(args.port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL,
                              preexec_fn=die_with_parent)
    try:
        time.sleep(0.3)
        repo = repository(tmp, args.models)
        url = f"redis://127.0.0.1:{args.port}/0"
        asyncio.run(scenario(url, repo, args.models, 0.0, dead_worker=args.busy))
        asyncio.run(scenario(url, repo, args.models, 3600.0, dead_worker=0))
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
