"""The summary of a bench/ab.sh run: per model and concurrency, each label's req/s in every round, and
the ratio of the sums to the first label's (rounds interleave, so the sums compare like with like), with
the range of the rounds' own ratios; then, for each other label, in how many rounds the first label's
p99 was at most that label's (issue 7's target asks for both: the throughput and at most the p99).

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


def p99_at_most(p99s: list[float | None], base: list[float | None]) -> str:
    """In how many rounds the base's p99 was at most this label's, of the rounds both measured."""
    pairs = [(b, x) for b, x in zip(base, p99s) if b is not None and x is not None]
    return f"{sum(b <= x for b, x in pairs)} of {len(pairs)}" if pairs else "-"


def _p99(parts: list[str]) -> float | None:
    """A line's p99 in ms; None for the model's own rate (an @limit label, whose queue figure ab.sh writes
    as the word limit: its p99 is a batch's latency, not a request's) and where it is not a number."""
    at = parts.index("batch/queue_us") if "batch/queue_us" in parts else len(parts)
    if parts[at + 2:at + 3] == ["limit"]:
        return None
    try:
        return float(parts[7])
    except (IndexError, ValueError):
        return None


def main(path: str) -> None:
    rates: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    p99s: dict[tuple[str, str], dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    labels: list[str] = []
    with open(path) as ab:
        lines = ab.readlines()
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "round":
            continue
        label, model, conc, rps = parts[0], parts[3], parts[4], parts[5]
        if label not in labels:
            labels.append(label)
        if rps != "failed":
            rates[(model, conc)][label].append(float(rps))
        # one per round, a failed point's None, so that the rounds pair up
        p99s[(model, conc)][label].append(_p99(parts) if rps != "failed" else None)
    base = labels[0]
    others = labels[1:]
    # the p99 columns of the labels that have one to compare (not a model's own rate, nor against one)
    timed = [x for x in others if any(p99_at_most(by[x], by[base]) != "-" for by in p99s.values())]
    head = ["model", "conc", *labels, *(f"{x} / {base}" for x in others),
            *(f"{base}'s p99 at most {x}'s" for x in timed)]
    print(_row(head))
    print("|---" * len(head) + "|")
    for (model, conc), by_label in rates.items():
        cells = [", ".join(f"{r:,.0f}" for r in by_label.get(x, [])) or "-" for x in labels]
        ratios = [ratio(by_label.get(x, []), by_label.get(base, [])) for x in others]
        tails = [p99_at_most(p99s[(model, conc)][x], p99s[(model, conc)][base]) for x in timed]
        print(_row([model, conc.removeprefix("c="), *cells, *ratios, *tails]))


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main(sys.argv[1])
