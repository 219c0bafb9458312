"""A TorchScript model's TYPE_STRING input is a List[str], text: a request whose bytes there are not UTF-8
is refused alone (400, saying which element), before its batch runs, as onnxruntime's string inputs are;
the requests batched with it are answered."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import FULL_QUEUE_DELAY, Server, module_server
from .test_backend_pytorch import GREET, greet_model, write_config

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("torch-strings")
    greet_model(write_config(repo, "greet", GREET))
    yield from module_server(repo, tmp_path_factory, redis_url, ("greet",), env=FULL_QUEUE_DELAY)


def greeting(text: bytes) -> list[httpclient.InferInput]:
    names = httpclient.InferInput("INPUT__0", [1, 1], "BYTES")
    names.set_data_from_numpy(np.array([[text]], dtype=object))
    times = httpclient.InferInput("INPUT__1", [1, 1], "INT64")
    times.set_data_from_numpy(np.array([[2]], dtype=np.int64))
    return [names, times]


def test_bytes_that_are_not_text_fail_their_request_alone(server: Server) -> None:
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"), concurrency=2)
    try:
        bad = client.async_infer("greet", greeting(b"ab\xff"))  # sent together: one batch (full delay)
        good = client.async_infer("greet", greeting("é".encode()))
        assert good.get_result().as_numpy("OUTPUT__0").tolist() == [["é!é!".encode()]]
        with pytest.raises(InferenceServerException) as refused:
            bad.get_result()
        assert refused.value.status() == "400"
        assert "input 'INPUT__0': element 0 is not UTF-8 text" in refused.value.message()
    finally:
        client.close()
