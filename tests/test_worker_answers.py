"""A batch's outputs cut into each request's reply (workers/answers.py): every datatype's rows as their
bytes, whether cut from the batch's bytes (small outputs) or from the array (large ones, copied once)."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from despina.contract.datatypes import V2_TO_NUMPY
from despina.contract.records import InferRequest
from despina.workers import answers

SIZES = [1, 2, 3]


def requests(n: int) -> list[InferRequest]:
    return [InferRequest(f"r{i}", "rep", time.time() + 60, ()) for i in range(n)]


@pytest.mark.parametrize("columns", [4, answers.LARGE], ids=["small", "large"])
@pytest.mark.parametrize("datatype", sorted(V2_TO_NUMPY))
def test_each_request_gets_its_rows_of_every_datatype(datatype: str, columns: int) -> None:
    """Every datatype, a native and a byte-swapped array, an array that is not contiguous."""
    rng = np.random.default_rng(3)
    rows = sum(SIZES)
    if datatype == "BYTES":
        array = np.array([[b"%d" % (r * columns + c) for c in range(columns)] for r in range(rows)],
                         dtype=np.object_)
    else:
        array = (rng.random((rows, 2 * columns)) * 100).astype(V2_TO_NUMPY[datatype])[:, ::2]
    variants = [array] if datatype in ("BYTES", "BOOL") else [array, array.astype(array.dtype.newbyteorder(">"))]
    for out in variants:
        replies = answers.split("m", requests(len(SIZES)), SIZES, {"y": out}, time.time(), 0)
        offset = 0
        for reply, n in zip(replies, SIZES, strict=True):
            (t,) = reply.outputs
            assert (t.name, t.datatype, t.shape) == ("y", datatype, (n, columns))
            if datatype == "BYTES":
                assert t.numpy().tolist() == array[offset:offset + n].tolist()
            else:
                assert type(t.data) is bytes
                assert t.data == np.ascontiguousarray(array[offset:offset + n], V2_TO_NUMPY[datatype]).tobytes()
            offset += n


def test_a_large_output_is_copied_once_into_the_replies() -> None:
    """A 16 MB output of two requests: their parts, and nothing else of its size. Cut from the batch's
    bytes, the bytes and the parts were held at once, twice the output."""
    out = np.ones((2, 4 << 20), np.float32)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        replies = answers.split("m", requests(2), [1, 1], {"y": out}, time.time(), 0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert [r.outputs[0].data == out[i].tobytes() for i, r in enumerate(replies)] == [True, True]
    assert peak < 1.2 * out.nbytes, f"{peak / out.nbytes:.2f} times the output"


@pytest.mark.parametrize("datatype", ["FP32", "BOOL", "BYTES"])
def test_an_output_whose_rows_hold_nothing_gives_each_request_its_empty_rows(datatype: str) -> None:
    """Rows of zero bytes (shape [N, 0]) made the bytes per row 0, which also meant "cut from the array":
    FP32 failed the batch's answers with an error of Python's, and BOOL gave each request one byte for
    nothing."""
    out = np.zeros((sum(SIZES), 0), dtype=V2_TO_NUMPY[datatype])
    replies = answers.split("m", requests(len(SIZES)), SIZES, {"y": out}, time.time(), 0)
    for reply, n in zip(replies, SIZES, strict=True):
        assert reply.error is None, reply.error
        (t,) = reply.outputs
        assert (t.name, t.datatype, t.shape) == ("y", datatype, (n, 0))
        assert t.numpy().shape == (n, 0)
        if datatype != "BYTES":
            assert t.data == b""
