"""Every V2 datatype round-trips through a real server, as JSON and as binary tensors."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto

from despina.examples import build_identity

from .conftest import Server, module_server

TYPES = {
    "BOOL": (TensorProto.BOOL, "TYPE_BOOL", np.bool_),
    "UINT8": (TensorProto.UINT8, "TYPE_UINT8", np.uint8),
    "UINT16": (TensorProto.UINT16, "TYPE_UINT16", np.uint16),
    "UINT32": (TensorProto.UINT32, "TYPE_UINT32", np.uint32),
    "UINT64": (TensorProto.UINT64, "TYPE_UINT64", np.uint64),
    "INT8": (TensorProto.INT8, "TYPE_INT8", np.int8),
    "INT16": (TensorProto.INT16, "TYPE_INT16", np.int16),
    "INT32": (TensorProto.INT32, "TYPE_INT32", np.int32),
    "INT64": (TensorProto.INT64, "TYPE_INT64", np.int64),
    "FP16": (TensorProto.FLOAT16, "TYPE_FP16", np.float16),
    "FP32": (TensorProto.FLOAT, "TYPE_FP32", np.float32),
    "FP64": (TensorProto.DOUBLE, "TYPE_FP64", np.float64),
    "BYTES": (TensorProto.STRING, "TYPE_STRING", np.object_),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("dtypes")
    for name, (onnx_type, config_type, _) in TYPES.items():
        model = repo / f"id_{name.lower()}"
        build_identity(model / "1" / "model.onnx", onnx_type)
        (model / "config.pbtxt").write_text(
            f'backend: "onnxruntime"\nmax_batch_size: 4\n'
            f'input [{{ name: "in", data_type: {config_type}, dims: [3] }}]\n'
            f'output [{{ name: "out", data_type: {config_type}, dims: [3] }}]\n')
    yield from module_server(repo, tmp_path_factory, redis_url, tuple(f"id_{n.lower()}" for n in TYPES))


def sample(datatype: str) -> np.ndarray:
    dtype = TYPES[datatype][2]
    if datatype == "BYTES":
        return np.array([[b"a", "é".encode(), b""], [b"xyz", b"12", b"q"]], dtype=np.object_)
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if datatype.startswith("FP"):
        return np.array([[0.5, -1.25, 3.0], [1e3, 0.0, -0.0]], dtype=dtype)
    info = np.iinfo(dtype)
    return np.array([[info.min, 0, info.max], [1, 2, 3]], dtype=dtype)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", list(TYPES))
def test_round_trip(server: Server, datatype: str, binary: bool) -> None:
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        x = sample(datatype)
        inp = httpclient.InferInput("in", list(x.shape), datatype)
        inp.set_data_from_numpy(x, binary_data=binary)
        out = httpclient.InferRequestedOutput("out", binary_data=binary)
        result = client.infer(f"id_{datatype.lower()}", [inp], outputs=[out])
        y = result.as_numpy("out")
        assert result.get_output("out")["datatype"] == datatype
        if datatype == "BYTES":
            assert [bytes(v) if not isinstance(v, str) else v.encode() for v in y.reshape(-1)] == list(
                x.reshape(-1))
        else:
            assert y.dtype == x.dtype
            np.testing.assert_array_equal(y, x)
    finally:
        client.close()


NONFINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_nan_and_infinities_round_trip_as_json_as_triton_writes_them(server: Server, datatype: str) -> None:
    """tritonclient writes a non-finite float as NaN / Infinity / -Infinity (Python's json), as Triton
    reads and writes them; the reply carries them back, not null."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        x = np.array([NONFINITE, [1.5, -0.0, 2.0]], dtype=TYPES[datatype][2])
        inp = httpclient.InferInput("in", list(x.shape), datatype)
        inp.set_data_from_numpy(x, binary_data=False)
        result = client.infer(f"id_{datatype.lower()}", [inp],
                              outputs=[httpclient.InferRequestedOutput("out", binary_data=False)])
        np.testing.assert_array_equal(result.as_numpy("out"), x)  # NaN equal to NaN here
    finally:
        client.close()


def test_nan_and_infinities_are_written_as_literals_on_every_json_path(server: Server) -> None:
    """The bodies themselves: V2 JSON, /fn and /generate write NaN, Infinity and -Infinity where a tensor
    holds them, and read them."""
    literal = b"[NaN,Infinity,-Infinity]"
    with httpx.Client(base_url=server.url, timeout=30) as http:
        v2 = http.post("/v2/models/id_fp32/infer", content=b'{"inputs":[{"name":"in","datatype":"FP32",'
                       b'"shape":[1,3],"data":' + literal + b"}]}")
        assert v2.status_code == 200, v2.text
        assert b'"data":' + literal in v2.content
        fn = http.post("/fn/id_fp64", content=literal)
        assert fn.status_code == 200, fn.text
        assert fn.content == b'{"out":' + literal + b"}"
        generate = http.post("/v2/models/id_fp32/generate", content=b'{"in":' + literal + b"}")
        assert generate.status_code == 200, generate.text
        assert b'"out":' + literal in generate.content
        for body in (b'{"inputs":[{"name":"in","datatype":"INT32","shape":[1,3],"data":[NaN,1,2]}]}',
                     b'{"inputs":[{"name":"in","datatype":"FP32","shape":[1,3],"data":[nan,1,2]}]}',
                     b'{"inputs":[{"name":"in","datatype":"FP32","shape":[1,3],"data":[NaN,1,2]}],'
                     b'"id":"\\ud800"}'):
            model = "id_int32" if b"INT32" in body else "id_fp32"
            refused = http.post(f"/v2/models/{model}/infer", content=body)
            assert refused.status_code == 400, refused.text


def test_bytes_that_are_not_utf8_are_refused_for_onnx_strings_alone(server: Server) -> None:
    # onnxruntime's string tensors hold text: a request with other bytes failed its whole batch with a 500
    # (its batch-mates too); the worker now refuses it alone, before batching
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"), concurrency=8)
    try:
        good = sample("BYTES")[:1]
        bad = np.array([[b"a", b"\xff\xfe", b""]], dtype=np.object_)
        pending = []
        for x in (bad, good, bad, good):
            inp = httpclient.InferInput("in", list(x.shape), "BYTES")
            inp.set_data_from_numpy(x)
            pending.append(client.async_infer("id_bytes", [inp]))
        for i, p in enumerate(pending):
            if i % 2:
                assert p.get_result().as_numpy("out").reshape(-1).tolist() == good.reshape(-1).tolist()
            else:
                with pytest.raises(httpclient.InferenceServerException, match="element 1 is not UTF-8") as e:
                    p.get_result()
                assert e.value.status() == "400"
    finally:
        client.close()
