"""How arrays cross the pipe between a worker and a Python model's process.

A numeric array goes as (dtype, shape, bytearray): a pickled ndarray costs several times more to
pickle and unpickle, most of all in the cold caches of two processes taking turns on a core. The
bytearray makes the array on the other side writeable, as a model may expect. Arrays of Python
objects (BYTES) go as they are.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

Packed = tuple[str, tuple[int, ...], bytearray] | np.ndarray


def pack(array: np.ndarray) -> Packed:
    if array.dtype.hasobject:
        return array
    data = array.data if array.flags.c_contiguous else array.tobytes()
    return (array.dtype.str, array.shape, bytearray(data))


def unpack(packed: Any) -> np.ndarray:
    if isinstance(packed, np.ndarray):
        return packed
    dtype, shape, data = packed
    # (as datatypes.to_numpy makes it: pack sent the array's bytes, exactly its size)
    return np.ndarray(shape, dtype, data)


def pack_all(arrays: Mapping[str, np.ndarray]) -> dict[str, Packed]:
    return {name: pack(a) for name, a in arrays.items()}


def unpack_all(packed: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: unpack(p) for name, p in packed.items()}
