"""The metrics Python models make themselves (Triton's custom metrics, `pb_utils.MetricFamily`), for the
control plane's /metrics.

Each model process reports its families to its worker about once a second after a change
(workers/backends/python_stub/_despina_metrics.py); each worker publishes those of the versions it
serves with its heartbeat (field `custom_metrics`, msgpack {model: {version: [family]}}), so that a
version unloaded there, or a dead worker, takes its series along. A family is {"name", "help", "type":
"counter" | "gauge" | "histogram", "metrics": [{"labels", "value", "at"}, or a histogram's {"labels",
"buckets", "counts" (per bucket, then above the last), "sum"}]}.

As in Triton, where every instance and model that makes a family of one name shares it, a name and
its labels (as the model gives them: Triton adds none) are one series however many processes report
it. Counters and histograms are summed over them; a gauge shows the value set (or incremented) last,
by whichever process, as Triton's one gauge would. The first report of a name gives its type and help:
a report of it with another type, or a histogram with other buckets, is left out.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

Series = tuple[str, dict[str, str], float]  # sample name, labels, value
Family = tuple[str, str, str, list[Series]]  # name, type, help, its samples
Labels = tuple[tuple[str, str], ...]

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # Prometheus's rules, which pb_utils enforces too
LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
KINDS = ("counter", "gauge", "histogram")


def families(reports: Iterable[dict[str, dict[str, list[dict[str, Any]]]]]) -> list[Family]:
    """Every live worker's `custom_metrics` -> the families, by name, each series merged over processes."""
    merged: dict[str, tuple[str, str, dict[Labels, Any]]] = {}
    for report in reports:
        for versions in report.values():
            for reported in versions.values():
                for family in reported:
                    try:
                        _merge(merged, family)
                    except (AttributeError, KeyError, TypeError, ValueError):
                        continue  # not a family this control plane reads (another release's?)
    return [(name, kind, help_, _samples(name, kind, series))
            for name, (kind, help_, series) in sorted(merged.items())]


def _merge(merged: dict[str, tuple[str, str, dict[Labels, Any]]], family: dict[str, Any]) -> None:
    name, kind = family["name"], family["type"]
    if not (isinstance(name, str) and NAME.fullmatch(name)) or kind not in KINDS:
        return
    known_kind, _, series = merged.setdefault(name, (kind, str(family["help"]), {}))
    if known_kind != kind:
        return
    for metric in family["metrics"]:
        labels = tuple(sorted((str(k), str(v)) for k, v in metric["labels"].items()))
        if not all(LABEL.fullmatch(k) for k, _ in labels):
            continue
        if kind == "counter":
            series[labels] = series.get(labels, 0.0) + float(metric["value"])
        elif kind == "gauge":  # (when it changed, its value): the latest change shows
            change = (float(metric["at"]), float(metric["value"]))
            if labels not in series or change[0] > series[labels][0]:
                series[labels] = change
        else:
            buckets = [float(b) for b in metric["buckets"]]
            counts = [int(c) for c in metric["counts"]]
            if len(counts) != len(buckets) + 1:
                continue
            total = float(metric["sum"])
            had = series.get(labels)
            if had is None:
                series[labels] = (buckets, counts, total)
            elif had[0] == buckets:
                series[labels] = (buckets, [a + b for a, b in zip(had[1], counts)], had[2] + total)


def _samples(name: str, kind: str, series: dict[Labels, Any]) -> list[Series]:
    out: list[Series] = []
    for key, value in sorted(series.items()):
        labels = dict(key)
        if kind == "counter":
            out.append((name, labels, value))
        elif kind == "gauge":
            out.append((name, labels, value[1]))
        else:
            buckets, counts, total = value
            running = 0
            for bound, n in zip(buckets, counts):
                running += n
                if math.isfinite(bound):  # (a bucket of +Inf is the one every histogram has)
                    out.append((f"{name}_bucket", {**labels, "le": _bound(bound)}, running))
            out.append((f"{name}_bucket", {**labels, "le": "+Inf"}, sum(counts)))
            out.append((f"{name}_sum", labels, total))
            out.append((f"{name}_count", labels, sum(counts)))
    return out


def _bound(bound: float) -> str:
    return f"{int(bound)}" if bound.is_integer() else repr(bound)
