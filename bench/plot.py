"""Tables (Markdown, on stdout) and a PNG of throughput and p99 vs concurrency from results files.

    python bench/plot.py bench/out/<run>/results.jsonl [more runs...] [--png bench/throughput.png]

With several runs, each point is the run with the most req/s at that point (its latencies with it):
on a shared machine other work only ever slows a run down, so the best of N is the least disturbed.

Series are (system, client): Despina's own loadgen (raw-json, raw-binary), the peers kit's
perf_analyzer (binary tensors) and aiohttp (JSON), and the limit lines from bench/limit.py.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

Row = dict[str, Any]
NAMES = {"despina": "Despina", "triton": "Triton", "litserve": "LitServe", "mlserver": "MLServer"}
W1, W2 = "mlp", "mlp_heavy"
W2S = (W2, "conv_heavy")  # W2 as bench/models.py builds it: memory-bound at batch 1, and compute-bound
# W2's layouts (bench/run.sh): everything on core 0, or the worker alone there (serve --worker-cpus 0)
LAYOUTS = {"despina": "all on core 0", "despina-pool": "worker alone on core 0"}
# the limit taken just before and after each layout's W2 points (bench/run.sh: limit.py --peer)
BESIDE = {"despina": "limit-beside", "despina-pool": "limit-beside-pool"}


def load(path: Path) -> list[Row]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def best_of(runs: list[list[Row]]) -> list[Row]:
    """One row per point: the one with the most req/s (failed points only if no run has the point)."""
    best: dict[tuple[Any, ...], Row] = {}
    for rows in runs:
        for r in rows:
            key = (r["peer"], r["client"], r.get("model", W1), r["conc"], r.get("batch"))
            old = best.get(key)
            if old is None or (r.get("rps") or 0) > (old.get("rps") or 0):
                best[key] = {**r, "runs": (old or {}).get("runs", 0) + 1}
            else:
                old["runs"] += 1
    return list(best.values())


def series(rows: list[Row], model: str) -> dict[str, dict[int, Row]]:
    """'Despina perf_analyzer' -> {conc: row} for one model; failed points are kept, marked."""
    out: dict[str, dict[int, Row]] = defaultdict(dict)
    for r in rows:
        if r["peer"] in NAMES and r.get("model", W1) == model:
            out[f"{NAMES[r['peer']]} {r['client']}"][r["conc"]] = r
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].startswith("Despina"), kv[0])))


def cell(r: Row | None) -> str:
    if r is None:
        return ""
    if r.get("error") or r.get("rps") is None:
        return "failed"
    note = f", {r['errors']} err" if r.get("errors") else ""
    note += f", {r['wrong']} wrong" if r.get("wrong") else ""
    batch = f", b {r['mean_batch']}" if r.get("mean_batch") else ""
    return f"{r['rps']:,.0f} ({r['p50_ms']:.2f}/{r['p99_ms']:.2f}{batch}{note})"


def ratio(a: Row | None, b: Row | None) -> str:
    ok = a and b and a.get("rps") and b.get("rps") and not a.get("error") and not b.get("error")
    return f"{a['rps'] / b['rps']:.2f}" if ok else "-"  # type: ignore[index]


def table(title: str, corner: str, columns: list[str], rows: list[tuple[str, list[str]]]) -> list[str]:
    """A Markdown table under a heading: one row per (label, cells)."""
    out = ["", f"### {title}", "", f"| {corner} | " + " | ".join(columns) + " |",
           "|---" * (len(columns) + 1) + "|"]
    return out + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]


def w1_tables(rows: list[Row]) -> list[str]:
    s = series(rows, W1)
    concs = sorted({c for points in s.values() for c in points})
    heads = [f"c={c}" for c in concs]
    out = table("W1 `mlp`: req/s (p50/p99 ms, mean batch)", "series", heads,
                [(name, [cell(points.get(c)) for c in concs]) for name, points in s.items()])
    pairs = [("perf_analyzer", "perf_analyzer"), ("aiohttp", "aiohttp"), ("raw-binary", "perf_analyzer"),
             ("raw-json", "aiohttp")]
    ratios = []
    for mine, theirs in pairs:
        d, t = s.get(f"Despina {mine}", {}), s.get(f"Triton {theirs}", {})
        ratios.append((f"{mine} / {theirs}", [ratio(d.get(c), t.get(c)) for c in concs]))
    return out + table("W1: Despina / Triton, req/s", "Despina client / Triton client", heads, ratios)


def spread_table(runs: list[list[Row]]) -> list[str]:
    """W1 req/s, lowest-highest over the runs: how much the machine's other users moved each point."""
    spread: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rows in runs:
        for name, points in series(rows, W1).items():
            for c, r in points.items():
                if r.get("rps") and not r.get("error"):
                    spread[name][c].append(r["rps"])
    concs = sorted({c for by_conc in spread.values() for c in by_conc})
    cells = [(name, [f"{min(by_conc[c]):,.0f}-{max(by_conc[c]):,.0f}" if c in by_conc else "" for c in concs])
             for name, by_conc in sorted(spread.items())]
    title = f"W1: req/s, lowest-highest over {len(runs)} runs"
    return table(title, "series", [f"c={c}" for c in concs], cells)


def per_run_table(runs: list[list[Row]], paths: list[Path], conc: int = 64) -> list[str]:
    """Each run's Despina and Triton req/s at one concurrency, and their ratio within that run."""
    cells = []
    for rows, path in zip(runs, paths):
        s = series(rows, W1)
        names = ("Despina raw-binary", "Despina perf_analyzer", "Triton perf_analyzer", "Despina aiohttp",
                 "Triton aiohttp")
        got = [s.get(name, {}).get(conc) for name in names]
        rps = [f"{r['rps']:,.0f}" if r and r.get("rps") else "-" for r in got]
        cells.append((path.parent.name, [*rps[:3], ratio(got[1], got[2]), *rps[3:], ratio(got[3], got[4])]))
    columns = ["Despina raw-binary", "Despina perf_analyzer", "Triton perf_analyzer", "ratio",
               "Despina aiohttp", "Triton aiohttp", "ratio"]
    title = f"W1 at c={conc}, run by run: req/s, and Despina / Triton within each run"
    return table(title, "run", columns, cells)


def limit_table(rows: list[Row]) -> list[str]:
    lim = [r for r in rows if r["peer"] == "limit"]
    batches = sorted({r["batch"] for r in lim})
    cells = []
    for model in (W1, *W2S):
        by = {r["batch"]: r for r in lim if r["model"] == model}
        cells.append((model, [f"{by[b]['rps']:,.0f} ({by[b]['p50_ms']:.3f})" if b in by else ""
                              for b in batches]))
    return table("Limit: onnxruntime alone, one thread, rows/s (p50 ms per call)", "model",
                 [f"batch {b}" for b in batches], cells)


def w2_table(rows: list[Row], model: str) -> list[str]:
    """W2's served / limit: each layout's points by the limit taken beside them (bench/run.sh's
    limit-beside lines, the better of before and after) where the run has it, else by the one at max
    batch from the run's end."""
    top = [r for r in rows if r["peer"] == "limit" and r["model"] == model]
    at_end = max(top, key=lambda r: r["batch"])["rps"] if top else None
    beside = {layout: max((r["rps"] for r in rows if r["peer"] == peer and r["model"] == model), default=None)
              for layout, peer in BESIDE.items()}
    served = []
    for r in rows:
        if r["peer"] in LAYOUTS and r.get("model") == model and r.get("rps") is not None:
            limit = beside[r["peer"]] or at_end
            share = f"{r['rps'] / limit:.2f}" if limit else "-"
            served.append((f"{r['client']}, {LAYOUTS[r['peer']]}",
                           [str(r["conc"]), f"{r['rps']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                            str(r["mean_batch"]), str(r["errors"]), f"{limit or 0:,.0f}", share]))
    if not served:
        return []
    title = f"W2 `{model}`: Despina at saturation vs the model's own rows/s at max batch (the run's end: " \
            f"{at_end or 0:,.0f})"
    columns = ["conc", "req/s", "p50 ms", "p99 ms", "mean batch", "errors", "limit", "served / limit"]
    return table(title, "client", columns, served)


def plot(rows: list[Row], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rps, ax_p99) = plt.subplots(1, 2, figsize=(13, 5))
    concs = sorted({r["conc"] for r in rows if r.get("model", W1) == W1 and r["peer"] in NAMES})
    for name, points in series(rows, W1).items():
        ok = sorted((c, r) for c, r in points.items() if r.get("rps") and not r.get("error"))
        if not ok:
            continue
        style = "-o" if name.startswith("Despina") else "--s"
        ax_rps.plot([c for c, _ in ok], [r["rps"] for _, r in ok], style, label=name)
        ax_p99.plot([c for c, _ in ok], [r["p99_ms"] for _, r in ok], style, label=name)
    for ax, label in ((ax_rps, "requests/s (1 row each)"), (ax_p99, "p99 latency, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_p99.set_yscale("log")
    ax_rps.legend(fontsize=8)
    fig.suptitle("W1 mlp [N,256]->1024->10, server on core 0, load on core 1")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--png", type=Path)
    args = p.parse_args()
    runs = [[r for r in load(path) if "peer" in r and "conc" in r] for path in args.results]
    rows = best_of(runs)
    print(f"{len(runs)} run(s): {', '.join(str(path) for path in args.results)}\n")
    spread = spread_table(runs) + per_run_table(runs, args.results) if len(runs) > 1 else []
    print("\n".join(w1_tables(rows) + spread + limit_table(rows) +
                    [line for m in W2S for line in w2_table(rows, m)]))
    if args.png:
        plot(rows, args.png)
        print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
