"""Where a run's slow requests fall, from perf_analyzer's per-request record (--profile-export-file):

    python bench/tail.py PROFILE.json

clusters: the requests whose latency (first response time - send time) is above the run's p99, grouped
while their send times are less than 5 ms apart; how many clusters, how many of ten or more requests
(a whole convoy late together), the largest. bursts: the gaps between consecutive responses, in order,
counted by length: a server answering continuously has few gaps of milliseconds, one whose requests go
round together answers in bursts with gaps between them. The file holds every request's input too (about
1 GB for 30 s of W1 or W3): only the timestamps are read from it.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

CLUSTER_GAP_S = 0.005


def timestamps(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Send and first-response times (ns) of every request in the export."""
    text = path.read_text()
    sent = np.array(re.findall(r'"timestamp":\s*(\d+)', text), dtype=np.int64)
    answered = np.array(re.findall(r'"response_timestamps":\s*\[(\d+)', text), dtype=np.int64)
    n = min(len(sent), len(answered))
    return sent[:n], answered[:n]


def clusters(sent_s: np.ndarray) -> list[tuple[float, float, int]]:
    """(first, last, count) of runs of send times less than CLUSTER_GAP_S apart."""
    order = np.sort(sent_s)
    out = []
    start = prev = order[0]
    count = 1
    for t in order[1:]:
        if t - prev > CLUSTER_GAP_S:
            out.append((start, prev, count))
            start, count = t, 0
        count += 1
        prev = t
    out.append((start, prev, count))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    args = parser.parse_args()
    sent, answered = timestamps(args.profile)
    latency_us = (answered - sent) / 1e3
    sent_s = (sent - sent.min()) / 1e9
    p50, p99, p999 = np.percentile(latency_us, [50, 99, 99.9])
    print(f"{len(sent)} requests over {sent_s.max():.1f} s; p50 {p50:.0f} p99 {p99:.0f} p99.9 {p999:.0f} "
          f"max {latency_us.max():.0f} us")
    slow = clusters(sent_s[latency_us > p99])
    big = [c for c in slow if c[2] >= 10]
    largest = ", ".join(f"{c[2]} at {c[0]:.2f} s" for c in sorted(slow, key=lambda c: -c[2])[:5])
    above = int((latency_us > p99).sum())
    print(f"above p99: {above} requests in {len(slow)} clusters, {len(big)} of ten or more; the largest: "
          f"{largest}")
    gaps_ms = np.diff(np.sort(answered)) / 1e6
    span = (answered.max() - answered.min()) / 1e9
    for at_least in (1, 2, 3, 4, 5):
        g = gaps_ms[gaps_ms >= at_least]
        print(f"gaps of {at_least} ms or more between responses: {len(g) / span:6.1f} a second, "
              f"{g.sum() / span / 10:5.1f} % of the time")


if __name__ == "__main__":
    main()
