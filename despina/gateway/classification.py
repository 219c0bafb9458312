"""Triton's classification extension: an output asked for with the parameter `classification: k` comes
back as its k highest values instead of the tensor, a BYTES tensor of "<value>:<index>[:<label>]"
strings, highest first, shaped [batch, k] for a model that batches (each row its own classes) and [k]
otherwise; the label is line <index> of the output's label_filename when it has one. Values print as
Triton prints them (C++'s std::to_string): integers as they are, floating point with six decimals.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..contract.datatypes import V2_TO_NUMPY, serialize_bytes
from ..contract.modelspec import ModelSpec
from ..contract.records import Tensor


def classify(spec: ModelSpec, outputs: Sequence[Tensor], classes: Mapping[str, int],
             labels: Mapping[str, Sequence[str]]) -> tuple[Tensor, ...]:
    """The reply's outputs, those in `classes` as their top classes (v2_fields.classification_count
    checked the counts and datatypes)."""
    return tuple(_classes(spec, t, classes[t.name], labels.get(t.name, ())) if t.name in classes else t
                 for t in outputs)


def _classes(spec: ModelSpec, t: Tensor, count: int, labels: Sequence[str]) -> Tensor:
    values = np.frombuffer(t.data, dtype=V2_TO_NUMPY[t.datatype])
    batched = spec.batched and len(t.shape) > 0
    rows = t.shape[0] if batched else 1
    values = values.reshape(rows, -1) if rows else values.reshape(0, 0)
    k = min(count, values.shape[1])
    floating = values.dtype.kind == "f"
    strings = []
    for row in values:
        # highest first; equal values in index order (Triton's sort leaves their order open)
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for i in order.tolist():
            value = f"{float(row[i]):f}" if floating else str(int(row[i]))
            label = f":{labels[i]}" if i < len(labels) else ""
            strings.append(f"{value}:{i}{label}".encode())
    array = np.empty(len(strings), dtype=np.object_)
    array[:] = strings
    shape = (rows, k) if batched else (k,)
    return Tensor(t.name, "BYTES", shape, serialize_bytes(array))
