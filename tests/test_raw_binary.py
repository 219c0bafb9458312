"""Triton's raw binary request (binary tensor data extension): Inference-Header-Content-Length: 0 says
the whole body is the data of the model's one input, its datatype and shape the model's own (a batch of
one added, a variable dimension read from the body's length, a BYTES input one element), and every
output comes back as binary data. The rules and words are Triton 2.51's, diffed against it."""
from __future__ import annotations

import struct

import pytest

from despina.contract.errors import InvalidArgument
from despina.contract.modelconfig import normalize, parse_text, to_dict, validate
from despina.contract.modelspec import ModelSpec
from despina.gateway.v2 import decode_infer


def spec_of(datatype: str, dims: str, batch: int = 0, inputs: int = 1) -> ModelSpec:
    more = "".join(f', {{ name: "in{i}", data_type: TYPE_FP32, dims: [ 1 ] }}' for i in range(1, inputs))
    text = (f'name: "m"\nbackend: "python"\nmax_batch_size: {batch}\n'
            f'input [ {{ name: "inp", data_type: TYPE_{datatype}, dims: [ {dims} ] }}{more} ]\n'
            'output [ { name: "out", data_type: TYPE_FP32, dims: [ -1 ] } ]\n')
    config = normalize("m", parse_text("m", text))
    validate(config)
    return ModelSpec.from_config(to_dict(config))


X = struct.pack("<3f", 1.5, 2.0, -3.0)


@pytest.mark.parametrize("datatype, dims, batch, body, shape, data", [
    ("FP32", "3", 0, X, (3,), X),
    ("FP32", "3", 4, X, (1, 3), X),                     # a batch of one
    ("FP32", "-1", 0, X, (3,), X),                      # the variable dimension from the body's length
    ("FP32", "2, -1", 0, X + X, (2, 3), X + X),
    ("FP32", "-1", 0, b"", (0,), b""),
    ("STRING", "1", 0, b"hello", (1,), b"\x05\x00\x00\x00hello"),  # one element, its length put before it
    ("STRING", "1", 0, b"", (1,), b"\x00\x00\x00\x00"),
    ("STRING", "1", 0, b'{"inputs": []}', (1,), b'\x0e\x00\x00\x00{"inputs": []}'),  # not read as JSON
])
def test_the_body_is_the_one_inputs_data(datatype: str, dims: str, batch: int, body: bytes,
                                         shape: tuple[int, ...], data: bytes) -> None:
    decoded = decode_infer(body, 0, spec_of(datatype, dims, batch))
    [tensor] = decoded.inputs
    assert (tensor.name, tensor.datatype, tensor.shape, bytes(tensor.data)) == (
        "inp", "BYTES" if datatype == "STRING" else datatype, shape, data)
    assert decoded.binary_all and decoded.outputs == [] and decoded.id is None


@pytest.mark.parametrize("spec, body, words", [
    (spec_of("FP32", "3", 0, inputs=2), X, "Raw request must only have 1 input (found 1) to be deduced but "
                                           "got 2 inputs in 'm' model configuration"),
    (spec_of("FP32", "3"), X[:5], "input 'inp': 5 bytes of data do not match shape [3] of FP32 (12 bytes)"),
    (spec_of("FP32", "3"), X + X, "input 'inp': 24 bytes of data do not match shape [3] of FP32"),
    (spec_of("FP32", "-1"), X[:7], "input 'inp': 7 bytes of data do not match shape [1] of FP32 (4 bytes)"),
    (spec_of("FP32", "-1, -1"), X, "The shape of the raw input 'inp' can not be deduced because there are "
                                   "more than one variable-sized dimension"),
    (spec_of("STRING", "-1", 8), b"hi", "For BYTE datatype raw input 'inp', the model must have input "
                                        "shape [1]"),
    (spec_of("STRING", "2"), b"hi", "For BYTE datatype raw input 'inp', the model must have input shape [1]"),
])
def test_a_raw_request_the_model_cannot_take_is_refused_as_triton_refuses_it(spec: ModelSpec, body: bytes,
                                                                            words: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        decode_infer(body, 0, spec)
    assert words in caught.value.message


def test_binary_data_after_json_without_the_header_says_what_is_missing() -> None:
    """Triton 2.51: 400 "unexpected size for input 'x', expecting 12 additional bytes"; here the JSON
    error (the binary bytes are not JSON) says what the body lacks."""
    header = (b'{"inputs": [{"name": "inp", "shape": [3], "datatype": "FP32", '
              b'"parameters": {"binary_data_size": 12}}]}')
    for body in (header + X, header + b"\xff" * 12):
        with pytest.raises(InvalidArgument) as caught:
            decode_infer(body, None, spec_of("FP32", "3"))
        assert "malformed JSON" in caught.value.message
        assert "binary tensor data after the JSON needs the header Inference-Header-Content-Length" in \
            caught.value.message
