"""A KServe V2 request's parts, each checked as it is read: its inputs (JSON data, binary data or shared
memory), the outputs it asks for (binary, as top classes, into shared memory) and its parameters. The
whole body is decoded, and remembered, by v2.py.
"""
from __future__ import annotations

from typing import Any

import orjson

from ..contract.datatypes import V2_TO_NUMPY, element_count, to_numpy
from ..contract.ensemble import PLATFORM
from ..contract.errors import InvalidArgument
from ..contract.modelspec import ModelSpec, check_datatype, check_shape, known_input, known_output
from ..contract.records import NO_PARAMETERS, Parameters, Tensor
from ..contract.sequence import optional_sequence, passed_sequence, request_sequence
from .jsondata import json_data_to_bytes
from .shm import Region, Registry, ShmOutput

InShm = tuple[str, int, int]  # (region, byte size, offset): where a tensor is in shared memory
# Request parameters Despina reads itself (Triton's reserved ones): they never reach the model.
CONSUMED = frozenset({"priority", "timeout", "binary_data_output", "sequence_id", "sequence_start",
                      "sequence_end"})
SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")

RESERVED = "parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified."


def flag(params: dict[str, Any], name: str, where: str) -> bool:
    """A boolean parameter of Triton's binary extension (false when absent); anything else is refused, as
    Triton refuses it, rather than read as false."""
    value = params.get(name, False)
    if type(value) is not bool:
        shown = orjson.dumps(value)[:40].decode(errors="replace")
        raise InvalidArgument(f"{where}: parameter '{name}' must be true or false, not {shown}")
    return value


def model_parameters(params: dict[str, Any], infer: bool = False) -> Parameters:
    """A request's parameters as its model gets them: all but those Despina reads itself (CONSUMED).
    Every value must be a string, a number or a boolean, as in Triton; and on /infer (`infer`) no name may
    start with triton_, as Triton 2.51 refuses there (its /generate passes them on)."""
    if not params:
        return NO_PARAMETERS
    for name, value in params.items():
        if type(value) not in (str, int, float, bool):
            kind = "null" if value is None else "an object" if isinstance(value, dict) else "an array"
            raise InvalidArgument(f"parameter '{name}' must be a string, a number or a boolean, not {kind}")
        if infer and name.startswith("triton_"):
            raise InvalidArgument(RESERVED)
    if params.keys() <= CONSUMED:  # tritonclient sends binary_data_output with every request
        return NO_PARAMETERS
    return {name: value for name, value in params.items() if name not in CONSUMED}


def as_object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"field '{what}' must be an object")
    return value


def decode_input(raw: Any, spec: ModelSpec, binary: memoryview, max_elements: int, booleans: bool,
                  shm: Registry | None) -> tuple[Tensor, int | InShm]:
    """An input, and how many bytes of the binary part it took, or where in shared memory it was."""
    if not isinstance(raw, dict):
        raise InvalidArgument("each entry of 'inputs' must be an object")
    name = raw.get("name")
    if not isinstance(name, str):
        raise InvalidArgument("an input has no 'name'")
    expected = known_input(spec, name)
    datatype: Any = raw.get("datatype")  # JSON; check_datatype has it equal to the model's str
    check_datatype(expected, datatype)
    shape = raw.get("shape")
    if type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):
        raise InvalidArgument(f"input '{name}': 'shape' must be a list of non-negative integers")
    check_shape(spec, expected, shape)
    check_count(name, shape, max_elements)
    params = as_object(raw.get("parameters"), f"inputs[{name}].parameters")
    size = params.get("binary_data_size")
    in_shm = tensor_parameters(params, f"input '{name}'")
    if in_shm is not None:
        if size is not None or "data" in raw:
            raise InvalidArgument(f"input '{name}': give one of 'data', binary_data_size and shared memory")
        region, size, offset = in_shm
        data = shm_region(shm, region).read(offset, size, f"input '{name}'")
        check_size(name, datatype, shape, data)
        return Tensor(name, datatype, tuple(shape), data), in_shm
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidArgument(f"input '{name}': binary_data_size must be a non-negative integer")
        if size > len(binary):
            raise InvalidArgument(f"input '{name}': binary_data_size {size} runs past the end of the body")
        if "data" in raw:
            raise InvalidArgument(f"input '{name}': give either 'data' or binary_data_size, not both")
        data = bytes(binary[:size])
        check_size(name, datatype, shape, data)
        return Tensor(name, datatype, tuple(shape), data), size
    if "data" not in raw:
        raise InvalidArgument(f"input '{name}' has neither 'data' nor binary_data_size")
    return Tensor(name, datatype, tuple(shape), json_data_to_bytes(name, datatype, shape, raw["data"],
                                                                  booleans)), 0


def check_size(name: str, datatype: str, shape: list[int], data: bytes) -> None:
    """Raw bytes of an input (binary data or shared memory) fit its shape and datatype."""
    if datatype == "BYTES":
        try:
            to_numpy(datatype, shape, data)  # validates the framing
        except InvalidArgument as exc:
            raise InvalidArgument(f"input '{name}': {exc.message}") from None
    elif len(data) != element_count(shape) * V2_TO_NUMPY[datatype].itemsize:
        raise InvalidArgument(f"input '{name}': {len(data)} bytes of data do not match shape {shape} of "
                              f"{datatype} ({element_count(shape) * V2_TO_NUMPY[datatype].itemsize} bytes)")


def tensor_parameters(params: dict[str, Any], what: str) -> tuple[str, int, int] | None:
    """An input's or a requested output's shared memory parameters: (region, byte size, offset), or None
    when it names none. The region and its byte size come together, as Triton asks."""
    if not any(p in params for p in SHM_PARAMETERS):
        return None
    region = params.get("shared_memory_region")
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    if region is None or size is None:
        raise InvalidArgument(f"{what}: shared_memory_region and shared_memory_byte_size must be given "
                              "together")
    if type(region) is not str or not region:
        raise InvalidArgument(f"{what}: shared_memory_region must be a region's name")
    for field, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if type(value) is not int or value < 0:
            raise InvalidArgument(f"{what}: {field} must be a non-negative integer")
    return region, size, offset


def shm_region(shm: Registry | None, name: str, looked: bool = False) -> Region:
    if shm is None:
        raise InvalidArgument("shared memory is not allowed on this server: start it with --allow-client-shm "
                              "(DESPINA_ALLOW_CLIENT_SHM=1)")
    return shm.region(name, looked)


def check_count(name: str, shape: list[int], max_elements: int) -> None:
    count = element_count(shape)
    if count > max_elements:
        raise InvalidArgument(f"input '{name}': {count} elements is more than the limit of {max_elements} "
                              "(DESPINA_MAX_TENSOR_ELEMENTS)")


def decode_outputs(raw: Any, spec: ModelSpec, shm: Registry | None
                    ) -> tuple[list[str], set[str], dict[str, int], dict[str, ShmOutput]]:
    """The outputs asked for, those asked as binary data, those asked as their top classes, and those to
    be written in shared memory."""
    if raw is None:
        return [], set(), {}, {}
    if not isinstance(raw, list):
        raise InvalidArgument("field 'outputs' must be a list")
    names: list[str] = []
    binary: set[str] = set()
    classes: dict[str, int] = {}
    in_shm: dict[str, ShmOutput] = {}
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgument("each entry of 'outputs' must be an object with a 'name'")
        name = item["name"]
        known_output(spec, name)
        if name in names:  # as Triton, whose outputs are a map by name: the first one asked for holds
            continue
        names.append(name)
        params = as_object(item.get("parameters"), f"outputs[{name}].parameters")
        as_binary = flag(params, "binary_data", f"output '{name}'")
        if as_binary:
            binary.add(name)
        count = params.get("classification")
        if count is not None and classification_count(spec, name, count):
            classes[name] = count
        where = tensor_parameters(params, f"output '{name}'")
        if where is not None:
            if name in classes:
                raise InvalidArgument(f"output '{name}': shared memory can't be set on a classification "
                                      "output")
            if as_binary:
                raise InvalidArgument(f"output '{name}': can't set both 'shared_memory_region' and "
                                      "'binary_data'")
            region, size, offset = where
            in_shm[name] = shm_region(shm, region).output(name, offset, size)
    return names, binary, classes, in_shm


def classification_count(spec: ModelSpec, name: str, count: Any) -> int:
    """An output's `classification` parameter (Triton's classification extension), checked against the
    output's datatype before anything runs; 0 asks for the tensor itself, as in Triton."""
    if type(count) is not int or count < 0:
        raise InvalidArgument(f"output '{name}': parameter 'classification' must be a non-negative integer")
    if count == 0:
        return 0
    output = spec.output(name)
    datatype = output.datatype if output is not None else ""
    if datatype not in CLASSIFIABLE:
        raise InvalidArgument(f"output '{name}': class result not available for output due to unsupported "
                              f"type '{datatype}'")
    return count


CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32",
                          "FP64"})


def schedule_parameters(parameters: dict[str, object]) -> tuple[int, int]:
    """Triton's schedule-policy extension: `priority` (1 = highest, 0 = default) and `timeout` (µs)."""
    if not parameters:
        return 0, 0
    values = []
    for name in ("priority", "timeout"):
        value = parameters.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(f"parameter '{name}' must be a non-negative integer")
        values.append(value)
    return values[0], values[1]


def sequence_of(spec: ModelSpec, parameters: dict[str, object]) -> tuple[int | str, int] | None:
    """The sequence a request names in its parameters: required by a stateful model, carried through an
    ensemble to its stateful steps, handed as it is to the rest (as Triton hands it to every model)."""
    if spec.sequence:
        return request_sequence(parameters, spec.name)
    if spec.platform == PLATFORM:
        return optional_sequence(parameters, spec.name)
    return passed_sequence(parameters)


def int_header(raw: bytes) -> int:
    """Inference-Header-Content-Length as a number (400 when it is not one)."""
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not digits.isdigit():  # ASCII digits only: int() would also take "1_0", "+5" and spaces
        raise InvalidArgument("Inference-Header-Content-Length must be an integer")
    return int(raw)
