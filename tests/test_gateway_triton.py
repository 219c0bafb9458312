"""The official tritonclient.http client against a real `despina serve` of the example repository."""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import numpy as np
import onnxruntime as ort
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina.examples import mlp_numpy
from despina.workers.backends import backend_class

from .conftest import Server, settled_stats
from .reliability_support import worker_paused


@pytest.fixture(scope="module")
def client(example_server: Server) -> httpclient.InferenceServerClient:
    c = httpclient.InferenceServerClient(example_server.url.removeprefix("http://"), concurrency=8)
    yield c
    c.close()


def ort_run(path: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_server_and_model_health(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("mlp", "7")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "despina" and "binary_tensor_data" in meta["extensions"]
    assert "model_configuration" in meta["extensions"]  # GET .../config, which Triton names so
    # Triton lists the sequence and schedule-policy extensions too, which Despina has
    assert {"sequence", "schedule_policy"} <= set(meta["extensions"])


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("mlp")
    assert meta["name"] == "mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}]
    config = client.get_model_config("mlp")
    assert config["max_batch_size"] == 128
    assert config["input"][0]["dims"] == [256]           # numbers, as Triton writes them
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500


def test_auto_complete_fills_inputs_and_outputs_from_the_onnx_file(
        client: httpclient.InferenceServerClient) -> None:
    config = client.get_model_config("add_sub")
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("a", "TYPE_FP32", [4]), ("b", "TYPE_FP32", [4])]
    assert [t["name"] for t in config["output"]] == ["sum", "diff"]
    assert config["backend"] == "onnxruntime"


def test_config_shows_what_triton_fills_in(client: httpclient.InferenceServerClient) -> None:
    add_sub = client.get_model_config("add_sub")  # its config.pbtxt names no instance_group
    assert add_sub["default_model_filename"] == "model.onnx"
    assert [(g["name"], g["count"]) for g in add_sub["instance_group"]] == [("add_sub", 1)]
    # KIND_AUTO as the worker that serves it resolved it, as Triton shows it: KIND_CPU where onnxruntime
    # sees no GPU, else KIND_GPU on every GPU
    gpus = backend_class("onnxruntime").gpu_count()
    assert (add_sub["instance_group"][0]["kind"], add_sub["instance_group"][0]["gpus"]) == (
        ("KIND_GPU", list(range(gpus))) if gpus else ("KIND_CPU", []))
    assert add_sub["optimization"]["input_pinned_memory"] == {"enable": True}
    assert add_sub["optimization"]["output_pinned_memory"] == {"enable": True}
    mlp = client.get_model_config("mlp")  # dynamic_batching with no preferred_batch_size
    assert mlp["dynamic_batching"]["preferred_batch_size"] == [128]
    assert [(g["name"], g["count"], g["kind"]) for g in mlp["instance_group"]] == [("mlp_0", 1, "KIND_CPU")]
    ensemble = client.get_model_config("mlp_classify")  # Triton gives an ensemble neither
    assert ensemble["instance_group"] == [] and "optimization" not in ensemble


@pytest.mark.parametrize("binary", [False, True])
def test_infer_matches_onnxruntime(client: httpclient.InferenceServerClient, example_server: Server,
                                   example_repository, binary: bool) -> None:
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    result = client.infer("mlp", [inp], outputs=[out], request_id="req-42")
    y = result.as_numpy("y")
    expected = ort_run(str(example_repository / "mlp" / "1" / "model.onnx"), {"x": x})[0]
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, mlp_numpy(x), rtol=1e-4, atol=1e-5)
    assert result.get_response()["id"] == "req-42"


@pytest.mark.parametrize("binary", [True, False])
def test_the_example_ensemble(client: httpclient.InferenceServerClient, binary: bool) -> None:
    """mlp_classify: the MLP, then its Python post-processing, as one model (also run against the
    embedded Valkey in CI)."""
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    wanted = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("probabilities", "label")]
    result = client.infer("mlp_classify", [inp], outputs=wanted, request_id="ens-1")
    logits = mlp_numpy(x)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(result.as_numpy("probabilities"), e / e.sum(axis=1, keepdims=True), atol=1e-5)
    assert result.as_numpy("label").ravel().tolist() == logits.argmax(axis=1).tolist()
    assert result.get_response()["id"] == "ens-1" and result.get_response()["model_name"] == "mlp_classify"


def test_requested_output_subset(client: httpclient.InferenceServerClient) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    inputs = [httpclient.InferInput("a", [2, 4], "FP32"), httpclient.InferInput("b", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    result = client.infer("add_sub", inputs, outputs=[httpclient.InferRequestedOutput("diff")])
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names == ["diff"]
    np.testing.assert_array_equal(result.as_numpy("diff"), a - b)
    both = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(both.as_numpy("sum"), a + b)


def test_an_unknown_model_is_refused_in_tritons_words(client: httpclient.InferenceServerClient) -> None:
    # Triton 2.51 answers 404 "Request for unknown model: 'nope' is not found" to each of these calls, as
    # Despina already did for a version it lacks ("... 'mlp' version 9 is not found")
    x = httpclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    calls = {"metadata": lambda: client.get_model_metadata("nope"),
             "config": lambda: client.get_model_config("nope"),
             "infer": lambda: client.infer("nope", [x]),
             "async_infer": lambda: client.async_infer("nope", [x]).get_result()}
    for what, call in calls.items():
        with pytest.raises(InferenceServerException) as raised:
            call()
        assert (raised.value.status(), raised.value.message()) == (
            "404", "Request for unknown model: 'nope' is not found"), what


def test_an_unknown_output_is_refused_in_tritons_words(client: httpclient.InferenceServerClient) -> None:
    # Triton 2.51: 400 "unexpected inference output 'NOPE' for model 'add_sub'", an ensemble's alike
    # (Despina's words add the outputs the model has)
    a = httpclient.InferInput("a", [1, 4], "FP32")
    a.set_data_from_numpy(np.ones((1, 4), np.float32))
    b = httpclient.InferInput("b", [1, 4], "FP32")
    b.set_data_from_numpy(np.ones((1, 4), np.float32))
    x = httpclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    for model, inputs in (("add_sub", [a, b]), ("mlp_classify", [x])):
        for binary in (True, False):
            with pytest.raises(InferenceServerException) as raised:
                client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput("NOPE", binary_data=binary)])
            assert raised.value.status() == "400"
            assert raised.value.message().startswith(f"unexpected inference output 'NOPE' for model '{model}' ("), \
                raised.value.message()


def test_binary_data_output_is_the_kind_of_the_outputs_a_request_does_not_list(example_server: Server) -> None:
    # as Triton: a listed output is binary when its own binary_data says so, whatever binary_data_output
    # says (an explicit false used to come back binary)
    body = {"inputs": [{"name": "a", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
                       {"name": "b", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}],
            "parameters": {"binary_data_output": True}}
    url = f"{example_server.url}/v2/models/add_sub/infer"
    listed = httpx.post(url, json={**body, "outputs": [{"name": "sum", "parameters": {"binary_data": False}},
                                                       {"name": "diff"}]}, timeout=10)
    assert listed.status_code == 200 and "inference-header-content-length" not in listed.headers
    assert {o["name"]: o["data"] for o in listed.json()["outputs"]} == {"sum": [2, 3, 4, 5], "diff": [0, 1, 2, 3]}
    one = httpx.post(url, json={**body, "outputs": [{"name": "sum"}, {"name": "diff",
                                                                      "parameters": {"binary_data": True}}]},
                     timeout=10)
    size = int(one.headers["inference-header-content-length"])
    outputs = orjson.loads(one.content[:size])["outputs"]
    assert outputs[0]["data"] == [2, 3, 4, 5] and outputs[1]["parameters"] == {"binary_data_size": 16}
    assert np.frombuffer(one.content[size:], np.float32).tolist() == [0, 1, 2, 3]
    twice = httpx.post(url, json={**body, "outputs": [{"name": "sum"}, {"name": "sum"}]}, timeout=10)
    assert [o["name"] for o in twice.json()["outputs"]] == ["sum"]  # as Triton: one per name
    unlisted = httpx.post(url, json=body, timeout=10)  # none listed: every output binary
    size = int(unlisted.headers["inference-header-content-length"])
    assert all("data" not in o for o in orjson.loads(unlisted.content[:size])["outputs"])


def test_each_reply_carries_its_own_requests_id(client: httpclient.InferenceServerClient) -> None:
    # JSON inputs with binary outputs, tritonclient's usual request: from the third sight of the
    # document the gateway decodes it by a plan and remembers its reply's header; a remembered header
    # once answered every later request with the id of the request it was made for
    rng = np.random.default_rng(7)
    for i in range(6):
        x = rng.standard_normal((1, 256)).astype(np.float32)
        inp = httpclient.InferInput("x", [1, 256], "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        for binary_input in (False, True):
            inp.set_data_from_numpy(x, binary_data=binary_input)
            result = client.infer("mlp", [inp], request_id=f"client-{i}-{binary_input}",
                                  outputs=[httpclient.InferRequestedOutput("y", binary_data=True)])
            assert result.get_response()["id"] == f"client-{i}-{binary_input}"
            np.testing.assert_allclose(result.as_numpy("y"), mlp_numpy(x), rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True])
def test_a_compressed_request_is_answered_as_the_same_request_uncompressed(
        client: httpclient.InferenceServerClient, algorithm: str, binary: bool) -> None:
    # tritonclient's request_compression_algorithm: Content-Encoding gzip or deflate, the binary tensors'
    # Inference-Header-Content-Length counting the body before compression; once read as plain (400)
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    plain = client.infer("mlp", [inp], outputs=[out], request_id="plain")
    for model_version in ("", "1"):
        packed = client.infer("mlp", [inp], model_version=model_version, outputs=[out], request_id="packed",
                              request_compression_algorithm=algorithm)
        np.testing.assert_array_equal(packed.as_numpy("y"), plain.as_numpy("y"))
        assert packed.get_response()["id"] == "packed"
    np.testing.assert_allclose(plain.as_numpy("y"), mlp_numpy(x), rtol=1e-4, atol=1e-5)

async def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(
        client: httpclient.InferenceServerClient, example_server: Server) -> None:
    before = client.get_inference_statistics("mlp")["model_stats"][0]
    rows = [np.full((1, 256), i / 100, dtype=np.float32) for i in range(64)]
    address = urlsplit(example_server.url)

    def request(x: np.ndarray) -> bytes:
        header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                           "parameters": {"binary_data_size": x.nbytes}}],
                               "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
        body = header + x.tobytes()
        return (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: %s\r\nInference-Header-Content-Length: %d\r\n"
                b"Content-Length: %d\r\n\r\n" % (address.netloc.encode(), len(header), len(body))) + body

    async def answer(reader: asyncio.StreamReader) -> np.ndarray:
        status, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines if line)
        body = await reader.readexactly(int(headers["content-length"]))
        assert status.split()[1] == "200", body
        offset = int(headers["inference-header-content-length"])
        return np.frombuffer(body[offset:], dtype=np.float32).reshape(1, 10)

    # every connection open, then every request written in one go, with the worker stopped meanwhile: the
    # burst waits in the stream and the worker finds it there together (on a host that answers each request
    # before the client writes the next, a burst would otherwise run one request at a time, as it should)
    connections = await asyncio.gather(*(asyncio.open_connection(address.hostname, address.port)
                                         for _ in rows))
    with worker_paused(example_server):
        for (_, writer), x in zip(connections, rows, strict=True):
            writer.write(request(x))
        await asyncio.sleep(0.3)  # the gateway queues them all
    results = await asyncio.gather(*(answer(reader) for reader, _ in connections))
    for _, writer in connections:
        writer.close()
    for x, y in zip(rows, results, strict=True):
        np.testing.assert_allclose(y, mlp_numpy(x), rtol=1e-4, atol=1e-5)
    after = settled_stats(example_server.url, "mlp")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64
    assert executions < 64, "concurrent requests should have been batched"
    assert max(b["batch_size"] for b in after["batch_stats"]) > 1


def test_a_raw_binary_request_is_the_one_inputs_data_and_answers_binary(example_server: Server) -> None:
    """Triton's raw binary request: Inference-Header-Content-Length 0, the body the data of mlp's one
    input (a batch of one), every output answered as binary data."""
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    r = httpx.post(f"{example_server.url}/v2/models/mlp/infer", content=x.tobytes(),
                   headers={"inference-header-content-length": "0"}, timeout=10)
    assert r.status_code == 200, r.text
    size = int(r.headers["inference-header-content-length"])
    assert orjson.loads(r.content[:size])["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [1, 10], "parameters": {"binary_data_size": 40}}]
    np.testing.assert_allclose(np.frombuffer(r.content[size:], np.float32), mlp_numpy(x)[0], rtol=1e-4,
                               atol=1e-5)
