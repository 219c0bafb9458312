"""Batches as a worker's debug log saw them: `DESPINA_LOG_LEVEL=debug` makes each worker log a
"batch formed" line per batch (requests, and per request queue_us and transit_us). Per log: how many
batches held how many requests; per batch size, the wait after the worker's read (the largest
queue_us - transit_us in the batch) and the oldest request's queue time; and how long runs of
batches below the largest size last (a batch that split, and how soon it joined up again).

    bench/ab.sh -c 8 base=/tmp/base:DESPINA_LOG_LEVEL=debug new=.:DESPINA_LOG_LEVEL=debug
    .venv/bin/python bench/batchlog.py bench/out/ab-*/new-1.log [--model mlp]
"""
from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

REQUESTS = re.compile(r"requests=(\d+)")
QUEUE = re.compile(r"queue_us=\[([^\]]*)\]")
TRANSIT = re.compile(r"transit_us=\[([^\]]*)\]")


def pct(xs: list[int], f: float) -> int:
    return xs[min(len(xs) - 1, int(f * len(xs)))]


def summarize(path: str, model: str) -> None:
    sizes: Counter[int] = Counter()
    after: dict[int, list[int]] = defaultdict(list)
    oldest: dict[int, list[int]] = defaultdict(list)
    order: list[int] = []
    with open(path, errors="replace") as log:
        for line in log:
            if "batch formed" not in line or f"model={model} " not in line:
                continue
            found = [p.search(line) for p in (REQUESTS, QUEUE, TRANSIT)]
            if not all(found):
                continue  # cut short (a log rotated or killed mid-line)
            n = int(found[0].group(1))  # type: ignore[union-attr]
            queue, transit = ([int(x) for x in m.group(1).split(",")]  # type: ignore[union-attr]
                              for m in found[1:])
            sizes[n] += 1
            order.append(n)
            after[n].append(max(q - t for q, t in zip(queue, transit)))
            oldest[n].append(max(queue))
    if not order:
        print(f"{path}: no 'batch formed' lines of model {model}")
        return
    print(f"{path}: {len(order)} batches; by requests: "
          + " ".join(f"{k}:{v}" for k, v in sorted(sizes.items())))
    for n in sorted(sizes):
        if sizes[n] < 20:
            continue
        a, o = sorted(after[n]), sorted(oldest[n])
        print(f"  {n} requests: wait after the read p50 {pct(a, .5)} p90 {pct(a, .9)} p99 {pct(a, .99)} µs; "
              f"oldest queued p50 {pct(o, .5)} p99 {pct(o, .99)} µs")
    full, runs, run = max(sizes), [], 0
    for n in order:
        if n < full:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    if runs:
        print(f"  runs of batches below {full}: {len(runs)}, {sum(runs) / len(runs):.1f} batches on average, "
              f"longest {max(runs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--model", default="mlp")
    args = parser.parse_args()
    for path in args.logs:
        summarize(path, args.model)


if __name__ == "__main__":
    main()
