"""Large JSON tensors: a "data" array of more than CHUNK_BYTES is parsed a chunk at a time (its numbers'
Python objects, made all at once, took 50 times the tensor's memory), and decodes as the whole document
parsed at once would, value for value and error for error, for every datatype."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from despina.contract.datatypes import V2_TO_CONFIG, V2_TO_NUMPY
from despina.contract.errors import InvalidArgument
from despina.contract.modelconfig import normalize, parse_text, to_dict
from despina.contract.modelspec import ModelSpec
from despina.gateway import jsondata, v2
from despina.gateway.http import json_object
from despina.gateway.v2 import decode_infer


def spec_of(datatype: str, extra: str = "") -> ModelSpec:
    config = (f'name: "m" backend: "onnxruntime" max_batch_size: 0\n'
              f'input [{{ name: "x", data_type: {V2_TO_CONFIG[datatype]}, dims: [-1, -1] }}{extra}]\n'
              'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]')
    return ModelSpec.from_config(to_dict(normalize("m", parse_text("m", config))))


def values_of(datatype: str, count: int) -> np.ndarray:
    """`count` values of `datatype` across its range (every bit of an integer type; floats of every
    magnitude, as the numpy dtype holds them)."""
    rng = np.random.default_rng(7)
    dtype = V2_TO_NUMPY[datatype]
    if datatype == "BYTES":
        return np.array([str(i).encode() * (i % 4) for i in range(count)], dtype=np.object_)
    if datatype == "BOOL":
        return rng.random(count) < 0.5
    if dtype.kind in "iu":
        return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, count, dtype=dtype, endpoint=True)
    big = float(np.finfo(dtype).max)
    return np.clip(rng.standard_normal(count) * 10.0 ** rng.integers(-8, 8, count), -big, big).astype(dtype)


def outcome(decode: Any) -> Any:
    """A decode's inputs as (name, datatype, shape, bytes), or the message it was refused with."""
    try:
        decoded = decode()
    except InvalidArgument as exc:
        return exc.message
    return [(t.name, t.datatype, t.shape, bytes(t.data)) for t in decoded.inputs]


def whole(body: bytes, spec: ModelSpec) -> Any:
    """The document parsed at once, as before chunks."""
    return outcome(lambda: v2._decoded(json_object(body), body, memoryview(b""), spec, v2.MAX_ELEMENTS, None)[0])


@pytest.mark.parametrize("datatype", sorted(V2_TO_NUMPY))
def test_a_large_json_tensor_decodes_as_its_binary_form_at_every_sight(datatype: str) -> None:
    """First sight (the skeleton), second (the plan made) and later (the plan) of a tensor of ~1 MB or more of JSON:
    the bytes a binary request of it carries. (BOOL and BYTES go the long way, as before.)"""
    spec = spec_of(datatype)
    count = 200_000
    x = values_of(datatype, count).reshape(2, -1)
    data = [v.decode() for v in x.reshape(-1)] if datatype == "BYTES" else x.reshape(-1).tolist()
    body = orjson.dumps({"id": "a", "inputs": [{"name": "x", "datatype": datatype, "shape": [2, count // 2],
                                                "data": data}]})
    assert len(body) > jsondata.CHUNK_BYTES * 2
    header = orjson.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [2, count // 2],
                                       "parameters": {"binary_data_size": 0}}]})
    raw = jsondata.serialize_bytes(x) if datatype == "BYTES" else x.tobytes()
    header = header.replace(b'"binary_data_size":0', b'"binary_data_size":%d' % len(raw))
    (expected,) = outcome(lambda: decode_infer(header + raw, len(header), spec))
    for _ in range(3):
        assert outcome(lambda: decode_infer(body, None, spec)) == [expected]
    assert whole(body, spec) == [expected]


@pytest.mark.parametrize("array", [
    b"[1.5,,2.5,3.5]", b"[1.5,2.5,3.5,]", b"[,1.5,2.5,3.5]", b"[" + b" " * 40 + b",1.5,2.5,3.5]",
    b"[1.5,2.5,3.5" + b" " * 40 + b"]", b"[1.5, 2.5 ,3.5]", b"[1.5,2.5,null,3.5]", b"[1.5,2.5,1e39,3.5]",
    b"[1.5 2.5,3.5]", b"[1.5,2.5,3.5,4.5]", b"[1.5,2.5]", b"[[1.5,2.5,3.5]]", b"[1.5,2.5,true]"])
@pytest.mark.parametrize("datatype", ["FP32", "INT32"])
def test_a_malformed_or_odd_array_read_in_chunks_is_what_the_whole_document_makes_of_it(
        monkeypatch: pytest.MonkeyPatch, array: bytes, datatype: str) -> None:
    """Chunks of 4 bytes: each cut at a comma, each parsed alone; two commas, a comma at either end, spaces,
    a null, a number past FP32, a missing comma, a count off by one: decoded or refused as whole."""
    monkeypatch.setattr(jsondata, "CHUNK_BYTES", 4)
    monkeypatch.setattr(v2, "CHUNK_BYTES", 4)
    spec = spec_of(datatype)
    body = b'{"inputs": [{"name": "x", "datatype": "%b", "shape": [1, 3], "data": %b}]}' % (
        datatype.encode(), array)
    expected = whole(body, spec)
    for _ in range(3):
        assert outcome(lambda: decode_infer(body, None, spec)) == expected


numbers = (st.floats(width=32, allow_nan=False, allow_infinity=False) | st.integers(-300, 300)
           | st.sampled_from([1e39, -1e39, 2**63, 2**64, 1.5, -0.0, True, False, None, "1", float("nan"), []]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_document_read_in_chunks_decodes_as_the_whole_document_would(
        monkeypatch: pytest.MonkeyPatch, data: st.DataObject) -> None:
    """With chunks of a few bytes, every request is large: any numbers (of any kind, any count, flat, in one
    row or in rows), one or two inputs of any numeric datatype, a "data" member in the parameters, any
    spacing, at each sight, decode or are refused exactly as the whole document parsed at once."""
    monkeypatch.setattr(jsondata, "CHUNK_BYTES", data.draw(st.integers(1, 12)))
    monkeypatch.setattr(v2, "CHUNK_BYTES", 16)
    datatype = data.draw(st.sampled_from(sorted(jsondata.PACKED)))
    spec = spec_of(datatype, ', { name: "z", data_type: TYPE_INT64, dims: [-1], optional: true }')
    rows, width = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 4))
    inputs: list[dict[str, Any]] = [{"name": "x", "datatype": datatype, "shape": [rows, width]}]
    if data.draw(st.booleans()):
        inputs.insert(data.draw(st.integers(0, 1)), {"name": "z", "datatype": "INT64", "shape": [3]})
    doc: dict[str, Any] = {"inputs": inputs}
    if data.draw(st.booleans()):
        doc["parameters"] = {"data": data.draw(st.sampled_from([[1, 2], "x", 3]))}
    indent = data.draw(st.sampled_from([None, 0, 2]))
    for _ in range(3):
        for tensor in inputs:
            count = tensor["shape"][0] * (tensor["shape"][1] if len(tensor["shape"]) > 1 else 1)
            odd = data.draw(st.integers(0, 3)) == 0
            n = data.draw(st.sampled_from([count, max(0, count - 1), count + 1])) if odd else count
            kind = numbers if odd else st.integers(-100, 100) | st.floats(-1e3, 1e3, width=32)
            values = data.draw(st.lists(kind, min_size=n, max_size=n))
            nesting = data.draw(st.sampled_from(["flat", "flat", "one row", "rows"]))
            if nesting == "one row":
                values = [values]
            elif nesting == "rows" and width and len(values) % width == 0:
                values = [values[i:i + width] for i in range(0, len(values), width)]
            tensor["data"] = values
        body = json.dumps(doc, indent=indent).encode()
        assert outcome(lambda b=body: decode_infer(b, None, spec)) == whole(body, spec)
