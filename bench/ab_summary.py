"""The summary of a bench/ab.sh run: per model and concurrency, each label's req/s in every round, and
the ratio of the sums to the first label's (rounds interleave, so the sums compare like with like), with
the range of the rounds' own ratios.

    python bench/ab_summary.py bench/out/ab-<time>/ab.txt
"""
from __future__ import annotations

import sys
from collections import defaultdict


def ratio(rates: list[float], base: list[float]) -> str:
    """The ratio of the sums, and with more than one round the lowest and highest of the rounds' own
    ratios (each round's figure against the base's in the same round)."""
    if not rates or len(rates) != len(base):
        return "-"
    text = f"{sum(rates) / sum(base):.2f}"
    if len(rates) > 1:
        each = [r / b for r, b in zip(rates, base)]
        text += f" ({min(each):.2f}–{max(each):.2f})"
    return text


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
        ratios = [ratio(by_label.get(x, []), by_label.get(base, [])) for x in labels[1:]]
        print(f"| {model} | {conc.removeprefix('c=')} | {' | '.join(cells)} | {' | '.join(ratios)} |")


if __name__ == "__main__":
    main(sys.argv[1])
