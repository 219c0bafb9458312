"""pb_utils' tensors: Tensor, the datatype tables and helpers, and Triton's BYTES wire form.

Part of `triton_python_backend_utils`, which re-exports these names; a model imports them from there.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np
from _despina_errors import TritonModelException

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
# Triton's DataType enum numbers (model_config.proto), as triton_to_numpy_type takes them.
_TRITON_TO_NUMPY: dict[int, Any] = {
    1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8, 7: np.int16,
    8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64, 13: np.object_,
}
# and back: every Tensor a model makes asks this, a dict lookup instead of a dtype built per candidate
_NUMPY_TO_TRITON: dict[np.dtype[Any], int] = {np.dtype(t): n for n, t in _TRITON_TO_NUMPY.items() if n != 13}


def triton_to_numpy_type(data_type: int) -> Any:
    return _TRITON_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type is bytes or data_type is np.bytes_:
        return 13
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind in "OS":
        return 13
    return _NUMPY_TO_TRITON.get(dtype)


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | None:
    """A BYTES tensor as Triton's wire form: each element as a 4-byte LE length and its bytes, C order.

    None when the tensor does not hold bytes or objects.
    """
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.reshape(-1, order="C"):
        raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += [struct.pack("<I", len(raw)), raw]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Triton's BYTES wire form -> a flat numpy array of bytes objects (dtype object)."""
    items = []
    offset = 0
    view = memoryview(encoded_tensor)
    while offset < len(view):
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        items.append(bytes(view[offset:offset + length]))
        offset += length
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out



class Tensor:
    """A named tensor of a request or a response, backed by a numpy array in this process."""

    def __init__(self, name: str, numpy_array: Any = None, triton_dtype: int | None = None) -> None:
        if not isinstance(name, str):  # as Triton's binding
            raise TypeError(f"Tensor: name must be a str, not {type(name).__name__}")
        array = np.asarray(numpy_array) if not isinstance(numpy_array, np.ndarray) else numpy_array
        if array.dtype.type is np.str_ or array.dtype.type is np.void:
            raise TritonModelException("Tensor dtype used for numpy_array is not supported by the "
                                       "Python backend; use np.object_ instead")
        if triton_dtype is not None:
            wanted = triton_to_numpy_type(triton_dtype)
            if wanted is not None and wanted is not np.object_ and array.dtype != wanted:
                array = array.view(wanted)
        else:
            triton_dtype = numpy_to_triton_type(array.dtype)
        self._name = name
        self._array = array
        self._triton_dtype = triton_dtype

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int | None:
        return self._triton_dtype

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self.__dlpack__()

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        """The DLPack protocol, as Triton's Tensor has it: torch.from_dlpack(tensor) takes it as it is."""
        if self._array.dtype == np.object_:
            raise TritonModelException("DLPack does not have support for string tensors.")
        return self._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    @staticmethod
    def from_dlpack(name: str, dlpack: Any) -> Tensor:
        """A Tensor from an object with __dlpack__ (a CPU torch tensor, say) or a DLPack capsule."""
        if not hasattr(dlpack, "__dlpack__"):
            dlpack = _Capsule(dlpack)
        return Tensor(name, np.from_dlpack(dlpack))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


class _Capsule:
    """Lets numpy take a bare DLPack capsule (as torch.utils.dlpack.to_dlpack makes)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: the Python backend hands models CPU tensors

