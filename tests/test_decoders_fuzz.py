"""Property tests of every decoder a client's bytes reach: V2 JSON + binary tensors, BYTES framing,
function URLs, and the msgpack records on the streams. Whatever comes in, the answer is a decoded value
or InvalidArgument, never another exception; and nothing is unpickled or evaluated."""
from __future__ import annotations

import ast
import json
import pickle
import re
import struct
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from despina.contract import records
from despina.contract.datatypes import V2_TO_NUMPY, deserialize_bytes, serialize_bytes, to_numpy
from despina.contract.errors import InvalidArgument
from despina.contract.modelconfig import normalize, parse_text, to_dict, validate
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.gateway.fn import decode_fn, encode_fn, shape_of
from despina.gateway.jsondata import (
    PACKED,
    converted,
    data_holds_no_booleans,
    data_template,
    holds_no_booleans,
    json_data_to_bytes,
)
from despina.gateway.v2 import Decoded, decode_infer
from despina.gateway.v2_reply import encode_infer

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CONFIG = """
name: "%s"
platform: "onnxruntime_onnx"
max_batch_size: %d
input [
  { name: "x", data_type: TYPE_FP32, dims: [ -1, 3 ] },
  { name: "s", data_type: TYPE_STRING, dims: [ 2 ] },
  { name: "b", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "i", data_type: TYPE_INT64, dims: [ 2 ], optional: true }
]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 2 ] } ]
"""


def spec_of(name: str, max_batch_size: int) -> ModelSpec:
    config = normalize(name, parse_text(name, CONFIG % (name, max_batch_size)))
    validate(config)
    return ModelSpec.from_config(to_dict(config))


BATCHED = spec_of("batched", 4)
PLAIN = spec_of("plain", 0)
SPECS = st.sampled_from([BATCHED, PLAIN])

# ---- strategies ------------------------------------------------------------------------------------

int64s = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what orjson and msgpack carry
scalars = (st.none() | st.booleans() | int64s
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=30)
names = st.sampled_from(["x", "s", "b", "i", "y", "", "X"]) | st.text(max_size=4)
datatypes = st.sampled_from([*V2_TO_NUMPY, "BF16", "FP128", "", "fp32"]) | int64s | st.none()
dims = st.integers(min_value=-2, max_value=6) | st.sampled_from([True, 2**40, 2**63, 1.0, "3"])
shapes = st.lists(dims, max_size=4) | json_values
sizes = st.integers(min_value=-4, max_value=64) | st.sampled_from([2**62, True, 1.5, "8", None])


@st.composite
def infer_inputs(draw: st.DrawFn) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for key, strategy in (("name", names), ("datatype", datatypes), ("shape", shapes)):
        if draw(st.integers(0, 7)) != 7:  # now and then a field is missing
            raw[key] = draw(strategy)
    if draw(st.booleans()):
        wild = draw(st.integers(0, 7)) == 7
        raw["parameters"] = draw(json_values) if wild else {"binary_data_size": draw(sizes)}
    if draw(st.booleans()):
        raw["data"] = draw(json_values)
    return raw


EXPECTED = {"x": ("FP32", [-1, 3]), "s": ("BYTES", [2]), "b": ("BOOL", [1]), "i": ("INT64", [2])}
SIZES = {"FP32": 4, "BYTES": 5, "BOOL": 1, "INT64": 8}


@st.composite
def plausible_inputs(draw: st.DrawFn, batch: int | None, name: str | None = None) -> dict[str, Any]:
    """An input that gets past the first checks: a known name, its datatype, a shape of the right
    rank; its size or data is right or nearly."""
    name = name or draw(st.sampled_from(list(EXPECTED)))
    datatype, model_dims = EXPECTED[name]
    dims = [draw(st.integers(0, 3)) if d == -1 else d for d in model_dims]
    if draw(st.integers(0, 7)) == 7:  # a batch dimension too many, too few, or of another size
        batch = None if batch else draw(st.integers(1, 5))
    shape = dims if batch is None else [batch, *dims]
    count = int(np.prod(shape))
    raw: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
    if draw(st.booleans()):
        size = count * SIZES[datatype] + draw(st.sampled_from([0, 0, 0, -1, 1, 4]))
        raw["parameters"] = {"binary_data_size": max(size, 0)}
    else:
        element = {"FP32": st.floats(width=32) | int64s, "BYTES": st.text(max_size=4),
                   "BOOL": st.booleans(), "INT64": int64s}[datatype] | scalars
        raw["data"] = draw(st.lists(element, min_size=count, max_size=count + 1))
    return raw


@st.composite
def infer_bodies(draw: st.DrawFn, spec: ModelSpec) -> tuple[bytes, int | None]:
    """A JSON header of plausible, partly wrong structure, then a binary tail."""
    batch = draw(st.integers(1, 5)) if spec.batched else None
    chosen = ["x", "s", *draw(st.sets(st.sampled_from(["b", "i"])))]  # the required ones, some optional
    complete = st.permutations(chosen).flatmap(
        lambda order: st.tuples(*(plausible_inputs(batch, n) for n in order)).map(list))
    inputs = complete | st.lists(plausible_inputs(batch) | infer_inputs(), max_size=4)
    doc: dict[str, Any] = {"inputs": draw(json_values if draw(st.integers(0, 7)) == 7 else inputs)}
    if draw(st.booleans()):
        doc["outputs"] = draw(st.lists(st.fixed_dictionaries(
            {"name": names}, optional={"parameters": st.fixed_dictionaries(
                {}, optional={"binary_data": st.booleans() | json_values})}), max_size=3) | json_values)
    if draw(st.booleans()):
        doc["parameters"] = draw(st.dictionaries(st.sampled_from(
            ["binary_data_output", "priority", "timeout", "other"]), json_values, max_size=3))
    if draw(st.booleans()):
        doc["id"] = draw(json_values if draw(st.integers(0, 7)) == 7 else st.text(max_size=5))
    if draw(st.integers(0, 7)) == 7:
        doc = draw(json_values)
    header = orjson.dumps(doc)
    tail = draw(st.binary(max_size=96))
    sizes_claimed = [i.get("parameters", {}).get("binary_data_size") for i in doc.get("inputs", [])
              if isinstance(doc, dict) and isinstance(i, dict) and isinstance(i.get("parameters"), dict)] \
        if isinstance(doc, dict) and isinstance(doc.get("inputs"), list) else []
    if draw(st.booleans()):  # a tail of exactly the sizes claimed, so that the framing is reached
        tail = b"".join(draw(st.binary(min_size=n, max_size=n)) for n in sizes_claimed
                        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 256)
    mode = draw(st.sampled_from(["exact", "exact", "exact", "none", "off"]))
    if mode == "none":
        return header + (tail if draw(st.booleans()) else b""), None
    offset = draw(st.integers(min_value=-3, max_value=3)) if mode == "off" else 0
    return header + tail, len(header) + offset


@st.composite
def valid_binary_requests(draw: st.DrawFn) -> tuple[bytes, int, dict[str, np.ndarray]]:
    """A well-formed binary request for BATCHED, and the arrays it carries."""
    batch = draw(st.integers(1, 4))
    width = draw(st.integers(0, 3))
    x = np.asarray(draw(st.lists(st.floats(width=32, allow_nan=False), min_size=batch * width * 3,
                                 max_size=batch * width * 3)), np.float32).reshape(batch, width, 3)
    items = draw(st.lists(st.binary(max_size=12), min_size=batch * 2, max_size=batch * 2))
    s = np.empty(batch * 2, dtype=np.object_)
    s[:] = items
    s = s.reshape(batch, 2)
    arrays = {"x": x, "s": s}
    entries, tails = [], []
    for name, array, datatype in (("x", x, "FP32"), ("s", s, "BYTES")):
        data = array.tobytes() if datatype != "BYTES" else serialize_bytes(array)
        entries.append({"name": name, "datatype": datatype, "shape": list(array.shape),
                        "parameters": {"binary_data_size": len(data)}})
        tails.append(data)
    header = orjson.dumps({"inputs": entries})
    return header + b"".join(tails), len(header), arrays


def _decode_or_refuse(body: bytes, header_length: int | None, spec: ModelSpec) -> Decoded | None:
    try:
        decoded = decode_infer(body, header_length, spec, max_elements=1000)
    except InvalidArgument as exc:
        event(f"refused: {' '.join(str(exc).split()[:3])}")
        return None
    event("accepted")
    for t in decoded.inputs:  # what the gateway accepts, a worker can read
        assert to_numpy(t.datatype, t.shape, t.data).shape == t.shape
    return decoded


# ---- V2 bodies and BYTES framing -------------------------------------------------------------------

@FUZZ
@given(SPECS.flatmap(lambda spec: st.tuples(st.just(spec), infer_bodies(spec))))
def test_v2_decoder_never_crashes_on_structured_bodies(
        case: tuple[ModelSpec, tuple[bytes, int | None]]) -> None:
    spec, (body, header_length) = case
    _decode_or_refuse(body, header_length, spec)


@FUZZ
@given(valid_binary_requests())
def test_v2_binary_tensors_round_trip(request: tuple[bytes, int, dict[str, np.ndarray]]) -> None:
    body, header_length, arrays = request
    decoded = decode_infer(body, header_length, BATCHED)
    got = {t.name: t.numpy() for t in decoded.inputs}
    np.testing.assert_array_equal(got["x"], arrays["x"])
    assert got["s"].tolist() == arrays["s"].tolist()


@FUZZ
@given(valid_binary_requests(), st.data())
def test_v2_corrupted_binary_tails_are_refused_or_read_consistently(
        request: tuple[bytes, int, dict[str, np.ndarray]], data: st.DataObject) -> None:
    body, header_length, _ = request
    tail = bytearray(body[header_length:])
    if tail:  # flip, cut or extend the tail; the header still claims the original sizes
        action = data.draw(st.sampled_from(["flip", "cut", "extend"]))
        at = data.draw(st.integers(0, len(tail) - 1))
        if action == "flip":
            tail[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del tail[at:]
        else:
            tail[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    _decode_or_refuse(body[:header_length] + bytes(tail), header_length, BATCHED)


@FUZZ
@given(st.lists(st.binary(max_size=20), max_size=8), st.binary(max_size=6), st.integers(0, 10) | st.none())
def test_bytes_framing_round_trips_and_refuses_garbage(items: list[bytes], junk: bytes,
                                                       count: int | None) -> None:
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    wire = serialize_bytes(array)
    assert deserialize_bytes(wire, len(items)).tolist() == items
    for garbled in (wire + junk, wire[:-1] if wire else junk, junk):
        try:
            out = deserialize_bytes(garbled, count)
        except InvalidArgument:
            continue
        assert serialize_bytes(out) == bytes(garbled)  # accepted only when the framing is exact


def test_bytes_length_prefix_past_the_end_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="past the end"):
        deserialize_bytes(struct.pack("<I", 2**32 - 1) + b"abc", 1)


def test_element_limit_is_checked_before_allocation() -> None:
    header = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4, 2**40, 3],
                                       "parameters": {"binary_data_size": 0}}]})
    with pytest.raises(InvalidArgument, match="more than the limit of 1000"):
        decode_infer(header, len(header), BATCHED, max_elements=1000)
    with pytest.raises(InvalidArgument, match="more than the limit"):
        decode_fn(orjson.dumps({"x": [[[0.0] * 3] * 4] * 4}), BATCHED, max_elements=10)


NUMERIC = ModelSpec.from_config(to_dict(normalize("numeric", parse_text("numeric", """
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1, 3 ] },
        { name: "i", data_type: TYPE_INT64, dims: [ 2 ], optional: true } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 2 ] } ]
"""))))


def _outcome(decode: Any) -> Decoded | str:
    try:
        return decode()  # type: ignore[no-any-return]
    except InvalidArgument as exc:
        return f"refused: {exc}"


@FUZZ
@given(st.data())
def test_a_remembered_header_decodes_every_body_as_a_first_decode_would(data: st.DataObject) -> None:
    """decode_infer remembers what a binary request's header decided (clients resend the same one):
    a body that repeats the header with any tail decodes, or is refused, exactly as an uncached
    decode of it would."""
    from despina.gateway import v2

    rows, width = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 3))
    inputs: list[dict[str, Any]] = [{"name": "x", "datatype": "FP32", "shape": [rows, width, 3],
                                     "parameters": {"binary_data_size": rows * width * 12}}]
    tail_size = rows * width * 12
    if data.draw(st.booleans()):  # the optional input, as JSON data or binary, before or after x
        i = {"name": "i", "datatype": "INT64", "shape": [rows, 2]}
        if data.draw(st.booleans()):
            i["data"] = data.draw(st.lists(st.integers(-5, 5), min_size=rows * 2, max_size=rows * 2))
        else:
            i["parameters"] = {"binary_data_size": rows * 16}
            tail_size += rows * 16
        inputs.insert(data.draw(st.integers(0, 1)), i)
    doc: dict[str, Any] = {"inputs": inputs}
    if data.draw(st.booleans()):
        doc["outputs"] = [{"name": "y", "parameters": {"binary_data": data.draw(st.booleans())}}]
        doc["id"] = data.draw(st.text(max_size=4))
    header = orjson.dumps(doc)
    accepted = False
    for _ in range(3):
        size = data.draw(st.sampled_from([tail_size, tail_size, max(0, tail_size - 4), tail_size + 8]))
        body = header + data.draw(st.binary(min_size=size, max_size=size))
        cached = _outcome(lambda b=body: decode_infer(b, len(header), NUMERIC))
        first = _outcome(lambda b=body: v2._decode(header, memoryview(b)[len(header):], NUMERIC,
                                                   v2.MAX_ELEMENTS)[0])
        assert cached == first
        accepted = accepted or not isinstance(first, str)
    if accepted:  # the header is remembered, or noted for a plan on its next sight (one with no binary part,
        # as a JSON document's template)
        assert (any(k[2] == header for k in v2._plans) or any(k[-1] == header for k in v2._seen)
                or data_template(header, v2.PLAN_HEADER_MAX) is not None)
    assert all(not plan.decoded.inputs for plan in v2._plans.values())  # and no request's data


json_numbers = (st.floats(width=32, allow_nan=False, allow_infinity=False) | st.integers(-9, 9)
                | st.sampled_from([1e39, -1e39, 2**63, 2**64, 1.5, -0.0, True, False, None, "1", float("nan"),
                                   float("inf"), []]))


@FUZZ
@given(st.data())
def test_a_remembered_json_document_decodes_every_body_as_a_first_decode_would(data: st.DataObject) -> None:
    """decode_infer remembers what an all-JSON request decided but for its "data" arrays and its id
    (clients resend the same document with other numbers, often with an id of their own): a body that keeps
    the document and changes the numbers (any count, any JSON value among them, flat, in one row or in
    rows) and the id (any text, one in the parameters too), written compactly or spaced, escaped or not,
    with or without Inference-Header-Content-Length, decodes, or is refused, exactly as an uncached decode
    of it would."""
    from despina.gateway import v2

    rows, width = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 3))
    inputs: list[dict[str, Any]] = [{"name": "x", "datatype": "FP32", "shape": [rows, width, 3]}]
    counts = [rows * width * 3]
    if data.draw(st.booleans()):  # the optional input, before or after x
        inputs.insert(data.draw(st.integers(0, 1)), {"name": "i", "datatype": "INT64", "shape": [rows, 2]})
        counts.insert(inputs.index(next(i for i in inputs if i["name"] == "i")), rows * 2)
    doc: dict[str, Any] = {"inputs": inputs}
    if data.draw(st.booleans()):
        doc["outputs"] = [{"name": "y", "parameters": {"binary_data": data.draw(st.booleans())}}]
    ids = data.draw(st.sampled_from(["none", "same", "each", "nested"]))  # a client's own id each time, say
    if ids == "same":
        doc["id"] = data.draw(st.sampled_from(["", "data", "7"]))
    spaced, ascii_only = data.draw(st.booleans()), data.draw(st.booleans())
    decoded = 0
    for _ in range(4):
        if ids in ("each", "nested"):
            doc["id"] = data.draw(st.text(max_size=6) | st.sampled_from(['"id": "', "[1]", "data", ""]))
        if ids == "nested":
            doc["parameters"] = {"id": data.draw(st.text(max_size=3))}
        for tensor, count in zip(inputs, counts, strict=True):
            odd = data.draw(st.integers(0, 3)) == 0  # now and then a value of any kind, or another count
            n = data.draw(st.sampled_from([count, count, max(0, count - 1), count + 1])) if odd else count
            kind = json_numbers if odd else (st.floats(width=32, allow_nan=False, allow_infinity=False)
                                             if tensor["datatype"] == "FP32" else st.integers(-2**63, 2**63 - 1))
            values = data.draw(st.lists(kind, min_size=n, max_size=n))
            # flat, as perf_analyzer writes it; in one row, as numpy's tolist() writes a one-row batch (and
            # any count in it); or in rows of the shape's last dimension
            nesting = data.draw(st.sampled_from(["flat", "flat", "one row", "rows"]))
            if nesting == "one row":
                values = [values]
            elif nesting == "rows" and tensor["shape"][-1] and len(values) % tensor["shape"][-1] == 0:
                last = tensor["shape"][-1]
                values = [values[i:i + last] for i in range(0, len(values), last)]
            tensor["data"] = values
        body = json.dumps(doc, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=ascii_only
                          ).encode("utf-8", "surrogatepass")
        length = data.draw(st.sampled_from([None, len(body)]))
        cached = _outcome(lambda b=body, n=length: decode_infer(b, n, NUMERIC))
        first = _outcome(lambda b=body: v2._decode(b, memoryview(b""), NUMERIC, v2.MAX_ELEMENTS)[0])
        assert cached == first
        decoded += not isinstance(first, str)
    assert all(not plan.decoded.inputs for plan in v2._json_plans.values())  # no request's data is kept
    event(f"{decoded} of 4 decoded")


def test_a_json_document_is_planned_on_its_second_sight_and_never_when_each_one_differs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A template's first sight only notes it; its second makes the plan, which the third uses. Documents
    that differ each time beyond their numbers (a parameter of the client's own per request) make no plan
    at all, and every one decodes as an uncached decode would."""
    from despina.gateway import v2

    monkeypatch.setattr(v2, "_json_plans", {})
    monkeypatch.setattr(v2, "_seen", {})
    rng = np.random.default_rng(0)

    def body(numbers: np.ndarray, parameters: dict[str, Any] | None = None) -> bytes:
        doc: dict[str, Any] = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2, 3],
                                           "data": numbers.tolist()}]}
        if parameters is not None:
            doc["parameters"] = parameters
        return json.dumps(doc).encode()

    def uncached(b: bytes) -> Decoded:
        return v2._decode(b, memoryview(b""), NUMERIC, v2.MAX_ELEMENTS)[0]

    same = [body(rng.standard_normal(6).astype(np.float32)) for _ in range(3)]
    assert decode_infer(same[0], None, NUMERIC) == uncached(same[0])
    assert not v2._json_plans
    assert decode_infer(same[1], None, NUMERIC) == uncached(same[1])
    assert len(v2._json_plans) == 1
    (plan,) = v2._json_plans.values()
    found = data_template(same[2], v2.PLAN_HEADER_MAX)
    assert found is not None
    assert plan.apply(same[2], found[1], found[2]) == uncached(same[2])  # the plan itself, on new numbers
    assert decode_infer(same[2], None, NUMERIC) == uncached(same[2])

    for i in range(3 * v2.PLANS_MAX):
        each = body(rng.standard_normal(6).astype(np.float32), {"client_tag": f"t{i}"})
        assert decode_infer(each, None, NUMERIC) == uncached(each)
    assert len(v2._json_plans) == 1
    assert len(v2._seen) <= v2.PLANS_MAX


def test_a_one_row_batch_written_by_tolist_is_planned_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """`x.tolist()` of a one-row batch writes its "data" as `[[...]]`: such documents get a plan of their
    own (their template says `[[]]`, a flat one's `[]`), which parses the inner array; a batch of several
    rows takes the long way each time."""
    from despina.gateway import v2

    monkeypatch.setattr(v2, "_json_plans", {})
    monkeypatch.setattr(v2, "_seen", {})
    rng = np.random.default_rng(0)

    def body(rows: int) -> bytes:
        x = rng.standard_normal((rows, 6)).astype(np.float32)
        return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 2, 3],
                                       "data": x.tolist()}]}).encode()

    def uncached(b: bytes) -> Decoded:
        return v2._decode(b, memoryview(b""), NUMERIC, v2.MAX_ELEMENTS)[0]

    for b in [body(1) for _ in range(4)]:
        assert decode_infer(b, None, NUMERIC) == uncached(b)
    (key,) = v2._json_plans
    assert key[-1].endswith(b'"data": [[]]}]}')
    # what is emptied with the inner array is JSON's space alone: a vertical tab there is refused as the
    # long way refuses it, not read by the plan
    odd = body(1).replace(b"[[", b"[\x0b[")
    with pytest.raises(InvalidArgument):
        uncached(odd)
    with pytest.raises(InvalidArgument):
        decode_infer(odd, None, NUMERIC)
    for b in [body(2) for _ in range(3)]:
        assert data_template(b, v2.PLAN_HEADER_MAX) is None
        assert decode_infer(b, None, NUMERIC) == uncached(b)
    assert len(v2._json_plans) == 1


def test_a_binary_header_is_planned_on_its_second_sight_and_never_when_each_one_differs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for binary requests' headers: a client sending its own id with each request makes no plan
    (each header is new), one resending its header gets the plan from the second request on."""
    from despina.gateway import v2

    monkeypatch.setattr(v2, "_plans", {})
    monkeypatch.setattr(v2, "_seen", {})
    rng = np.random.default_rng(0)

    def body(request_id: str) -> tuple[bytes, int]:
        header = orjson.dumps({"id": request_id, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2, 3],
                                                             "parameters": {"binary_data_size": 24}}]})
        return header + rng.standard_normal(6).astype(np.float32).tobytes(), len(header)

    def uncached(b: bytes, n: int) -> Decoded:
        return v2._decode(b[:n], memoryview(b)[n:], NUMERIC, v2.MAX_ELEMENTS)[0]

    for i in range(3 * v2.PLANS_MAX):
        b, n = body(f"req-{i}")
        assert decode_infer(b, n, NUMERIC) == uncached(b, n)
    assert not v2._plans
    assert len(v2._seen) <= v2.PLANS_MAX
    for i in range(3):
        b, n = body("again")
        assert decode_infer(b, n, NUMERIC) == uncached(b, n)
        assert len(v2._plans) == (0 if i == 0 else 1)


# ---- function URLs ---------------------------------------------------------------------------------

fn_bodies = (json_values.map(orjson.dumps)
             | st.dictionaries(names, json_values, max_size=4).map(orjson.dumps)
             | st.binary(max_size=64))


nested = st.recursive(st.floats(allow_nan=False) | st.integers(-3, 3) | st.text(alphabet="[]x", max_size=2),
                      lambda inner: st.lists(inner, max_size=4), max_leaves=24)


def _shape_or_error(data: Any, brackets: int) -> list[int] | str:
    try:
        return shape_of("x", data, 4, brackets)
    except InvalidArgument as exc:
        return f"refused: {exc}"


@FUZZ
@given(nested)
def test_counting_brackets_finds_every_ragged_nesting_the_values_look_would(data: Any) -> None:
    """shape_of told how many "[" the document has (a string may hold some too) says what it says without
    being told: the shape, or that the lists are too deep, or ragged (where they are ragged in two ways,
    perhaps the other one: [[0.0], [[]], 0.0])."""
    counted, looked = _shape_or_error(data, orjson.dumps(data).count(b"[")), _shape_or_error(data, -1)
    if isinstance(looked, str) and "ragged" in looked:
        assert isinstance(counted, str) and "ragged" in counted
    else:
        assert counted == looked
    event("refused" if isinstance(counted, str) else "a shape")


def test_a_list_among_a_function_url_s_numbers_is_refused() -> None:
    for body, spec in ((b'{"x": [1.5, [2], 3]}', PLAIN), (b'{"x": [[1, 2, 3], [4, [5], 6]]}', PLAIN),
                       (b'{"x": [[[1, 2, 3]], [[4, 5, [6]]]]}', BATCHED)):
        with pytest.raises(InvalidArgument, match="ragged"):
            decode_fn(body, spec)


def _fn_decode_or_refuse(body: bytes, spec: ModelSpec) -> None:
    try:
        tensors, _ = decode_fn(body, spec, max_elements=1000)
    except InvalidArgument:
        return
    for t in tensors:
        assert to_numpy(t.datatype, t.shape, t.data).shape == t.shape


@FUZZ
@given(fn_bodies, SPECS)
def test_fn_decoder_never_crashes(body: bytes, spec: ModelSpec) -> None:
    _fn_decode_or_refuse(body, spec)


numbers = (int64s | st.integers(-300, 300) | st.floats(allow_nan=False, allow_infinity=False)
           | st.floats(-70000, 70000) | st.sampled_from([0.0, -0.0, 65504.0, 65520.0, 3.4e38, 2.0**53 + 1]))
tensor_data = st.recursive(numbers | scalars, lambda inner: st.lists(inner, max_size=5), max_leaves=24)


def _bytes_or_error(convert: Any) -> bytes | str:
    try:
        return convert()  # type: ignore[no-any-return]
    except InvalidArgument as exc:
        return f"refused: {exc}"


@st.composite
def shaped_data(draw: st.DrawFn) -> tuple[Any, list[int]]:
    """JSON data and a shape: mostly one that fits (flat, or nested in rows), now and then any."""
    if draw(st.integers(0, 3)) == 0:
        return draw(tensor_data), draw(st.lists(st.integers(0, 5), max_size=3))
    rows, width = draw(st.integers(1, 3)), draw(st.integers(0, 6))
    flat = draw(st.lists(numbers | (scalars if draw(st.integers(0, 4)) == 0 else numbers),
                         min_size=rows * width, max_size=rows * width))
    if draw(st.booleans()):
        return flat, [rows * width]
    return [flat[r * width:(r + 1) * width] for r in range(rows)], [rows, width]


@FUZZ
@given(st.sampled_from(sorted(PACKED)), shaped_data())
def test_json_numbers_packed_by_struct_are_what_numpy_makes_of_them(datatype: str,
                                                                     case: tuple[Any, list[int]]) -> None:
    """The quick conversion of JSON numbers (struct) gives the bytes numpy's gives, or its error, for
    any data; and the type check it skips when the document holds no booleans changes nothing then."""
    data, shape = case
    slow = _bytes_or_error(lambda: converted("x", datatype, shape, data))
    event("converted" if isinstance(slow, bytes) else "refused")
    assert _bytes_or_error(lambda: json_data_to_bytes("x", datatype, shape, data)) == slow
    if holds_no_booleans(orjson.dumps(data)):
        assert _bytes_or_error(lambda: json_data_to_bytes("x", datatype, shape, data, booleans=False)) == slow


@pytest.mark.parametrize("datatype", ["INT8", "INT32", "INT64", "UINT8", "UINT64"])
def test_a_fraction_for_an_integer_datatype_is_refused_not_cut(datatype: str) -> None:
    # numpy cut 2.7 to 2 and -0.5 to 0 and the request ran on them (Triton refuses a float there)
    for data in ([2.7, 1, 0], [[1, 2], [0.5, 3]], [float("nan"), 1, 2], [1e-9, 0, 0]):
        with pytest.raises(InvalidArgument, match=f"{datatype} data must be whole numbers, not"):
            json_data_to_bytes("x", datatype, [3] if len(data) == 3 else [2, 2], data)
    whole = json_data_to_bytes("x", datatype, [3], [2.0, 3, 0.0])  # nothing lost: taken as they are
    assert np.frombuffer(whole, V2_TO_NUMPY[datatype]).tolist() == [2, 3, 0]


def test_an_integer_below_int64s_range_is_refused_not_taken_as_its_minimum() -> None:
    """The JSON parser reads an integer past 64 bits as a float; below INT64's range that float is
    -2**63, and INT64's minimum ran where the client sent -9223372036854775809."""
    below = orjson.loads(b"[-9223372036854775809, 0, 0]")
    with pytest.raises(InvalidArgument, match=r"INT64 data past 2\*\*53 must be written as integers"):
        json_data_to_bytes("x", "INT64", [3], below)
    with pytest.raises(InvalidArgument, match=r"past 2\*\*53"):  # a float that lost digits on its way
        json_data_to_bytes("x", "INT64", [3], [9007199254740993.0, 0, 0])
    exact = json_data_to_bytes("x", "INT64", [3], orjson.loads(b"[-9223372036854775808, 0, -9007199254740991.0]"))
    assert np.frombuffer(exact, np.int64).tolist() == [-2**63, 0, -(2**53 - 1)]


def test_a_document_without_r_or_l_holds_no_booleans_or_nulls() -> None:
    assert holds_no_booleans(b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}')
    for literal in (b"true", b"false", b"null"):
        assert not holds_no_booleans(b'{"data": [1, ' + literal + b"]}")


def _data_values(value: Any) -> list[Any]:
    """Every value of a "data" member anywhere in a parsed document."""
    found = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            found += [v["data"]] if "data" in v else []
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return found


def _holds(value: Any, kind: type) -> bool:
    """Whether a parsed JSON value holds a `kind` anywhere (an object's keys are strings)."""
    if type(value) is kind or (kind is str and isinstance(value, dict) and value):
        return True
    if isinstance(value, dict):
        return any(_holds(v, kind) for v in value.values())
    return isinstance(value, list) and any(_holds(v, kind) for v in value)


v2_like = st.recursive(scalars | st.sampled_from(["data", "true", 'a"b', "t\\f"]),
                       lambda inner: st.lists(inner, max_size=6)
                       | st.dictionaries(st.sampled_from(["data", "name", "parameters", "x", "dat"]) | st.text(max_size=6),
                                         inner, max_size=4), max_leaves=30)


@FUZZ
@given(v2_like, st.sampled_from(["orjson", "json", "json-ascii", "json-spaced"]))
def test_data_holds_no_booleans_is_never_wrong(doc: Any, writer: str) -> None:
    """Whatever the document and however it is written (escapes, spaces): where the quick look says that
    no "data" value holds a boolean, none does, but for values that hold a string (or an object), which
    never pack as numbers; and the numbers packed with its help are those packed without."""
    if writer == "orjson":
        raw = orjson.dumps(doc)
    else:
        raw = json.dumps(doc, ensure_ascii=writer == "json-ascii",
                         separators=(" , ", " : ") if writer == "json-spaced" else None).encode()
    quick = data_holds_no_booleans(raw)
    values = _data_values(json.loads(raw))
    truth = not any(_holds(v, bool) and not _holds(v, str) for v in values)
    event(f"quick {quick}, truth {truth}")
    assert truth or not quick
    for value in values:
        shape = [len(value) if isinstance(value, list) else 1]
        for datatype in ("FP32", "INT64"):
            quick_way = partial(json_data_to_bytes, "x", datatype, shape, value, booleans=not quick)
            assert _bytes_or_error(quick_way) == _bytes_or_error(partial(json_data_to_bytes, "x", datatype,
                                                                         shape, value))


def test_data_holds_no_booleans_where_only_parameters_hold_them() -> None:
    """perf_analyzer's JSON body asks for its output with "binary_data": false: its 256 numbers need no
    type check; a boolean among them, or one the document hides from a plain reading, is still found."""
    numbers = b",".join(repr(v).encode() for v in np.linspace(-3, 3, 256).tolist())
    head = b'{"id":"","inputs":[{"name":"x","datatype":"FP32","shape":[1,256],"data":['
    tail = b']}],"outputs":[{"name":"y","parameters":{"binary_data":false}}]}'
    assert data_holds_no_booleans(head + numbers + tail)
    assert data_holds_no_booleans(head.replace(b'"data":[', b'"data" :\n [[') + numbers + b"]" + tail)
    for odd in (b"true", b"false", b"[true]"):
        assert not data_holds_no_booleans(head + numbers + b"," + odd + tail)
        assert not data_holds_no_booleans(head.replace(b'"data"', b'"d\\u0061ta"') + numbers + b"," + odd + tail)
    two = (b'{"inputs":[{"name":"data","datatype":"FP32","shape":[2],"data":[1,2]},'
           b'{"name":"b","datatype":"FP32","shape":[2],"data":[1,true]}],"parameters":{"flag":true}}')
    assert not data_holds_no_booleans(two)
    assert data_holds_no_booleans(two.replace(b"[1,true]", b"[1,2]"))


def test_a_boolean_among_json_numbers_is_refused_where_the_document_has_others() -> None:
    """The decoder's answer to a boolean in FP32 data, with and without the quick look's help."""
    for output in (b'"binary_data":false', b'"binary_data":true'):
        body = (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,1,3],"data":[1.5,true,2]},'
                b'{"name":"s","datatype":"BYTES","shape":[1,2],"data":["a","b"]}],'
                b'"outputs":[{"name":"y","parameters":{' + output + b"}}]}")
        with pytest.raises(InvalidArgument, match="FP32 data must be numbers"):
            decode_infer(body, None, BATCHED)
        fine = decode_infer(body.replace(b"true,", b"1,"), None, BATCHED)
        assert fine.inputs[0].data == struct.pack("<3f", 1.5, 1, 2)


@pytest.mark.parametrize("leaf", [b"1", b"NaN"])
@pytest.mark.parametrize("depth", [3, 200, 1000, 100_000])
def test_fn_deep_nesting_is_refused_without_recursion(depth: int, leaf: bytes) -> None:
    """Also where a NaN sends the document to the standard library's parser, which recurses."""
    body = b"[" * depth + leaf + b"]" * depth
    with pytest.raises(InvalidArgument):
        decode_fn(b'{"x": ' + body + b"}", BATCHED)
    with pytest.raises(InvalidArgument):
        decode_infer(b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 3], "data": ' + body
                     + b"}]}", None, BATCHED)


@pytest.mark.parametrize("datatype,data", [("BYTES", b""), ("FP32", b"")])
def test_fn_answer_of_no_elements_keeps_its_shape(datatype: str, data: bytes) -> None:
    """[2, 0] is two empty rows, whatever the datatype (a BYTES one came back as [])."""
    out = orjson.loads(encode_fn((Tensor("y", datatype, (2, 0), data),), False))
    assert out == {"y": [[], []]}


@pytest.mark.parametrize("datatype,value", [("INT8", 200), ("UINT8", -1), ("INT8", 200.0), ("INT64", 2**63),
                                            ("UINT64", 1e30), ("INT32", -(2**31) - 1)])
def test_a_number_out_of_its_datatypes_range_is_named(datatype: str, value: float) -> None:
    """Not numpy's words ("Python int too large to convert to C long", said of a float too)."""
    with pytest.raises(InvalidArgument, match=re.escape(f"input 'v': {value!r} is out of range for {datatype} (")):
        json_data_to_bytes("v", datatype, [2], [1, value])


# ---- NaN, Infinity and -Infinity: Triton reads them, tritonclient and Python's json write them --------

nonfinite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
nonfinite_values = st.recursive(scalars | nonfinite, lambda inner: st.lists(inner, max_size=6)
                                | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=30)


@st.composite
def nonfinite_infer_bodies(draw: st.DrawFn) -> bytes:
    """A V2 body as Python's json writes it, with NaN and infinities in the data or anywhere else."""
    rows = draw(st.integers(1, 3))
    data = draw(st.lists(st.floats(width=32) | nonfinite, min_size=rows * 3, max_size=rows * 3)
                | nonfinite_values)
    entry = {"name": draw(st.sampled_from(["x", "i", "b"]) | names), "shape": [rows, 1, 3], "data": data,
             "datatype": draw(st.sampled_from(["FP32", "INT64", "BOOL"]) | datatypes)}
    doc: Any = {"inputs": [entry], "parameters": draw(st.dictionaries(st.text(max_size=3), nonfinite_values,
                                                                      max_size=2))}
    if draw(st.integers(0, 5)) == 0:
        doc = draw(nonfinite_values)
    return json.dumps(doc).encode()


@FUZZ
@given(nonfinite_infer_bodies(), SPECS)
def test_documents_with_nan_and_infinities_are_read_or_refused(body: bytes, spec: ModelSpec) -> None:
    decoded = _decode_or_refuse(body, None, spec)
    doc = json.loads(body)
    if decoded is not None and decoded.inputs[0].datatype == "FP32":  # the values themselves, NaN included
        expected = np.asarray(doc["inputs"][0]["data"], np.float64).astype(np.float32).reshape(-1)
        np.testing.assert_array_equal(np.frombuffer(decoded.inputs[0].data, np.float32), expected)
    _fn_decode_or_refuse(body, spec)


@FUZZ
@given(st.lists(st.floats(width=32) | nonfinite, max_size=12), st.sampled_from(["FP16", "FP32", "FP64"]))
def test_replies_write_nan_and_infinities_as_literals(values: list[float], datatype: str) -> None:
    """What encode_infer writes, Python's json reads back as the same values; none becomes null."""
    with np.errstate(over="ignore"):  # past FP16's range is its infinity
        array = np.asarray(values, V2_TO_NUMPY[datatype])
    body, _ = encode_infer("m", 1, None, (Tensor("y", datatype, (len(values),), array.tobytes()),), set(), False)
    assert b"null" not in body
    data = json.loads(body)["outputs"][0]["data"]
    np.testing.assert_array_equal(np.asarray(data, np.float64).astype(array.dtype), array)


# ---- msgpack records -------------------------------------------------------------------------------

packable = st.recursive(
    st.none() | st.booleans() | int64s | st.floats()
    | st.text(max_size=6) | st.binary(max_size=8)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=20)


@st.composite
def tensor_slots(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 3)) != 3:
        return [draw(st.text(max_size=3) | packable),
                draw(st.sampled_from([*V2_TO_NUMPY, "X"]) | packable),
                draw(st.lists(st.integers(-2, 5), max_size=3) | packable),
                draw(st.binary(max_size=16) | packable)]
    return draw(packable)


@st.composite
def record_lists(draw: st.DrawFn) -> bytes:
    """Lists of records whose every slot is sometimes right, sometimes any msgpack value."""
    def slot(good: st.SearchStrategy[Any]) -> Any:
        return draw(packable if draw(st.integers(0, 3)) == 3 else good)
    tensors = st.lists(tensor_slots(), max_size=3)
    request = [slot(st.text(max_size=4)), slot(st.text(max_size=4)), slot(st.floats()), slot(tensors),
               slot(st.lists(st.text(max_size=3), max_size=2)), None, None, slot(st.floats()),
               slot(st.text(max_size=4))]
    error = (st.none() | st.lists(st.sampled_from(["INVALID_ARGUMENT", "BACKEND", "nope"]) | packable,
                                  max_size=3) | st.dictionaries(st.text(max_size=2), packable, min_size=1))
    number = int64s | st.floats()  # infinity and NaN where an integer belongs
    request[5:7] = [slot(number), slot(number)]
    reply = [slot(st.text(max_size=4)), slot(tensors), slot(error), slot(number), slot(number)]
    chosen = draw(st.sampled_from([request, reply]))
    record = chosen
    if draw(st.integers(0, 4)) == 4:  # now and then too few or too many fields
        cut = draw(st.integers(0, len(chosen) + 1))
        record = chosen[:cut] if cut <= len(chosen) else [*chosen, None]
    entry = draw(st.lists(st.just(record), min_size=1, max_size=2) | packable)
    return msgpack.packb(entry, use_bin_type=True)


@FUZZ
@given(record_lists())
def test_record_decoders_never_crash_on_structured_records(payload: bytes) -> None:
    for decode in (records.decode_requests, records.decode_replies):
        try:
            decode(payload)
        except InvalidArgument:
            pass


@FUZZ
@given(st.text(max_size=6), st.floats(allow_nan=False), st.lists(st.binary(max_size=12), max_size=3),
       st.integers(0, 2**31), st.sampled_from(list(records.Code)) | st.none())
def test_records_round_trip(rid: str, deadline: float, blobs: list[bytes], priority: int,
                            code: records.Code | None) -> None:
    tensors = tuple(Tensor(f"t{i}", "UINT8", (len(b),), b) for i, b in enumerate(blobs))
    req = InferRequest(rid, "rep", deadline, tensors, ("y",), priority, 5, 1.0, "trace")
    assert records.decode_requests(records.encode([req])) == [req]
    reply = InferReply(rid, tensors, (code, "message") if code else None, 3, 4)
    assert records.decode_replies(records.encode([reply])) == [reply]


def test_msgpack_maps_with_non_string_keys_and_ext_types_are_not_objects() -> None:
    with pytest.raises(InvalidArgument):
        records.decode_requests(msgpack.packb([{1: 2}]))
    payload = msgpack.packb([[msgpack.ExtType(1, b"x")] * 9], use_bin_type=True)
    try:
        decoded = records.decode_requests(payload)
    except InvalidArgument:
        return
    for req in decoded:  # an ext value can only end up as inert text
        assert isinstance(req.id, str) and isinstance(req.trace, str)


# ---- nothing is unpickled or evaluated -------------------------------------------------------------

class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (Path("/nonexistent-despina-dir/pwned").touch, ())


def test_pickles_are_data_not_code() -> None:
    payload = pickle.dumps(_Boom())
    for attempt in (lambda: decode_infer(payload, None, BATCHED), lambda: decode_fn(payload, BATCHED),
                    lambda: records.decode_requests(payload), lambda: records.decode_replies(payload)):
        with pytest.raises(InvalidArgument):  # touch() would raise FileNotFoundError if it ran
            attempt()
    # a BYTES tensor holding a pickled object array is read as bytes, never as objects
    t = Tensor("s", "BYTES", (1,), struct.pack("<I", len(payload)) + payload)
    assert t.numpy().tolist() == [payload]


FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "loads", "load", "unpackb", "Unpickler",
                   "frombuffer"}
UNSAFE_MODULES = {"pickle", "marshal", "shelve", "yaml", "dill", "cloudpickle", "joblib"}
# where a request's bytes go: gateway, contract, Redis's replies (resp.py) and the response cache, and every
# module of the worker's own (its stream reader, runner, batcher and what they hand requests to). The
# backends are left out: they load models from the trusted registry, and a Python model's process is the
# model's own code.
REQUEST_PATH = ["despina/gateway", "despina/contract", "despina/workers/*.py", "despina/resp",
                "despina/response_cache.py"]


def request_path_files(root: Path) -> list[Path]:
    return sorted(path for pattern in REQUEST_PATH for base in root.glob(pattern)
                  for path in ([base] if base.suffix == ".py" else base.rglob("*.py")))


def test_request_path_never_unpickles_or_evaluates() -> None:
    """The request path calls no eval/exec/pickle/yaml/np.load; msgpack only strictly."""
    root = Path(__file__).resolve().parents[1]
    files = request_path_files(root)
    # the modules a request's bytes surely reach are among those read (a module renamed or moved is noticed)
    assert {"streams.py", "intake.py", "batcher.py", "records.py", "v2.py", "v2_fields.py", "wire.py"} <= \
        {p.name for p in files}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not UNSAFE_MODULES & set(mods), path
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            if name not in FORBIDDEN_CALLS:
                continue
            where = f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}"
            if name in ("loads", "load", "Unpickler"):
                assert owner not in UNSAFE_MODULES and owner not in ("np", "numpy", "torch"), where
            elif name == "unpackb":
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                hooks = {"ext_hook", "object_hook", "object_pairs_hook", "list_hook"}
                assert kw.get("strict_map_key") == "True" and not hooks & set(kw), where
            elif name == "frombuffer":  # never with the object dtype (that would read pointers)
                assert "object" not in ast.unparse(node), where
            elif owner in ("", "builtins"):  # eval, exec, compile, __import__ (re.compile is fine)
                pytest.fail(f"{where}: {name} on the request path")
