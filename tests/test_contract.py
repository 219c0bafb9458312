"""The shared contract: model config parsing, datatypes, the record codec (and fuzzing of decoders)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from despina.contract import records
from despina.contract.datatypes import deserialize_bytes, serialize_bytes, to_bytes, to_numpy
from despina.contract.errors import Code, ConfigError, InvalidArgument
from despina.contract.modelconfig import (
    check_model_name,
    normalize,
    parse_json,
    parse_text,
    to_dict,
    validate,
)
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.gateway.v2 import decode_infer

MLP = """
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
output [ { name: "y", data_type: TYPE_INT64, dims: [ 2 ] } ]
dynamic_batching { preferred_batch_size: [ 2, 4 ], max_queue_delay_microseconds: 100 }
"""


def spec_of(text: str, name: str = "mlp") -> ModelSpec:
    config = normalize(name, parse_text(name, text))
    validate(config)
    return ModelSpec.from_config(to_dict(config))


def test_config_parses_with_triton_schema_and_fills_defaults() -> None:
    spec = spec_of(MLP)
    assert spec.backend == "onnxruntime" and spec.platform == "onnxruntime_onnx"
    assert spec.inputs[0].dims == (-1, 4) and spec.outputs[0].datatype == "INT64"
    assert spec.policy.dynamic and spec.policy.preferred == (2, 4) and spec.policy.max_queue_delay_us == 100
    assert spec.config["version_policy"] == {"latest": {"num_versions": 1}}
    assert spec.metadata([1]) == {
        "name": "mlp", "versions": ["1"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 4]}],
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [-1, 2]}]}


def test_name_defaults_to_the_folder_and_json_round_trips() -> None:
    config = normalize("other", parse_text("other", 'backend: "onnxruntime"'))
    assert config.name == "other" and config.platform == "onnxruntime_onnx"
    again = parse_json("other", to_dict(config))
    assert again == config


@pytest.mark.parametrize("text,words", [
    ('name: "mlp"\nfoo: 1', 'has no field named "foo"'),
    ('name: "mlp"\ninput [{ data_type: TYPE_NOPE }]', "TYPE_NOPE"),
    ('name: "mlp" max_batch_size: "x"', "max_batch_size"),
])
def test_syntax_errors_name_the_model_and_field(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_text("mlp", text)
    assert "model 'mlp'" in str(err.value) and words in str(err.value)


@pytest.mark.parametrize("text,words", [
    ('platform: "caffe"', "field 'platform'"),
    ('name: "zzz" backend: "onnxruntime"', "field 'name'"),
    ("max_batch_size: 4", "neither field 'platform' nor field 'backend'"),
    ('backend: "onnxruntime" input [{ name: "x" data_type: TYPE_BF16 dims: [1] }]', "'data_type' TYPE_BF16"),
    ('backend: "onnxruntime" input [{ name: "x" data_type: TYPE_FP32 dims: [0] }]', "field 'dims'"),
    ('backend: "onnxruntime" max_batch_size: 4 dynamic_batching { preferred_batch_size: [8] }',
     "dynamic batching preferred size must be <= max batch size (field "
     "'dynamic_batching.preferred_batch_size' has 8, max_batch_size is 4)"),
    ('backend: "onnxruntime" max_batch_size: 4 dynamic_batching { preferred_batch_size: [0] }',
     "dynamic batching preferred size must be positive (field 'dynamic_batching.preferred_batch_size' has 0)"),
    ('backend: "onnxruntime" input [{ name: "x" data_type: TYPE_FP32 dims: [1] }, '
     '{ name: "x" data_type: TYPE_FP32 dims: [1] }]', "two inputs are named 'x'"),
    ('backend: "onnxruntime" input [{ name: "x" data_type: TYPE_FP32 dims: [2, 3] reshape { shape: [5] } }]',
     "different size for dims [2, 3] and reshape [5]"),
    ('backend: "onnxruntime" input [{ name: "x" data_type: TYPE_FP32 dims: [2, -1] reshape { shape: [-1, 2] } }]',
     "different size for dims [2, -1] and reshape [-1, 2]"),
    ('backend: "onnxruntime" output [{ name: "y" data_type: TYPE_FP32 dims: [-1, 4, 3] '
     'reshape { shape: [-1, 2, 3] } }]', "output 'y': has different size"),
    ('backend: "onnxruntime" max_batch_size: 4 dynamic_batching { priority_levels: 2 }',
     "default priority level must be in range [1, 2]"),
    ('backend: "onnxruntime" max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 1 '
     'priority_queue_policy { key: 3 value { max_queue_size: 1 } } }', "priority level in range [1, 2]"),
    ('backend: "onnxruntime" instance_group [{ name: "g" kind: KIND_CPU gpus: [0] }]',
     "instance group g has kind KIND_CPU but specifies one or more GPUs"),
])
def test_semantic_errors_name_the_model_and_field(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(normalize("mlp", parse_text("mlp", text)))
    assert "model 'mlp'" in str(err.value) and words in str(err.value)


def test_reshapes_triton_accepts_load() -> None:
    """Triton compares the element counts between the open sizes: these keep them (an empty reshape, a
    scalar, only where the model batches: a scalar per row)."""
    for dims, shape in (("[2, 4, -1, 6]", "[8, -1, 1, 6]"), ("[1]", "[]"), ("[-1, 6]", "[-1, 2, 3]")):
        spec = spec_of(f'backend: "onnxruntime" max_batch_size: 4 input [{{ name: "x" data_type: TYPE_FP32 dims: {dims} '
                       f'reshape {{ shape: {shape} }} }}]')
        assert spec.inputs[0].reshape == tuple(json.loads(shape))


@pytest.mark.parametrize("name", ["..", "../etc", "a/b", "/abs", "a\0b", "", "x" * 200, ".hidden", "a\n"])
def test_model_names_cannot_escape(name: str) -> None:
    with pytest.raises(InvalidArgument):
        check_model_name(name)


def test_bytes_tensors_use_tritons_length_prefixed_form() -> None:
    array = np.array([b"ab", b"", "é".encode()], dtype=np.object_)
    raw = serialize_bytes(array)
    assert raw[:6] == b"\x02\x00\x00\x00ab"
    assert list(deserialize_bytes(raw, 3)) == list(array)
    with pytest.raises(InvalidArgument, match="truncated"):
        deserialize_bytes(raw[:2])
    with pytest.raises(InvalidArgument, match="2 elements"):
        deserialize_bytes(serialize_bytes(array[:2]), 3)


def test_fixed_size_tensors_are_zero_copy_views_and_length_checked() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = to_bytes(x, "FP32")
    y = to_numpy("FP32", (2, 3), data)
    np.testing.assert_array_equal(x, y)
    assert not y.flags.owndata
    with pytest.raises(InvalidArgument, match="needs 24"):
        to_numpy("FP32", (2, 3), data[:-1])


def test_records_round_trip() -> None:
    t = Tensor("x", "FP32", (1, 2), b"\0" * 8)
    req = InferRequest("7", "rep", 12.5, (t,), ("y",), 1, 100, 11.0, "trace")
    assert records.decode_requests(records.encode([req])) == [req]
    rep = InferReply("7", (t,), (Code.BACKEND, "boom"), 3, 4)
    assert records.decode_replies(records.encode([rep])) == [rep]


@pytest.mark.parametrize("sequence", [None, (5, 1)])
def test_a_timed_request_and_its_replys_compute_split_round_trip(sequence: tuple[int, int] | None) -> None:
    """A traced request (or a gateway-run ensemble's step) asks for its compute's input, infer and output ns,
    which its reply carries (an ensemble's, its steps' times too); any other packs as before (9 elements, a
    reply 5)."""
    t = Tensor("x", "FP32", (1, 2), b"\0" * 8)
    req = InferRequest("7", "rep", 12.5, (t,), (), 0, 0, 11.0, "", sequence=sequence, timed=True)
    assert records.decode_requests(records.encode([req])) == [req]
    assert len(req.pack()) == 13 and len(InferRequest("7", "rep", 1.0, (t,)).pack()) == 9
    rep = InferReply("7", (t,), None, 3, 40, split=(1200, 30_000, 800))
    assert records.decode_replies(records.encode([rep])) == [rep]
    assert len(InferReply("7", (t,), None, 3, 40).pack()) == 5
    ensemble = InferReply("7", (t,), None, 3, 40, split=(1, 2, 3),
                          steps=(("mlp", 1, 10, 900, 5, 80, 100, 600, 50), ("post", 2, 950, 990, 1, 3, 0, 0, 0)))
    assert records.decode_replies(records.encode([ensemble])) == [ensemble]
    unsplit = InferReply("7", (t,), None, 3, 40, steps=ensemble.steps)  # steps, no split: it stays None
    assert records.decode_replies(records.encode([unsplit])) == [unsplit]
    with pytest.raises(InvalidArgument):
        InferReply.unpack([*ensemble.pack()[:8], [["mlp", 1, 10]]])
    bad = req.pack()
    bad[12] = 1
    with pytest.raises(InvalidArgument):
        InferRequest.unpack(bad)
    with pytest.raises(InvalidArgument):
        InferReply.unpack([*rep.pack()[:7], [1]])


def test_the_kept_packer_packs_as_msgpack_does_after_a_failure_and_a_large_message() -> None:
    import msgpack
    small = [b"id", "reply", 3, 2.5, [["y", "FP32", [1, 10], b"\1" * 40]], {"a": True}]
    assert records.packb(small) == msgpack.packb(small, use_bin_type=True)
    for bad in ([1, object()], [2**70]):  # a failed pack leaves nothing behind for the next one
        with pytest.raises((TypeError, OverflowError)):
            records.packb(bad)
        assert records.packb(small) == msgpack.packb(small, use_bin_type=True)
    kept = records._packer
    large = [b"\2" * (records.KEPT_BYTES + 1)]
    assert records.packb(large) == msgpack.packb(large, use_bin_type=True)
    assert records._packer is not kept  # its grown buffer let go
    assert records.packb(small) == msgpack.packb(small, use_bin_type=True)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_record_decoders_never_crash_on_arbitrary_bytes(data: bytes) -> None:
    for decode in (records.decode_requests, records.decode_replies):
        try:
            decode(data)
        except InvalidArgument:
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=-5, max_value=300) | st.none())
def test_v2_decoder_never_crashes_on_arbitrary_bytes(body: bytes, header_length: int | None) -> None:
    spec = spec_of(MLP)
    try:
        decode_infer(body, header_length, spec)
    except InvalidArgument:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=100), st.integers(min_value=0, max_value=10) | st.none())
def test_bytes_deserializer_never_crashes(data: bytes, count: int | None) -> None:
    try:
        deserialize_bytes(data, count)
    except InvalidArgument:
        pass


def test_reply_headers_remembered_per_request_header_match_fresh_ones() -> None:
    """encode_infer's remembered JSON headers (one dict per remembered request header) give the very
    body a fresh encoding gives, whatever the outputs' shapes and sizes (BYTES vary) from one reply to
    the next, and JSON outputs are never taken from it."""
    from despina.gateway.v2_reply import encode_infer

    def fp32(rows: int) -> Tensor:
        return Tensor("y", "FP32", (rows, 2), np.arange(rows * 2, dtype=np.float32).tobytes())

    def strings(*words: bytes) -> Tensor:
        return Tensor("s", "BYTES", (len(words),), serialize_bytes(np.array(words, dtype=np.object_)))

    heads: dict = {}
    replies = [(fp32(1), strings(b"a")), (fp32(3), strings(b"a")), (fp32(1), strings(b"abc", b"d")),
               (fp32(1), strings(b"a")), (fp32(3), strings(b"a"))]
    for binary, binary_all in (({"y", "s"}, False), (set(), True), ({"y"}, False)):
        for outputs in replies:
            fresh = encode_infer("m", 2, "id-1", outputs, binary, binary_all)
            assert encode_infer("m", 2, "id-1", outputs, binary, binary_all, heads) == fresh
        heads.clear()
    assert encode_infer("m", 2, None, replies[0], {"y"}, False, heads)[1] is not None
    assert heads == {}  # `s` went as JSON: nothing remembered
    # one request plan's heads serve every version of its model and, for JSON, every id: a header
    # remembered for one must not answer another (replies said the third request's id and version)
    outputs = (fp32(1),)
    for version, req_id in ((1, "a"), (1, "a"), (1, "b"), (2, "b"), (2, None), (1, None), (1, "a")):
        assert encode_infer("m", version, req_id, outputs, {"y"}, False, heads) == \
            encode_infer("m", version, req_id, outputs, {"y"}, False)


@pytest.mark.parametrize("data, words", [
    (b"\x09\x00\x00\x00abc", "input 'x': BYTES tensor element runs past the end of its data"),
    (b"\x03\x00\x00\x00abc\x03\x00\x00\x00def", "input 'x': BYTES tensor holds more than the 1 elements"),
])
def test_a_binary_bytes_input_that_does_not_frame_says_which_input(data: bytes, words: str) -> None:
    spec = spec_of(MLP.replace("TYPE_FP32, dims: [ -1, 4 ]", "TYPE_STRING, dims: [ 1 ]"))
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    with pytest.raises(InvalidArgument) as caught:
        decode_infer(header + data, len(header), spec)
    assert words in caught.value.message


def test_a_syntax_error_on_a_line_with_a_latin1_comment_is_named_as_the_syntax_error() -> None:
    """A Latin-1 comment is read (as Triton's parser skips a comment's bytes); a mistake on its line was
    blamed on the comment's byte ("config.pbtxt is not UTF-8 text"), sending the user to the one thing
    that was fine."""
    from despina.contract.errors import ConfigError
    from despina.contract.modelconfig import parse_text

    with pytest.raises(ConfigError, match='has no field named "max_batch_siz"'):
        parse_text("m", b'name: "m"\nmax_batch_siz: 4  # caf\xe9\n')
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(line 2, byte 30\)"):  # a value's byte still is
        parse_text("m", b'name: "m"\nmax_batch_size: "caf\xe9"  # caf\xe9\n')


def test_a_folder_is_unchanged_since_its_fingerprint_of_either_format() -> None:
    """The fingerprint took the version folders in (fd6ed19): a load API `config` override kept in the
    catalog with the older, files-only fingerprint was dropped at the first load after an upgrade, the
    files unchanged (Triton keeps it until they change)."""
    from despina.registry.base import FileInfo, ModelFiles, digest

    files = (FileInfo("1/model.onnx", 10, "e1"), FileInfo("config.pbtxt", 5, "e2"))
    model = ModelFiles("m", "/repo/m", files, ("1", "2"))
    assert model.unchanged_since(model.fingerprint())
    assert model.unchanged_since(digest([f.pack() for f in files]))  # an earlier Despina's
    assert not model.unchanged_since(digest([FileInfo("1/model.onnx", 11, "e3").pack()]))
