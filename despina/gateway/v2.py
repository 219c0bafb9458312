"""KServe V2 / Open Inference Protocol bodies: JSON tensors and Triton's binary tensor extension.

Pure functions from bytes to records and back; no HTTP framework here.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from ..contract.datatypes import V2_TO_NUMPY, element_count
from ..contract.errors import InvalidArgument
from ..contract.modelspec import ModelSpec, check_inputs
from ..contract.records import Parameters, Tensor
from ..settings import Settings
from .http import json_object
from .jsondata import (
    CHUNK_BYTES,
    PACKED,
    Unvouched,
    data_holds_no_booleans,
    data_template,
    packed_span,
    skeleton,
)
from .shm import Registry, ShmOutput
from .v2_fields import (
    InShm,
    as_object,
    check_count,
    check_size,
    decode_input,
    decode_outputs,
    flag,
    model_parameters,
    shm_region,
)

MAX_ELEMENTS: int = Settings.max_tensor_elements  # per tensor, unless the caller passes its setting


@dataclass
class Decoded:
    id: str | None
    inputs: list[Tensor]
    outputs: list[str]                       # requested, in order; empty = all
    binary_outputs: set[str] = field(default_factory=set)
    binary_all: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)
    model_parameters: Parameters = field(default_factory=dict)  # but those in v2_fields.CONSUMED
    # the requests of one remembered header share this: their reply headers by the outputs' shapes
    heads: dict[tuple[Any, ...], bytes] | None = field(default=None, compare=False, repr=False)
    classes: dict[str, int] = field(default_factory=dict)  # output -> top classes asked (classification)
    shm_outputs: dict[str, ShmOutput] = field(default_factory=dict)  # outputs to write in shared memory


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
                                     shm_region(shm, region, looked).read(at, size, f"input '{t.name}'")))
                looked = True
            else:
                name, datatype, shape, size = t  # type: ignore[misc]
                inputs.append(Tensor(name, datatype, shape, body[offset:offset + size]))
                offset += size
        d = self.decoded  # its outputs, binary outputs and parameters are read, never changed
        outputs = {}
        for name, (region, size, at) in self.shm_outputs:
            outputs[name] = shm_region(shm, region, looked).output(name, at, size)
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
    if header_length == 0:  # Triton's raw binary request: no JSON at all
        return _raw(body, spec, max_elements)
    if header_length is None or header_length == len(body):  # all JSON (perf_analyzer says so)
        decoded = _json_planned(body, spec, max_elements, shm)
        if decoded is not None:
            return decoded
    if header_length is None:
        if shm is not None and len(body) <= PLAN_HEADER_MAX and body.find(b"shared_memory_") >= 0:
            return _planned(body, len(body), spec, max_elements, shm)  # all header: the data is elsewhere
        try:
            return _decode(body, memoryview(b""), spec, max_elements, shm)[0]
        except InvalidArgument as exc:
            if exc.message.startswith("malformed JSON") and b"binary_data_size" in body:
                raise InvalidArgument(f"{exc.message} (binary tensor data after the JSON needs the header "
                                      "Inference-Header-Content-Length: the JSON's length)") from None
            raise
    if header_length < 0:
        raise InvalidArgument(f"Inference-Header-Content-Length {header_length} is negative: it is the "
                              "length of the JSON header that starts the body")
    if header_length > len(body):
        raise InvalidArgument(f"Inference-Header-Content-Length {header_length} is past the end "
                              f"of the {len(body)}-byte body")
    if header_length > PLAN_HEADER_MAX:
        return _decode(body[:header_length], memoryview(body)[header_length:], spec, max_elements, shm)[0]
    return _planned(body, header_length, spec, max_elements, shm)


def _raw(body: bytes, spec: ModelSpec, max_elements: int) -> Decoded:
    """A raw binary request: the body is the data of the model's one input, of its datatype and shape (a
    batch of one; a variable dimension as the body's length makes it; a BYTES input one element), and every
    output is answered as binary data. Triton 2.51's rules and words."""
    if len(spec.inputs) != 1:
        raise InvalidArgument(f"Raw request must only have 1 input (found 1) to be deduced but got "
                              f"{len(spec.inputs)} inputs in '{spec.name}' model configuration")
    expected = spec.inputs[0]
    dims = list(expected.dims)
    if dims.count(-1) > 1:
        raise InvalidArgument(f"The shape of the raw input '{expected.name}' can not be deduced because "
                              "there are more than one variable-sized dimension")
    fixed = element_count([d for d in dims if d != -1])
    if expected.datatype == "BYTES":
        if dims.count(-1) or fixed != 1:
            raise InvalidArgument(f"For BYTE datatype raw input '{expected.name}', the model must have input "
                                  "shape [1]")
        data = struct.pack("<I", len(body)) + body
    else:
        if -1 in dims:
            dims[dims.index(-1)] = len(body) // V2_TO_NUMPY[expected.datatype].itemsize // max(fixed, 1)
        data = body
    shape = [1, *dims] if spec.batched else dims
    check_count(expected.name, shape, max_elements)
    check_size(expected.name, expected.datatype, shape, data)
    return Decoded(None, [Tensor(expected.name, expected.datatype, tuple(shape), data)], [], binary_all=True)


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
    params = as_object(doc.get("parameters"), "parameters")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument("field 'inputs' must be a non-empty list")
    offset = 0
    inputs: list[Tensor] = []
    sources: list[bool | InShm] = []
    seen: set[str] = set()
    booleans = not data_holds_no_booleans(header)
    for raw in raw_inputs:
        tensor, used = decode_input(raw, spec, binary[offset:], max_elements, booleans, shm)
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
    outputs, binary_outputs, classes, shm_outputs = decode_outputs(doc.get("outputs"), spec, shm)
    req_id = doc.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise InvalidArgument("field 'id' must be a string")
    # as Triton: binary_data_output is the kind of the outputs a request does not list (all of them when
    # it lists none); a listed one is binary when its own binary_data says so
    binary_all = flag(params, "binary_data_output", "the request's parameters") and not outputs
    return Decoded(req_id, inputs, outputs, binary_outputs, binary_all, params,
                   model_parameters(params, infer=True), classes=classes, shm_outputs=shm_outputs), sources
