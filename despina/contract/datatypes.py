"""Tensor datatypes: the V2 protocol's names, Triton's TYPE_* names, numpy dtypes, raw bytes."""
from __future__ import annotations

import math
import struct

import numpy as np

from .errors import InvalidArgument

V2_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}

# Triton's TYPE_STRING is BYTES on the wire; TYPE_BF16 has no numpy type and is refused at load.
CONFIG_TO_V2: dict[str, str] = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
}
V2_TO_CONFIG = {v: k for k, v in CONFIG_TO_V2.items()}


_BY_DTYPE = {dtype: name for name, dtype in V2_TO_NUMPY.items() if name != "BYTES"}


def numpy_to_v2(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    name = _BY_DTYPE.get(dtype)  # the common case: one dict lookup per output tensor
    if name is not None:
        return name
    if dtype.kind in "OSU":
        return "BYTES"
    little = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    name = _BY_DTYPE.get(little)
    if name is None:
        raise InvalidArgument(f"numpy dtype {dtype} has no V2 datatype")
    return name


def element_size(datatype: str) -> int:
    """Bytes per element for fixed-size datatypes; 0 for BYTES."""
    return 0 if datatype == "BYTES" else V2_TO_NUMPY[datatype].itemsize


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor -> Triton's wire form: each element as a 4-byte LE length and its bytes."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        if isinstance(item, (bytes, bytearray, memoryview)):
            raw = bytes(item)
        else:  # str (as onnxruntime returns strings); surrogates carry back bytes that were not UTF-8
            raw = str(item).encode("utf-8", "surrogateescape")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, count: int | None = None) -> np.ndarray:
    """Triton's BYTES wire form -> a flat object array; refuses truncated or trailing data."""
    view = memoryview(buffer)
    items: list[bytes] = []
    offset, end = 0, len(view)
    while offset < end:
        if offset + 4 > end:
            raise InvalidArgument("BYTES tensor data is truncated inside a length prefix")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > end:
            raise InvalidArgument("BYTES tensor element runs past the end of its data")
        items.append(bytes(view[offset:offset + length]))
        offset += length
        if count is not None and len(items) > count:
            raise InvalidArgument(f"BYTES tensor holds more than the {count} elements its shape says")
    if count is not None and len(items) != count:
        raise InvalidArgument(f"BYTES tensor holds {len(items)} elements, its shape says {count}")
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


def element_count(shape: list[int] | tuple[int, ...]) -> int:
    return math.prod(shape)


def to_numpy(datatype: str, shape: list[int] | tuple[int, ...], data: bytes | memoryview) -> np.ndarray:
    """Raw little-endian bytes -> an array of that shape (a zero-copy view for fixed-size types)."""
    dtype = V2_TO_NUMPY.get(datatype)
    if dtype is None:
        raise InvalidArgument(f"unsupported datatype '{datatype}'")
    count = math.prod(shape)  # (element_count's, inline: this runs for every input of every request)
    if datatype == "BYTES":
        return deserialize_bytes(data, count).reshape(shape)
    if len(data) != count * dtype.itemsize:
        raise InvalidArgument(
            f"tensor data has {len(data)} bytes; shape {list(shape)} of {datatype} needs "
            f"{count * dtype.itemsize}")
    # the array made on the buffer in its shape at once: np.frombuffer(data, dtype=dtype).reshape(shape)
    # cost ~2,600 instructions more (its keyword's parsing, then a second array); the size is checked above
    return np.ndarray(shape, dtype, data)


def to_bytes(array: np.ndarray, datatype: str) -> bytes:
    """An array -> raw little-endian bytes in the V2 wire form of datatype."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    dtype = V2_TO_NUMPY[datatype]
    # tobytes() is in C order whatever the array's layout: only another dtype needs converting first
    return (array if array.dtype == dtype else array.astype(dtype)).tobytes()
