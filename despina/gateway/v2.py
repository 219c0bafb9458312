"""KServe V2 / Open Inference Protocol bodies: JSON tensors and Triton's binary tensor extension.

Pure functions from bytes to records and back; no HTTP framework here.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson

from ..contract.datatypes import V2_TO_NUMPY, element_count, to_numpy
from ..contract.errors import InvalidArgument
from ..contract.modelconfig import (
    ModelSpec,
    check_datatype,
    check_inputs,
    check_shape,
    known_input,
    known_output,
)
from ..contract.records import NO_PARAMETERS, Parameters, Tensor
from ..settings import Settings
from .http import json_object
from .jsondata import (
    CHUNK_BYTES,
    PACKED,
    Unvouched,
    data_holds_no_booleans,
    data_template,
    json_data_to_bytes,
    nonfinite_json,
    packed_span,
    skeleton,
)
from .shm import Region, Registry, ShmOutput, tensor_parameters

MAX_ELEMENTS: int = Settings.max_tensor_elements  # per tensor, unless the caller passes its setting
# Request parameters Despina reads itself (Triton's reserved ones): they never reach the model.
CONSUMED = frozenset({"priority", "timeout", "binary_data_output", "sequence_id", "sequence_start",
                      "sequence_end"})


@dataclass
class Decoded:
    id: str | None
    inputs: list[Tensor]
    outputs: list[str]                       # requested, in order; empty = all
    binary_outputs: set[str] = field(default_factory=set)
    binary_all: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)
    model_parameters: Parameters = field(default_factory=dict)  # but those in CONSUMED
    # the requests of one remembered header share this: their reply headers by the outputs' shapes
    heads: dict[tuple[Any, ...], bytes] | None = field(default=None, compare=False, repr=False)
    classes: dict[str, int] = field(default_factory=dict)  # output -> top classes asked (classification)
    shm_outputs: dict[str, ShmOutput] = field(default_factory=dict)  # outputs to write in shared memory


InShm = tuple[str, int, int]  # (region, byte size, offset): where a tensor is in shared memory


@dataclass(frozen=True, slots=True)
class _FromShm:
    """A planned input read from shared memory each time (what the region holds then)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    where: InShm


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a request's JSON header decides, checked once: clients such as tritonclient and perf_analyzer
    send the same header with every request of a shape (a body all header when the tensors are in shared
    memory). Regions are looked up by name with each request: one registered again is the new one."""

    spec: ModelSpec                                  # held, so that its id is not reused while cached
    # JSON ones, where binary ones go (name, datatype, shape, size), or where shared memory ones are
    inputs: tuple[Tensor | tuple[str, str, tuple[int, ...], int] | _FromShm, ...]
    size: int                                        # the binary part's length
    decoded: Decoded                                 # the rest (id, outputs, parameters), no inputs
    shm_outputs: tuple[tuple[str, InShm], ...] = ()  # the outputs asked into shared memory

    def apply(self, body: bytes, offset: int, shm: Registry | None) -> Decoded:
        inputs = []
        looked = False  # the registrations are read once for all of a request's regions
        for t in self.inputs:
            if type(t) is Tensor:  # its data was in the header
                inputs.append(t)
            elif type(t) is _FromShm:
                region, size, at = t.where
                inputs.append(Tensor(t.name, t.datatype, t.shape,
                                     _region(shm, region, looked).read(at, size, f"input '{t.name}'")))
                looked = True
            else:
                name, datatype, shape, size = t  # type: ignore[misc]
                inputs.append(Tensor(name, datatype, shape, body[offset:offset + size]))
                offset += size
        d = self.decoded  # its outputs, binary outputs and parameters are read, never changed
        outputs = {}
        for name, (region, size, at) in self.shm_outputs:
            outputs[name] = _region(shm, region, looked).output(name, at, size)
            looked = True
        return Decoded(d.id, inputs, d.outputs, d.binary_outputs, d.binary_all, d.parameters,
                       d.model_parameters, d.heads, d.classes, outputs)


PLANS_MAX, PLAN_HEADER_MAX = 512, 4096
_plans: dict[tuple[int, int, bytes], _Plan] = {}
# what the plans' keys (binary headers, JSON templates) have been seen without a plan: a plan is made on a
# key's second sight, so that requests that differ each time (an id or a parameter of the client's own in a
# binary header, a parameter in a JSON document) pay a look-up each, not a plan's making
_seen: dict[tuple[Any, ...], None] = {}


def _seen_before(key: tuple[Any, ...]) -> bool:
    """Whether a plan's key was seen before; it is noted now if not (the oldest forgotten past PLANS_MAX)."""
    if key in _seen:
        return True
    if len(_seen) >= PLANS_MAX:
        del _seen[next(iter(_seen))]
    _seen[key] = None
    return False


def decode_infer(body: bytes, header_length: int | None, spec: ModelSpec,
                 max_elements: int = MAX_ELEMENTS, shm: Registry | None = None) -> Decoded:
    """A V2 infer body (JSON, optionally followed by binary tensors) -> validated tensors.

    Raises InvalidArgument, and nothing else, on any input; a tensor of more than `max_elements`
    elements is refused before anything is allocated for it. `shm`: the server's shared memory regions,
    which inputs may be read from and outputs asked into (None: the server allows none)."""
    if header_length is None or header_length == len(body):  # all JSON (perf_analyzer says so)
        decoded = _json_planned(body, spec, max_elements, shm)
        if decoded is not None:
            return decoded
    if header_length is None:
        if shm is not None and len(body) <= PLAN_HEADER_MAX and body.find(b"shared_memory_") >= 0:
            return _planned(body, len(body), spec, max_elements, shm)  # all header: the data is elsewhere
        return _decode(body, memoryview(b""), spec, max_elements, shm)[0]
    if header_length < 0:
        raise InvalidArgument(f"Inference-Header-Content-Length {header_length} is negative: it is the "
                              "length of the JSON header that starts the body")
    if header_length > len(body):
        raise InvalidArgument(f"Inference-Header-Content-Length {header_length} is past the end "
                              f"of the {len(body)}-byte body")
    if header_length > PLAN_HEADER_MAX:
        return _decode(body[:header_length], memoryview(body)[header_length:], spec, max_elements, shm)[0]
    return _planned(body, header_length, spec, max_elements, shm)


def _planned(body: bytes, header_length: int, spec: ModelSpec, max_elements: int, shm: Registry | None
             ) -> Decoded:
    """A binary request decoded by its header's remembered plan, made on the header's second sight."""
    header = body[:header_length]
    key = (id(spec), max_elements, header)
    plan = _plans.get(key)
    if plan is None or plan.spec is not spec or plan.size != len(body) - header_length:
        decoded, sources = _decode(header, memoryview(body)[header_length:], spec, max_elements, shm)
        # the header's first sight; or BYTES, whose framing is data: checked each time
        if not _seen_before(key) or any(t.datatype == "BYTES" for t in decoded.inputs):
            return decoded
        # only replies without JSON data are kept: binary ones, those into shared memory
        heads: dict[tuple[Any, ...], bytes] | None = \
            {} if decoded.binary_all or decoded.binary_outputs or decoded.shm_outputs else None
        plan = _Plan(spec, tuple(_FromShm(t.name, t.datatype, t.shape, b) if type(b) is tuple
                                 else (t.name, t.datatype, t.shape, len(t.data)) if b else t
                                 for t, b in zip(decoded.inputs, sources)),
                     len(body) - header_length, replace(decoded, inputs=[], heads=heads, shm_outputs={}),
                     tuple((name, (o.region.reg.name, o.byte_size, o.offset))
                           for name, o in decoded.shm_outputs.items()))  # not its data
        if len(_plans) >= PLANS_MAX:
            del _plans[next(iter(_plans))]
        _plans[key] = plan
    return plan.apply(body, header_length, shm)


@dataclass(frozen=True, slots=True)
class _JsonPlan:
    """What a JSON request decides but for its numbers and its id, checked once: a client sends the same
    document with other numbers in its inputs' "data" arrays, request after request, often with an id of
    its own each time. Each input's numbers are parsed and packed alone (orjson, struct); anything the plan
    cannot vouch for (a boolean or a null among them, a NaN, their count, a number out of its datatype's
    range, an id that is not a JSON string) sends the request the long way, which says what is wrong or
    converts it as it always does."""

    spec: ModelSpec                                        # held, as _Plan's
    inputs: tuple[tuple[str, str, tuple[int, ...], int, struct.Struct], ...]  # and count, packer
    decoded: Decoded                                       # the rest (outputs, parameters), no inputs

    def apply(self, doc: bytes, spans: list[tuple[int, int]], own_id: bytes | None) -> Decoded | None:
        inputs = []
        find = doc.find
        view = memoryview(doc)
        d = self.decoded
        try:
            req_id = d.id if own_id is None else orjson.loads(b'"%s"' % own_id)  # checked as JSON text
            for (start, end), (name, datatype, shape, count, packer) in zip(spans, self.inputs):
                if end - start > CHUNK_BYTES:  # a large tensor's, parsed a chunk at a time
                    data = packed_span(doc, start, end, PACKED[datatype], count)
                    if data is None:
                        return None
                    inputs.append(Tensor(name, datatype, shape, data))
                    continue
                if find(b"t", start, end) >= 0 or find(b"f", start, end) >= 0:  # true, false (or Infinity)
                    return None
                values = orjson.loads(view[start:end])
                if len(values) != count:
                    return None
                inputs.append(Tensor(name, datatype, shape, packer.pack(*values)))
        except (orjson.JSONDecodeError, struct.error, TypeError, OverflowError):
            return None
        return Decoded(req_id, inputs, d.outputs, d.binary_outputs, d.binary_all, d.parameters,
                       d.model_parameters, d.heads, d.classes)


# (id(spec), max_elements, whether the id was emptied, template): the arrays' count is the template's
_json_plans: dict[tuple[int, int, bool, bytes], _JsonPlan] = {}


def _json_planned(doc: bytes, spec: ModelSpec, max_elements: int, shm: Registry | None) -> Decoded | None:
    """An all-JSON request decoded by its document's remembered plan (made on the second sight of its
    template), or None where no plan applies: the caller decodes it the long way."""
    found = data_template(doc, PLAN_HEADER_MAX)
    if found is None:
        return None
    template, spans, own_id = found
    if template.find(b"shared_memory_") >= 0:  # regions are read each time: the binary plan's kind
        return None
    key = (id(spec), max_elements, own_id is not None, template)
    plan = _json_plans.get(key)
    if plan is not None and plan.spec is spec:
        return plan.apply(doc, spans, own_id)
    if not _seen_before(key):
        return None  # the caller's long way: the first sight of this template
    decoded = _decode(doc, memoryview(b""), spec, max_elements, shm)[0]
    if (len(decoded.inputs) == len(spans) and all(t.datatype in PACKED for t in decoded.inputs)
            # the one "id" string is the request's own, not one in its parameters
            and (own_id is None or decoded.id == own_id.decode("utf-8", "replace"))):
        inputs = []
        for t in decoded.inputs:
            count = element_count(t.shape)
            packer = struct.Struct(f"<{count}{PACKED[t.datatype]}")
            inputs.append((t.name, t.datatype, t.shape, count, packer))
        heads: dict[tuple[Any, ...], bytes] | None = \
            {} if decoded.binary_all or decoded.binary_outputs else None
        if len(_json_plans) >= PLANS_MAX:
            del _json_plans[next(iter(_json_plans))]
        _json_plans[key] = _JsonPlan(spec, tuple(inputs), replace(decoded, inputs=[], heads=heads))
    return decoded


def _decode(header: bytes, binary: memoryview, spec: ModelSpec, max_elements: int, shm: Registry | None = None
            ) -> tuple[Decoded, list[bool | InShm]]:
    """The body decoded, and for each input whether its data came from the binary part, or where in
    shared memory it was. A large JSON header's tensors are parsed one at a time, a chunk at a time, where
    it is of the plain kind (jsondata.skeleton), else whole."""
    if len(header) > CHUNK_BYTES:
        doc = skeleton(header)
        if doc is not None:
            try:
                return _decoded(doc, header, binary, spec, max_elements, shm)
            except Unvouched:  # a number that only the long way converts, or says is wrong
                pass
    return _decoded(json_object(header), header, binary, spec, max_elements, shm)


def _decoded(doc: dict[str, Any], header: bytes, binary: memoryview, spec: ModelSpec, max_elements: int,
             shm: Registry | None) -> tuple[Decoded, list[bool | InShm]]:
    params = _object(doc.get("parameters"), "parameters")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument("field 'inputs' must be a non-empty list")
    offset = 0
    inputs: list[Tensor] = []
    sources: list[bool | InShm] = []
    seen: set[str] = set()
    booleans = not data_holds_no_booleans(header)
    for raw in raw_inputs:
        tensor, used = _decode_input(raw, spec, binary[offset:], max_elements, booleans, shm)
        if tensor.name in seen:
            raise InvalidArgument(f"input '{tensor.name}' is given twice")
        seen.add(tensor.name)
        inputs.append(tensor)
        if isinstance(used, tuple):  # from shared memory
            sources.append(used)
            continue
        sources.append("data" not in raw)  # else binary_data_size: the bytes follow the header
        offset += used
    if offset != len(binary):
        raise InvalidArgument(f"the body carries {len(binary) - offset} bytes of binary data that no "
                              "input claims (check binary_data_size)")
    check_inputs(spec, inputs)
    outputs, binary_outputs, classes, shm_outputs = _decode_outputs(doc.get("outputs"), spec, shm)
    req_id = doc.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise InvalidArgument("field 'id' must be a string")
    # as Triton: binary_data_output is the kind of the outputs a request does not list (all of them when
    # it lists none); a listed one is binary when its own binary_data says so
    binary_all = _flag(params, "binary_data_output", "the request's parameters") and not outputs
    return Decoded(req_id, inputs, outputs, binary_outputs, binary_all, params,
                   model_parameters(params), classes=classes, shm_outputs=shm_outputs), sources


def _flag(params: dict[str, Any], name: str, where: str) -> bool:
    """A boolean parameter of Triton's binary extension (false when absent); anything else is refused, as
    Triton refuses it, rather than read as false."""
    value = params.get(name, False)
    if type(value) is not bool:
        shown = orjson.dumps(value)[:40].decode(errors="replace")
        raise InvalidArgument(f"{where}: parameter '{name}' must be true or false, not {shown}")
    return value


def model_parameters(params: dict[str, Any]) -> Parameters:
    """A request's parameters as its model gets them: all but those Despina reads itself (CONSUMED).
    Every value must be a string, a number or a boolean, as in Triton."""
    if not params:
        return NO_PARAMETERS
    for name, value in params.items():
        if type(value) not in (str, int, float, bool):
            kind = "null" if value is None else "an object" if isinstance(value, dict) else "an array"
            raise InvalidArgument(f"parameter '{name}' must be a string, a number or a boolean, not {kind}")
    if params.keys() <= CONSUMED:  # tritonclient sends binary_data_output with every request
        return NO_PARAMETERS
    return {name: value for name, value in params.items() if name not in CONSUMED}


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"field '{what}' must be an object")
    return value


def _decode_input(raw: Any, spec: ModelSpec, binary: memoryview, max_elements: int, booleans: bool,
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
    params = _object(raw.get("parameters"), f"inputs[{name}].parameters")
    size = params.get("binary_data_size")
    in_shm = tensor_parameters(params, f"input '{name}'")
    if in_shm is not None:
        if size is not None or "data" in raw:
            raise InvalidArgument(f"input '{name}': give one of 'data', binary_data_size and shared memory")
        region, size, offset = in_shm
        data = _region(shm, region).read(offset, size, f"input '{name}'")
        _check_size(name, datatype, shape, data)
        return Tensor(name, datatype, tuple(shape), data), in_shm
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidArgument(f"input '{name}': binary_data_size must be a non-negative integer")
        if size > len(binary):
            raise InvalidArgument(f"input '{name}': binary_data_size {size} runs past the end of the body")
        if "data" in raw:
            raise InvalidArgument(f"input '{name}': give either 'data' or binary_data_size, not both")
        data = bytes(binary[:size])
        _check_size(name, datatype, shape, data)
        return Tensor(name, datatype, tuple(shape), data), size
    if "data" not in raw:
        raise InvalidArgument(f"input '{name}' has neither 'data' nor binary_data_size")
    return Tensor(name, datatype, tuple(shape), json_data_to_bytes(name, datatype, shape, raw["data"],
                                                                  booleans)), 0


def _check_size(name: str, datatype: str, shape: list[int], data: bytes) -> None:
    """Raw bytes of an input (binary data or shared memory) fit its shape and datatype."""
    if datatype == "BYTES":
        to_numpy(datatype, shape, data)  # validates the framing
    elif len(data) != element_count(shape) * V2_TO_NUMPY[datatype].itemsize:
        raise InvalidArgument(f"input '{name}': {len(data)} bytes of data do not match shape {shape} of "
                              f"{datatype} ({element_count(shape) * V2_TO_NUMPY[datatype].itemsize} bytes)")


def _region(shm: Registry | None, name: str, looked: bool = False) -> Region:
    if shm is None:
        raise InvalidArgument("shared memory is not allowed on this server: start it with --allow-client-shm "
                              "(DESPINA_ALLOW_CLIENT_SHM=1)")
    return shm.region(name, looked)


def check_count(name: str, shape: list[int], max_elements: int) -> None:
    count = element_count(shape)
    if count > max_elements:
        raise InvalidArgument(f"input '{name}': {count} elements is more than the limit of {max_elements} "
                              "(DESPINA_MAX_TENSOR_ELEMENTS)")


def _decode_outputs(raw: Any, spec: ModelSpec, shm: Registry | None
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
        params = _object(item.get("parameters"), f"outputs[{name}].parameters")
        as_binary = _flag(params, "binary_data", f"output '{name}'")
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
            in_shm[name] = _region(shm, region).output(name, offset, size)
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
HEADS_MAX = 64  # reply headers remembered per request header (BYTES outputs vary in size)


def encode_infer(model: str, version: int, req_id: str | None, outputs: tuple[Tensor, ...],
                 binary: set[str], binary_all: bool, heads: dict[tuple[Any, ...], bytes] | None = None,
                 parameters: Parameters = NO_PARAMETERS, shm: dict[str, ShmOutput] | None = None
                 ) -> tuple[bytes, int | None]:
    """Reply tensors (and the model's response parameters) -> (body, JSON header length or None when
    the body is all JSON). The outputs in `shm` are written into their shared memory instead.

    `heads` (Decoded.heads) remembers the JSON header of replies whose outputs are all binary or in
    shared memory: it depends only on the version that ran, the request's id and the outputs' names,
    shapes and sizes, the same for every reply of a shape; a reply with response parameters is encoded
    afresh. (A request plan's heads serve every version of its model and, for JSON, every id.)"""
    if parameters:
        heads = None
    if heads is not None:
        if len(outputs) == 1:  # the usual case, without a comprehension's function made and called
            t = outputs[0]
            key: tuple[Any, ...] = (version, req_id, (t.name, t.datatype, t.shape, len(t.data)))
        else:
            key = (version, req_id, *[(t.name, t.datatype, t.shape, len(t.data)) for t in outputs])
        header = heads.get(key)
        if header is not None:
            if not shm:
                if len(outputs) == 1:
                    return header + outputs[0].data, len(header)
                return b"".join([header, *[t.data for t in outputs]]), len(header)
            chunks = [t.data for t in outputs if t.name not in shm]
            for t in outputs:
                if t.name in shm:
                    shm[t.name].write(t.name, t.data)
            return (b"".join([header, *chunks]), len(header)) if chunks else (header, None)
    described: list[dict[str, Any]] = []
    chunks = []
    for t in outputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if shm and t.name in shm:  # its name, datatype and shape alone, as Triton answers it (tritonclient's
            shm[t.name].write(t.name, t.data)  # C++ client reads binary_data_size from any parameters)
        elif binary_all or t.name in binary:
            entry["parameters"] = {"binary_data_size": len(t.data)}
            chunks.append(t.data)
        else:
            entry["data"] = json_data(t)
        described.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if req_id is not None:
        doc["id"] = req_id
    if parameters:
        doc["parameters"] = parameters
    doc["outputs"] = described
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if header.find(b"null") >= 0:  # orjson writes a non-finite float as null: written again as Triton does
        again = False
        for entry in described:
            data = entry.get("data")
            if isinstance(data, np.ndarray) and (written := nonfinite_json(data, data)) is not data:
                entry["data"], again = written, True
        if again:  # (not for a "null" in a string)
            header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    no_json = len(chunks) + sum(1 for t in outputs if shm and t.name in shm) == len(outputs)
    if heads is not None and no_json and len(heads) < HEADS_MAX:
        heads[key] = header
    return (b"".join([header, *chunks]), len(header)) if chunks else (header, None)


def json_data(t: Tensor) -> Any:
    if t.datatype == "BYTES":
        return [b.decode("utf-8", "replace") for b in t.numpy().reshape(-1)]
    array = np.frombuffer(t.data, dtype=V2_TO_NUMPY[t.datatype])
    if t.datatype in ("FP16",):
        return array.astype(np.float32)
    return array
