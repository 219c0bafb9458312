"""A JSON body that starts with a UTF-8 byte order mark (as some Windows and .NET clients write it) is
read as Triton 2.51 reads it: the mark is skipped (RFC 8259 lets a parser ignore it), on /infer (all
JSON, large, or a binary request's header) and /generate alike."""
from __future__ import annotations

import struct

import orjson

from despina.contract.modelconfig import normalize, parse_text, to_dict
from despina.contract.modelspec import ModelSpec
from despina.gateway.generate import decode_generate
from despina.gateway.v2 import decode_infer

BOM = b"\xef\xbb\xbf"


def spec() -> ModelSpec:
    config = ('name: "m" backend: "onnxruntime" max_batch_size: 0\n'
              'input [{ name: "x", data_type: TYPE_FP32, dims: [-1] }]\n'
              'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]')
    return ModelSpec.from_config(to_dict(normalize("m", parse_text("m", config))))


def test_a_json_infer_body_after_a_bom_is_read() -> None:
    for count in (3, 300_000):  # small, and large enough to be read a chunk at a time
        body = BOM + orjson.dumps({"id": "b", "inputs": [{"name": "x", "shape": [count], "datatype": "FP32",
                                                          "data": [1.5] * count}]})
        decoded = decode_infer(body, None, spec())
        assert decoded.id == "b" and decoded.inputs[0].shape == (count,)
        assert bytes(decoded.inputs[0].data[:4]) == struct.pack("<f", 1.5)


def test_a_binary_requests_header_after_a_bom_is_read() -> None:
    header = BOM + orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                             "parameters": {"binary_data_size": 4}}]})
    for _ in range(3):  # as first seen, and as remembered
        decoded = decode_infer(header + struct.pack("<f", 2.0), len(header), spec())
        assert bytes(decoded.inputs[0].data) == struct.pack("<f", 2.0)


def test_a_generate_body_after_a_bom_is_read() -> None:
    inputs, parameters, _ = decode_generate(BOM + b'{"x": [1, 2], "n": 1, "n": 2}', spec())
    assert inputs[0].shape == (2,) and parameters == {"n": 1}
