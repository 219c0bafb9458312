"""Which model versions the live workers serve, as the gateway's model view reads it from their heartbeats.

Each refresh reads every live worker's `state` digest (contract/cluster.py) and, only for a worker whose
digest moved, its `models` and `detail`: a worker of 400 models writes 40 KB there on every heartbeat,
unchanged most of the time. A worker of an earlier version writes no digest, and is read every time.
"""
from __future__ import annotations

from typing import Any, cast

import orjson
import redis.asyncio as aioredis

from ..contract.keys import Keys

Ready = dict[str, set[int]]              # model -> versions READY on some live worker
Served = dict[tuple[str, int], set[str]]  # (model, version) -> the revisions workers serve or load
Gpus = dict[tuple[str, int], int]         # (model, version) -> the most GPUs a worker serving it saw


class WorkerStates:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.ready: Ready = {}
        self.served: Served = {}
        self.gpus: Gpus = {}  # how KIND_AUTO resolved where it serves: GET .../config shows that, as Triton
        # worker id -> the digest of its state, and its part
        self._each: dict[bytes, tuple[bytes | None, Ready, Served, Gpus]] = {}

    def ask(self, pipe: aioredis.client.Pipeline, workers: list[bytes]) -> None:
        """Ask for the workers' digests on the caller's pipeline (its replies go to update(), in order)."""
        for wid in workers:
            pipe.hget(self.keys.worker(wid.decode()), "state")

    async def update(self, redis: aioredis.Redis, workers: list[bytes], digests: list[Any]) -> None:
        """Read the states of the workers whose digest moved (or that have none), then ready and served."""
        changed = [(wid, d) for wid, d in zip(workers, digests)
                   if d is None or wid not in self._each or self._each[wid][0] != d]
        each = {wid: self._each[wid] for wid in workers if wid in self._each}  # a worker gone drops out
        if not changed and each.keys() == self._each.keys():
            return
        if changed:
            pipe = redis.pipeline(transaction=False)
            for wid, _ in changed:
                pipe.hmget(self.keys.worker(wid.decode()), "models", "detail")
            for (wid, digest), (models, detail) in zip(changed, await pipe.execute()):
                each[wid] = (cast(bytes | None, digest), *_parse(models, detail))
        ready: Ready = {}
        served: Served = {}
        gpus: Gpus = {}
        for _, its_ready, its_served, its_gpus in each.values():
            for name, versions in its_ready.items():
                ready.setdefault(name, set()).update(versions)
            for key, revisions in its_served.items():
                served.setdefault(key, set()).update(revisions)
            for key, n in its_gpus.items():
                gpus[key] = max(n, gpus.get(key, 0))
        self._each, self.ready, self.served, self.gpus = each, ready, served, gpus


def _parse(models: bytes | None, detail: bytes | None) -> tuple[Ready, Served, Gpus]:
    """One worker's part: the versions it has READY, the revisions it serves or loads, and the GPUs each
    serving one saw where it saw any (an expired hash: nothing)."""
    ready: Ready = {}
    served: Served = {}
    gpus: Gpus = {}
    for name, versions in (orjson.loads(models) if models else {}).items():
        for v, s in versions.items():
            if s == "READY":
                ready.setdefault(name, set()).add(int(v))
    for name, versions in (orjson.loads(detail) if detail else {}).items():
        for v, d in versions.items():
            revs = served.setdefault((name, int(v)), set())
            revs.update(r for r in (d.get("revision"), d.get("loading"), d.get("replaced")) if r)
            if d.get("gpus"):
                gpus[(name, int(v))] = int(d["gpus"])
    return ready, served, gpus
