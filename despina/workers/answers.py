"""A batch's outputs -> one answer (reply record) per request: each request's rows of every output it
asked for, as V2 bytes; or an error reply."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import clock
from ..contract.datatypes import numpy_to_v2, to_bytes
from ..contract.errors import Code, DespinaError
from ..contract.records import NO_PARAMETERS, InferReply, InferRequest, Tensor
from . import ragged
from .backends.base import response_parameters

# A batch's output this large is cut into the requests' parts from the array itself: cut from its bytes,
# each part was its second copy. Below it, one conversion and bytes slices cost less CPU (W1's outputs).
LARGE = 1 << 16


def split(model: str, requests: list[InferRequest], sizes: list[int], out: dict[str, np.ndarray],
          started: float, compute_us: int, shapes: dict[str, list[tuple[int, ...]]] | None = None
          ) -> list[InferReply]:
    """One batched execution's outputs cut into the requests' replies; `sizes` are their rows. The
    outputs in `shapes` (a ragged model's batch outputs, workers/ragged.py) are cut into parts of the
    requests' shapes instead."""
    if len(requests) == 1 and shapes is None:
        return [answer(requests[0], out, started, compute_us)]
    total = sum(sizes)
    # (name, datatype, shape of one row, all rows' bytes (BYTES or LARGE: the array), bytes per row; -1 for
    # the array, cut row by row, or a ragged output's parts: a row may hold no bytes, [N, 0])
    outputs: list[tuple[str, str, tuple[int, ...], Any, int]] = []
    scattered: dict[str, list[np.ndarray]] = {}  # a batch output's part for each request
    for name, array in out.items():
        if shapes is not None and name in shapes:
            try:
                scattered[name] = ragged.scatter(model, name, array, shapes[name])
            except DespinaError as exc:
                return [error(req, exc.code, exc.message) for req in requests]
            outputs.append((name, numpy_to_v2(array.dtype), (), b"", -1))
            continue
        if array.ndim == 0 or array.shape[0] != total:
            msg = (f"model '{model}' returned {name} with batch dimension "
                   f"{array.shape[0] if array.ndim else 'none'} for a batch of {total}")
            return [error(req, Code.BACKEND, msg) for req in requests]
        datatype = numpy_to_v2(array.dtype)
        if datatype == "BYTES" or array.nbytes >= LARGE:  # framed per request; or each one's rows copied
            outputs.append((name, datatype, array.shape[1:], array, -1))  # once, not the batch's bytes first
        else:  # one conversion for the batch; each request gets its rows' slice of the bytes
            data = to_bytes(array, datatype)
            outputs.append((name, datatype, array.shape[1:], data, len(data) // total))
    replies = []
    offset = 0
    for i, (req, n) in enumerate(zip(requests, sizes)):
        tensors = []
        asked = req.outputs
        for name, datatype, row_shape, data, row_bytes in outputs:
            if asked and name not in asked:
                continue
            if row_bytes >= 0:  # (the usual case first)
                part = data[offset * row_bytes:(offset + n) * row_bytes]
            elif name in scattered:
                piece = scattered[name][i]
                tensors.append(Tensor(name, datatype, piece.shape, to_bytes(piece, datatype)))
                continue
            else:
                part = to_bytes(data[offset:offset + n], datatype)
            tensors.append(Tensor(name, datatype, (n, *row_shape), part))
        offset += n
        if asked:  # in the order asked for
            if len(tensors) != len(asked):
                missing = ", ".join(sorted(set(asked) - {t.name for t in tensors}))
                replies.append(error(req, Code.BACKEND, f"model '{model}' did not return {missing}"))
                continue
            if len(tensors) > 1:
                tensors.sort(key=lambda t: asked.index(t.name))  # noqa: B023 (used at once)
        queue_us = int((started - req.enqueued) * 1e6)
        replies.append(InferReply(req.id, tuple(tensors), None, queue_us if queue_us > 0 else 0, compute_us,
                                  NO_PARAMETERS))
    return replies


def scattered(model: str, batch_io: ragged.BatchIO, requests: list[InferRequest],
              inputs: list[dict[str, np.ndarray]], sizes: list[int], results: list[dict[str, np.ndarray]],
              started: float, compute_us: int) -> list[InferReply]:
    """A ragged model's replies (split with its batch outputs' shapes): one execution's for the batch, or,
    for a model without a batch dimension, one per request."""
    runs = [(requests, inputs, sizes, results[0])] if len(results) == 1 else \
        [([r], [i], [n], out) for r, i, n, out in zip(requests, inputs, sizes, results)]
    replies: list[InferReply] = []
    for reqs, ins, rows, out in runs:
        try:
            shapes = batch_io.shapes(ins)
        except DespinaError as exc:
            replies.extend(error(r, exc.code, exc.message) for r in reqs)
            continue
        replies.extend(split(model, reqs, rows, out, started, compute_us, shapes))
    return replies


def answer(req: InferRequest, out: dict[str, np.ndarray], started: float, compute_us: int) -> InferReply:
    """One request's own execution: all of its outputs, as they are, and its response parameters. An
    output asked for that `out` lacks is left out (a Python model's response may lack one, as in
    Triton)."""
    tensors = []
    for name in req.outputs or tuple(out):
        array = out.get(name)
        if array is None:
            continue
        datatype = numpy_to_v2(array.dtype)
        tensors.append(Tensor(name, datatype, tuple(array.shape), to_bytes(array, datatype)))
    queue_us = max(0, int((started - req.enqueued) * 1e6))
    return InferReply(req.id, tuple(tensors), None, queue_us, compute_us, response_parameters(out))


def empty(req: InferRequest, started: float, compute_us: int) -> InferReply:
    """A decoupled model's final flag sent alone (no response in it), with the request's queue and
    compute time as an answer has them: its success is counted with it."""
    queue_us = max(0, int((started - req.enqueued) * 1e6))
    return InferReply(req.id, queue_us=queue_us, compute_us=compute_us, empty=True)


def error(req: InferRequest, code: Code, message: str, started: float = 0.0) -> InferReply:
    """An error reply, with the time the request took (counted as the failure's duration, as Triton
    counts it): queued until `started`, when its batch ran, and computing since; without `started`, it
    failed as it was read, after its time in the stream."""
    now = clock.now()
    started = started or now
    queue_us = max(0, int((started - req.enqueued) * 1e6)) if req.enqueued else 0
    return InferReply(req.id, (), (code, message), queue_us, max(0, int((now - started) * 1e6)))
