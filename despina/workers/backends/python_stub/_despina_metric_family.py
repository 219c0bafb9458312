"""pb_utils' custom metrics: MetricFamily and its Metric (counter, gauge or histogram), and the report
of them all that the stub's reporter sends to the worker (_despina_metrics.py).

Part of `triton_python_backend_utils`, which re-exports these names; a model imports them from there.
The families and the changed flag live in that module, one object for the stub and the model alike.
"""
from __future__ import annotations

import re
import time
from typing import Any

import triton_python_backend_utils as pb_utils
from _despina_errors import TritonModelException


class Metric:
    """One metric of a MetricFamily (Triton's custom metrics): a counter, gauge or histogram with its
    labels. Its process reports it to its worker, and the control plane's /metrics shows it."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        self._family = family
        self._value = 0.0
        self._changed_at = 0.0  # when a gauge was last set or incremented: the last one shows
        self._buckets = buckets
        self._counts = [0] * (len(buckets) + 1) if buckets is not None else []
        self._sum = 0.0

    def increment(self, value: float) -> None:
        if self._family._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("increment() is not supported by a HISTOGRAM metric: use observe()")
        if self._family._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a COUNTER metric cannot be incremented by a negative value")
        self._value += value
        self._changed_at = time.time()
        pb_utils._metrics_changed = True  # after the change: a report taken meanwhile is followed by another

    def set(self, value: float) -> None:
        if self._family._kind != MetricFamily.GAUGE:
            raise TritonModelException("set() is supported by a GAUGE metric only")
        self._value = float(value)
        self._changed_at = time.time()
        pb_utils._metrics_changed = True

    def observe(self, value: float) -> None:
        if self._buckets is None:
            raise TritonModelException("observe() is supported by a HISTOGRAM metric only")
        self._counts[next((i for i, bound in enumerate(self._buckets) if value <= bound),
                          len(self._buckets))] += 1
        self._sum += value
        pb_utils._metrics_changed = True

    def value(self) -> float:
        if self._buckets is not None:
            raise TritonModelException("value() is not supported by a HISTOGRAM metric")
        return self._value

    def _report(self, labels: dict[str, str]) -> dict[str, Any]:
        if self._buckets is not None:
            return {"labels": labels, "buckets": list(self._buckets), "counts": list(self._counts),
                    "sum": float(self._sum)}
        return {"labels": labels, "value": float(self._value), "at": self._changed_at}


class MetricFamily:
    """Triton's custom metrics: `MetricFamily(name, description, kind)`, then `.Metric(labels)` (and
    `buckets` for a histogram). Metrics of one family with the same labels are one metric."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in (MetricFamily.COUNTER, MetricFamily.GAUGE, MetricFamily.HISTOGRAM):
            raise TritonModelException(f"metric family '{name}': kind must be MetricFamily.COUNTER, GAUGE "
                                       "or HISTOGRAM")
        if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
            raise TritonModelException(f"metric family {name!r}: a metric name is letters, digits, '_' and "
                                       "':', not starting with a digit (Prometheus's rule)")
        families = pb_utils._metric_families
        known_kind, _, self._metrics = families.setdefault(name, (kind, str(description), {}))
        if known_kind != kind:  # the same name is the same family (and its metrics), as in Triton
            raise TritonModelException(f"metric family '{name}' already exists with another kind")
        self._name, self._description, self._kind = name, description, kind

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        if self._kind == MetricFamily.HISTOGRAM and buckets is None:
            raise TritonModelException(f"metric family '{self._name}': a HISTOGRAM metric needs buckets")
        if self._kind != MetricFamily.HISTOGRAM and buckets is not None:
            raise TritonModelException(f"metric family '{self._name}': only a HISTOGRAM metric has buckets")
        key = tuple(sorted((str(k), str(v)) for k, v in (labels or {}).items()))
        for label, _ in key:
            if not _LABEL_NAME.fullmatch(label) or label.startswith("__") or \
                    (label == "le" and self._kind == MetricFamily.HISTOGRAM):
                raise TritonModelException(f"metric family '{self._name}': {label!r} cannot be a label name "
                                           "(letters, digits and '_', not starting with a digit or '__'; "
                                           "'le' is a histogram's own)")
        if key not in self._metrics:
            self._metrics[key] = Metric(self, dict(key), sorted(buckets) if buckets is not None else None)
        return self._metrics[key]


MetricKind = MetricFamily  # Triton's enum of the kinds, its values in the module too
COUNTER, GAUGE, HISTOGRAM = MetricFamily.COUNTER, MetricFamily.GAUGE, MetricFamily.HISTOGRAM
_KIND_NAMES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _metrics_report() -> list[dict[str, Any]]:
    """Every metric family with its metrics' values, as the worker publishes them (despina/custom_metrics.py).
    Safe while the model's threads update them: list() copies a dict without letting another thread in."""
    return [{"name": name, "help": description, "type": _KIND_NAMES[kind],
             "metrics": [metric._report(dict(labels)) for labels, metric in list(metrics.items())]}
            for name, (kind, description, metrics) in list(pb_utils._metric_families.items())]
