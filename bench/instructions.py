"""The worker's instructions per batch, counted by valgrind's callgrind: a figure that does not move with
the host's load, its steal or its clock, where a timed one on these shared machines moves by 10-50 %.

    python bench/instructions.py [--tree DIR] [--batches 200 1200]

W1 (bench/out/repo's `mlp`: bench/models.py) in a ModelRunner, one request per batch, as at low
concurrency: the entry decoded, the batcher, onnxruntime, the reply pipeline built and packed (not
sent: no Redis is needed, and a round trip's cost is the kernel's and Redis's). The script runs itself
under callgrind twice, with the two batch counts, and prints the difference over the difference in
batches: start-up (imports, the model's load and warm-up) cancels out. `--tree` measures another
checkout of Despina (a git worktree of another commit, say) with this venv. About a minute a run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


async def batches(n: int) -> None:
    import numpy as np

    from despina.contract import records
    from despina.contract.keys import FIELD, IN_FLIGHT, Keys
    from despina.contract.modelconfig import ModelSpec
    from despina.contract.records import InferRequest, Tensor
    from despina.control.repository import load_model
    from despina.resp import pack
    from despina.workers.runner import ModelRunner

    class Packed:
        """Where the runner's pipelines go: packed as they would be sent, answered at once."""

        async def execute(self, commands: Any, errors: bool = True) -> list[Any]:
            pack(commands)
            return [None] * len(commands)

    folder = ROOT / "bench" / "out" / "repo" / "mlp"
    runner = ModelRunner(None, Keys("instructions"), ModelSpec.from_config(load_model(folder).config),  # type: ignore[arg-type]
                         1, folder, "instructions")
    runner._out = Packed()  # type: ignore[assignment]
    await runner.load()
    batcher = asyncio.get_running_loop().create_task(runner.batcher.run())
    row = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32).tobytes()
    for k in range(n):
        req = InferRequest(f"r{k}", "gateway", time.time() + 600, (Tensor("x", "FP32", (1, 256), row),),
                           enqueued=time.time())
        await runner._accept([("stream", f"{k}-0".encode(), {FIELD: records.encode([req]), IN_FLIGHT: b"1"})])
        while runner._in_flight or runner._background:
            if runner._background:
                await asyncio.gather(*list(runner._background))
            else:
                await asyncio.sleep(0)  # the batcher's turn: nothing else is coming, it runs at once
    runner.batcher.close()
    await batcher


def counted(tree: Path, n: int) -> int:
    """Instructions of one run of `n` batches under callgrind."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                           __file__, "--run", str(n)], env=env, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"no instruction count from callgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout of Despina to measure")
    parser.add_argument("--batches", type=int, nargs=2, default=[200, 1200], metavar=("FEW", "MANY"))
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the measured run itself
    args = parser.parse_args()
    if args.run is not None:
        import uvloop
        uvloop.run(batches(args.run))
        return
    few, many = args.batches
    low, high = counted(args.tree.resolve(), few), counted(args.tree.resolve(), many)
    print(f"{args.tree}: {(high - low) / (many - few):,.0f} instructions per batch of one request "
          f"({low:,} for {few} batches, {high:,} for {many})")


if __name__ == "__main__":
    main()
