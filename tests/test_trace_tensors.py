"""Triton's trace level TENSORS on a real `despina serve`: each traced request's inputs as it queued them and
its outputs, in Triton 2.51's form (seen on its trace file: add_sub_python and an ensemble of two Python
steps), each an entry {"id", "activity", "tensor": {"name", "data", "shape", "dtype"}} of the trace; with
TENSORS alone, no timestamps entry."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from despina.contract.datatypes import serialize_bytes
from despina.contract.records import Tensor
from despina.gateway.trace import tensor_entry

from .conftest import Server, module_server
from .test_trace import ORDER, check_timestamps, traced

BODY = {"inputs": [{"name": "a", "shape": [1, 4], "datatype": "FP32", "data": [0.1, 2.5, -3e-7, 4e10]},
                   {"name": "b", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 123456.789]}]}
# as Triton 2.51 writes them (C++'s stream of a float: 6 significant digits)
TENSORS = [{"activity": "TENSOR_QUEUE_INPUT",
            "tensor": {"name": "a", "data": "0.1,2.5,-3e-07,4e+10", "shape": "1,4", "dtype": "FP32"}},
           {"activity": "TENSOR_QUEUE_INPUT",
            "tensor": {"name": "b", "data": "1,1,1,123457", "shape": "1,4", "dtype": "FP32"}},
           {"activity": "TENSOR_BACKEND_OUTPUT",
            "tensor": {"name": "sum", "data": "1.1,3.5,1,4.00001e+10", "shape": "1,4", "dtype": "FP32"}},
           {"activity": "TENSOR_BACKEND_OUTPUT",
            "tensor": {"name": "diff", "data": "-0.9,1.5,-1,3.99999e+10", "shape": "1,4", "dtype": "FP32"}}]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tensor_traces") / "trace.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, example_repository: Path,
           base: Path) -> Iterator[Server]:
    yield from module_server(example_repository, tmp_path_factory, redis_url, ("add_sub",),
                             env={"DESPINA_TRACE_FILE": str(base)})


@pytest.fixture
def client(server: Server, base: Path) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": "1000", "log_frequency": "0"})
    c.close()
    for path in base.parent.iterdir():
        path.unlink()


def infer(server: Server) -> None:
    response = httpx.post(f"{server.url}/v2/models/add_sub/infer", json=BODY, timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("levels", [["TENSORS"], ["TIMESTAMPS", "TENSORS"]])
def test_level_tensors_writes_the_inputs_and_outputs(server: Server, client: httpclient.InferenceServerClient,
                                                     base: Path, levels: list[str]) -> None:
    settings = client.update_trace_settings(settings={"trace_level": levels, "trace_rate": "1",
                                                      "log_frequency": "1"})
    assert settings["trace_level"] == levels
    infer(server)
    found = traced(base, len(TENSORS) + (levels[0] == "TIMESTAMPS"))
    ids = {entry["id"] for entry in found}
    assert len(ids) == 1
    tensors = [e for e in found if "activity" in e]
    assert [list(e) for e in tensors] == [["id", "activity", "tensor"]] * len(TENSORS)
    assert [{k: e[k] for k in ("activity", "tensor")} for e in tensors] == TENSORS
    heads = [e for e in found if "activity" not in e]
    if levels == ["TENSORS"]:
        assert heads == []  # as Triton's: no model_name entry, no timestamps
    else:
        assert len(heads) == 1 and heads[0]["model_name"] == "add_sub"
        check_timestamps(heads[0], ORDER)


def test_a_tensor_is_written_as_triton_writes_each_datatype() -> None:
    """As Triton 2.51 wrote them (a Python-backend model with INT32, BOOL, BYTES and FP64 inputs)."""
    def entry(name: str, datatype: str, a: np.ndarray) -> dict[str, str]:
        data = serialize_bytes(a) if datatype == "BYTES" else a.tobytes()
        return tensor_entry(Tensor(name, datatype, a.shape, data))

    assert entry("I", "INT32", np.array([1, -2, 300000], np.int32)) == \
        {"name": "I", "data": "1,-2,300000", "shape": "3", "dtype": "INT32"}
    assert entry("B", "BOOL", np.array([True, False]))["data"] == "1,0"
    assert entry("S", "BYTES", np.array([b"ab", b"c,d"], object))["data"] == '"ab","c,d"'
    assert entry("D", "FP64", np.array([0.123456789, 1e-300]))["data"] == "0.123457,1e-300"
