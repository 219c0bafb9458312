"""Triton's ragged batching, for the backends that batch tensors (onnxruntime, pytorch, tensorflow).

An input with `allow_ragged_batch` joins a batch whatever its shape, and reaches the model as one
1-D tensor: the requests' elements end to end. The model learns where each request's part lies from
its batch inputs (config `batch_input`), tensors made for each batch from one source input:

- BATCH_ELEMENT_COUNT: [requests], each request's element count;
- BATCH_ACCUMULATED_ELEMENT_COUNT: [requests], the running total (where each request's part ends);
- BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO: [requests + 1], the same after a 0 (where each starts);
- BATCH_MAX_ELEMENT_COUNT_AS_SHAPE: [the largest count], its values unset (zeros here): the shape is
  the information;
- BATCH_ITEM_SHAPE: [rows, dims], each row's shape (its request's, without the batch dimension);
- BATCH_ITEM_SHAPE_FLATTEN: the same, flat.

A batch output (config `batch_output`, BATCH_SCATTER_WITH_INPUT_SHAPE) is the model's output read as
the requests' parts end to end: each request gets the output's dims with every open size (-1, the
batch dimension's included) taken from its source input's shape at the same place. Every other
output is cut by rows, as always.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from ..contract.batchio import BatchInputSpec
from ..contract.datatypes import V2_TO_NUMPY
from ..contract.errors import BackendError, InvalidArgument
from ..contract.modelspec import ModelSpec

Arrays = dict[str, np.ndarray]


class BatchIO:
    """A model's ragged inputs, batch inputs and batch outputs; None from of() for a model with none."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.ragged = frozenset(t.name for t in spec.inputs if t.ragged)
        self.inputs = spec.batch_inputs
        self.scattered: dict[str, tuple[str, tuple[int, ...]]] = {}  # output -> (source input, its dims)
        for b in spec.batch_outputs:
            for target in b.targets:
                out = spec.output(target)
                dims = out.dims if out is not None else (-1,)
                self.scattered[target] = (b.source, (-1, *dims) if spec.batched else dims)

    @classmethod
    def of(cls, spec: ModelSpec) -> BatchIO | None:
        if spec.batch_inputs or spec.batch_outputs or any(t.ragged for t in spec.inputs):
            return cls(spec)
        return None

    def assemble(self, requests: Sequence[Arrays]) -> Arrays:
        """The batch's inputs as the model takes them: each request's own inputs, in batch order (they
        share their names and, but for the ragged ones, their shapes past the batch dimension)."""
        batch: Arrays = {}
        for name in requests[0]:
            parts = [r[name].reshape(-1) if name in self.ragged else r[name] for r in requests]
            batch[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        for b in self.inputs:
            sources = [_source(r, b.source, "batch input", b.targets[0]) for r in requests]
            tensor = self._batch_input(b, sources)
            for target in b.targets:
                batch[target] = tensor
        return batch

    def _batch_input(self, b: BatchInputSpec, sources: list[np.ndarray]) -> np.ndarray:
        dtype = V2_TO_NUMPY[b.datatype]
        counts = [a.size for a in sources]
        if b.kind == "BATCH_ELEMENT_COUNT":
            return np.array(counts, dtype=dtype)
        if b.kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
            return np.array(list(itertools.accumulate(counts)), dtype=dtype)
        if b.kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
            return np.array([0, *itertools.accumulate(counts)], dtype=dtype)
        if b.kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
            return np.zeros(max(counts), dtype=dtype)
        if b.kind in ("BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN"):
            if self.spec.batched:  # a row per batch row, holding its request's shape past the batch dimension
                rows = [a.shape[1:] for a in sources for _ in range(a.shape[0])]
            else:
                rows = [a.shape for a in sources]
            width = len(rows[0]) if rows else 0
            shapes = np.array(rows, dtype=dtype).reshape(len(rows), width)
            return shapes.reshape(-1) if b.kind == "BATCH_ITEM_SHAPE_FLATTEN" else shapes
        raise BackendError(f"model '{self.spec.name}': batch input kind {b.kind} is unknown")

    def shapes(self, requests: Sequence[Arrays]) -> dict[str, list[tuple[int, ...]]]:
        """For each batch output, the shape of each request's part."""
        out: dict[str, list[tuple[int, ...]]] = {}
        for name, (source, dims) in self.scattered.items():
            parts = []
            for r in requests:
                shape = _source(r, source, "batch output", name).shape
                if len(shape) < len(dims) and -1 in dims[len(shape):]:
                    raise BackendError(f"model '{self.spec.name}': batch output '{name}' has more "
                                       f"dimensions than its source input '{source}' ({list(shape)})")
                parts.append(tuple(shape[i] if d == -1 else d for i, d in enumerate(dims)))
            out[name] = parts
        return out


def scatter(model: str, name: str, array: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """A batch output cut into the requests' parts, end to end, each of its shape."""
    flat = array.reshape(-1)
    sizes = [math.prod(s) for s in shapes]
    if flat.size != sum(sizes):
        raise BackendError(f"model '{model}' returned {name} with {flat.size} elements; its requests' "
                           f"shapes ({', '.join(str(list(s)) for s in shapes)}) need {sum(sizes)}")
    ends = list(itertools.accumulate(sizes))
    return [flat[end - size:end].reshape(shape) for end, size, shape in zip(ends, sizes, shapes)]


def _source(request: Arrays, source: str, what: str, target: str) -> np.ndarray:
    array = request.get(source)
    if array is None:
        raise InvalidArgument(f"{what} '{target}' is made from input '{source}', which the request does "
                              "not give")
    return array
