"""The summary of a bench/ab.sh run: per model and concurrency, each label's req/s in every round, and
the ratio of the sums to the first label's (rounds interleave, so the sums compare like with like).

    python bench/ab_summary.py bench/out/ab-<time>/ab.txt
"""
from __future__ import annotations

import sys
from collections import defaultdict


def main(path: str) -> None:
    rates: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    labels: list[str] = []
    for line in open(path):
        parts = line.split()
        if len(parts) < 6 or parts[1] != "round":
            continue
        label, model, conc, rps = parts[0], parts[3], parts[4], parts[5]
        if label not in labels:
            labels.append(label)
        if rps != "failed":
            rates[(model, conc)][label].append(float(rps))
    base = labels[0]
    print(f"| model | conc | {' | '.join(labels)} | {' | '.join(f'{x} / {base}' for x in labels[1:])} |")
    print("|---" * (2 + 2 * len(labels) - 1) + "|")
    for (model, conc), by_label in rates.items():
        cells = [", ".join(f"{r:,.0f}" for r in by_label.get(x, [])) or "-" for x in labels]
        ratios = [f"{sum(by_label[x]) / sum(by_label[base]):.2f}" if by_label.get(x) and by_label.get(base)
                  and len(by_label[x]) == len(by_label[base]) else "-" for x in labels[1:]]
        print(f"| {model} | {conc.removeprefix('c=')} | {' | '.join(cells)} | {' | '.join(ratios)} |")


if __name__ == "__main__":
    main(sys.argv[1])
