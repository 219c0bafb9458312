"""Instructions of a worker's reply path alone: ModelRunner._reply for one request per batch, to one
gateway, its pipeline packed (resp.pack) and not sent. Counted by callgrind as the difference of two runs,
so that start-up (imports, the model's load) cancels out:

    for n in 1000 6000; do valgrind --tool=callgrind --callgrind-out-file=/tmp/rc.$n \\
        .venv/bin/python bench/reply_cost.py $n; done
    # instructions a call: (total of /tmp/rc.6000 - total of /tmp/rc.1000) / 5000
    # (the totals: `callgrind_annotate /tmp/rc.N | grep PROGRAM`)

The model is bench/out/repo's `mlp` (bench/models.py). Nothing talks to Redis: the writer's connection is
replaced by one that packs the commands, the CPU work of a reply up to the socket."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from despina.contract.keys import Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.control.repository import load_model
from despina.resp import pack
from despina.workers.intake import Pending
from despina.workers.runner import ModelRunner

FOLDER = Path(__file__).resolve().parent / "out" / "repo" / "mlp"


class Packed:
    """A Resp that packs what it is given and sends nothing."""

    async def execute(self, commands: list[Any], errors: bool = True) -> list[None]:
        pack(commands)
        return [None] * len(commands)


async def main(n: int) -> None:
    spec = ModelSpec.from_config(load_model(FOLDER).config)
    runner = ModelRunner(None, Keys("instructions"), spec, 1, FOLDER, "x")  # type: ignore[arg-type]
    runner.writer.out = Packed()  # type: ignore[assignment]
    y = Tensor("y", "FP32", (1, 10), np.zeros((1, 10), np.float32).tobytes())
    x = Tensor("x", "FP32", (1, 256), np.zeros((1, 256), np.float32).tobytes())
    for k in range(n):
        req = InferRequest(f"r{k}", "gateway", time.time() + 600, (x,), enqueued=time.time())
        entry = ("stream", f"{k}-0".encode())
        runner._entries[entry] = 1
        runner._in_flight += 1
        runner._gateways.opened("gateway")
        pending = Pending(req, entry, {}, False, time.time())
        await runner._reply([InferReply(req.id, (y,), None, 5, 7)], [req], [pending], rows=1,
                            started=time.time(), timings=(1000, 2000, 3000))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
