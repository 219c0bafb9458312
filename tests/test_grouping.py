"""A gateway sends the plain requests of one tick for a batching model as one request (records.GROUPED):
how they are grouped and cut apart again, what goes alone, how they are counted, and, on a real `despina
serve`, a burst of requests of one and of two rows each answered with its own rows and counted once."""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import numpy as np
import orjson
import pytest

from despina.contract import records
from despina.contract.errors import Code, InvalidArgument
from despina.contract.keys import ENTRY_REQUESTS
from despina.contract.modelconfig import normalize, parse_text, to_dict, validate
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferReply, InferRequest, Tensor
from despina.examples import mlp_numpy
from despina.gateway.grouping import entries, group_rows, grouped, ungrouped
from despina.workers.stats import tally

from .conftest import Server, settled_stats
from .reliability_support import worker_paused


def request(rid: str, rows: int = 1, value: float = 0.0, **kw: object) -> InferRequest:
    data = np.full((rows, 3), value, np.float32).tobytes()
    return InferRequest(rid, "gw", 100.0 + len(rid), (Tensor("x", "FP32", (rows, 3), data),), **kw)  # type: ignore[arg-type]


def test_alike_requests_go_as_one_and_each_gets_its_rows_back() -> None:
    batch = [request("a", 1, 1.0), request("b", 2, 2.0), request("c", 1, 3.0)]
    (one,) = grouped(batch, 8)
    assert one.id == "*a:1,b:2,c:1" and records.members(one.id) == [("a", 1), ("b", 2), ("c", 1)]
    assert records.requests_in(one.id) == 3 and records.requests_in("a") == 1
    assert one.inputs[0].shape == (4, 3) and one.deadline == 101.0 and one.reply_to == "gw"
    x = np.frombuffer(one.inputs[0].data, np.float32).reshape(4, 3)
    assert x[:, 0].tolist() == [1.0, 2.0, 2.0, 3.0]
    # the model's answer for the four rows, cut into each request's
    y = (x * 10).astype(np.float32)
    replies = ungrouped(InferReply(one.id, (Tensor("y", "FP32", (4, 3), y.tobytes()),), None, 7, 9))
    assert [r.id for r in replies] == ["a", "b", "c"]
    assert [r.outputs[0].shape for r in replies] == [(1, 3), (2, 3), (1, 3)]
    assert np.frombuffer(replies[1].outputs[0].data, np.float32).tolist() == [20.0] * 6
    assert all(r.queue_us == 7 and r.compute_us == 9 and r.error is None for r in replies)
    # decoded from the wire as any request record is
    assert records.decode_requests(records.encode([one]))[0] == one


def test_timed_requests_go_as_one_and_each_gets_the_batchs_split() -> None:
    """An ensemble's steps that a gateway runs ask for their batch's compute split (InferRequest.timed, for
    the ensemble's statistics): they group as others do, and each gets the group's split back."""
    (one,) = grouped([request("a", timed=True), request("b", 2, timed=True), request("c")], 8)
    assert one.id == "*a:1,b:2,c:1" and one.timed
    assert records.decode_requests(records.encode([one]))[0] == one
    assert not grouped([request("a"), request("b")], 8)[0].timed
    y = np.zeros((4, 3), np.float32).tobytes()
    replies = ungrouped(InferReply(one.id, (Tensor("y", "FP32", (4, 3), y),), None, 7, 9, split=(1, 8, 2)))
    assert [r.split for r in replies] == [(1, 8, 2)] * 3
    assert all(r.split is None for r in ungrouped(InferReply(one.id, (Tensor("y", "FP32", (4, 3), y),))))


def test_each_output_is_cut_by_rows() -> None:
    rid = records.grouped_id([("a", 2), ("b", 1)])
    y = np.arange(6, dtype=np.float32).reshape(3, 2)
    z = np.arange(3, dtype=np.int64).reshape(3, 1)
    a, b = ungrouped(InferReply(rid, (Tensor("y", "FP32", (3, 2), y.tobytes()), Tensor("z", "INT64", (3, 1), z.tobytes()))))
    assert [t.shape for t in a.outputs] == [(2, 2), (2, 1)] and [t.shape for t in b.outputs] == [(1, 2), (1, 1)]
    assert np.frombuffer(b.outputs[0].data, np.float32).tolist() == [4.0, 5.0]
    assert np.frombuffer(a.outputs[1].data, np.int64).tolist() == [0, 1]


def test_what_goes_alone_and_where_a_group_ends() -> None:
    alone = [request("p", parameters={"k": 1}), request("t", trace="req-1"), request("q", priority=1),
             request("o", timeout_us=5), request("i", request_id="client"), request("s", sequence=(1, 1)),
             InferRequest("w", "gw", 1.0, (Tensor("x", "BYTES", (1, 1), b"\x01\x00\x00\x00a"),))]
    assert [r.id for r in grouped(alone, 8)] == [r.id for r in alone]
    other_outputs = request("d", outputs=("y",))
    wide = InferRequest("e", "gw", 1.0, (Tensor("x", "FP32", (1, 4), bytes(16)),))
    batch = [request("a"), request("b"), other_outputs, request("c"), wide, request("f")]
    assert [r.id for r in grouped(batch, 8)] == ["*a:1,b:1", "d", "c", "e", "f"]  # runs of alike ones
    assert [r.id for r in grouped([request("a", 3), request("b", 3), request("c", 3)], 7)] == ["*a:3,b:3", "c"]
    many = grouped([request(f"{i:x}") for i in range(ENTRY_REQUESTS + 3)], 128)
    assert [records.requests_in(r.id) for r in many] == [ENTRY_REQUESTS, 3]
    # stream entries hold at most ENTRY_REQUESTS requests, a grouped one counted as all it holds
    mixed = [request("z"), *many]
    assert [[records.requests_in(r.id) for r in e] for e in entries(mixed)] == [[1], [ENTRY_REQUESTS], [3]]
    assert [len(e) for e in entries([request("y"), request("z"), many[1]])] == [3]


def test_an_error_answers_each_and_so_does_a_bad_batch_dimension() -> None:
    rid = records.grouped_id([("a", 1), ("b", 2)])
    failed = ungrouped(InferReply(rid, (), (Code.DEADLINE_EXCEEDED, "too late")))
    assert [(r.id, r.error) for r in failed] == [("a", (Code.DEADLINE_EXCEEDED, "too late")),
                                                  ("b", (Code.DEADLINE_EXCEEDED, "too late"))]
    scalar = ungrouped(InferReply(rid, (Tensor("y", "FP32", (2,), bytes(8)),)))
    assert {r.error[0] for r in scalar if r.error} == {Code.BACKEND} and len(scalar) == 2
    assert "batch dimension 2 for a batch of 3" in scalar[0].error[1]  # type: ignore[index]
    assert ungrouped(InferReply("*a:x")) == ()  # malformed: dropped, logged
    with pytest.raises(InvalidArgument):
        records.members("*a")


def test_the_statistics_count_each_request_of_a_group() -> None:
    replies = [InferReply(records.grouped_id([("a", 1), ("b", 1), ("c", 2)]), (), None, 100, 50),
               InferReply("d", (), None, 100, 50), InferReply("*e:1,f:1", (), (Code.BACKEND, "x"))]
    counts = tally(replies, rows=7, started=1.0)
    assert counts["success_count"] == 4 and counts["queue_count"] == 4 and counts["fail_count"] == 2
    assert counts["success_ns"] == 4 * 150_000 and counts["inference_count"] == 7
    assert counts["compute_infer_count"] == 4


def spec_of(text: str) -> ModelSpec:
    config = normalize("m", parse_text("m", text))
    validate(config)
    return ModelSpec.from_config(to_dict(config))


IO = 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ] output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]'


def test_which_models_get_grouped_requests() -> None:
    onnx = 'name: "m" backend: "onnxruntime" max_batch_size: 32 ' + IO
    assert group_rows(spec_of(onnx + " dynamic_batching { }")) == 32
    assert group_rows(spec_of(onnx + " dynamic_batching { preferred_batch_size: [ 4, 8 ] }")) == 8
    assert group_rows(spec_of(onnx)) == 0  # no dynamic batching: each request runs alone
    assert group_rows(spec_of(onnx.replace("onnxruntime", "python") + " dynamic_batching { }")) == 0
    assert group_rows(spec_of(onnx + ' dynamic_batching { } response_cache { enable: true }')) == 0
    text = onnx.replace('output [ { name: "y" data_type: TYPE_FP32', 'output [ { name: "y" data_type: TYPE_STRING')
    assert group_rows(spec_of(text + " dynamic_batching { }")) == 0


async def test_a_burst_is_answered_each_with_its_rows_and_counted_once(example_server: Server) -> None:
    """The worker stopped while the burst is written: the gateway queues it in a few writes, its requests
    grouped; each gets its own rows back, and the statistics count requests, not groups."""
    before = settled_stats(example_server.url, "mlp")
    sizes = [1, 2] * 12
    rows = [np.random.default_rng(i).standard_normal((n, 256)).astype(np.float32) for i, n in enumerate(sizes)]
    address = urlsplit(example_server.url)

    def http(x: np.ndarray) -> bytes:
        header = orjson.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                           "parameters": {"binary_data_size": x.nbytes}}],
                               "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
        body = header + x.tobytes()
        return (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: h\r\nInference-Header-Content-Length: %d\r\n"
                b"Content-Length: %d\r\n\r\n" % (len(header), len(body))) + body

    async def answer(reader: asyncio.StreamReader) -> np.ndarray:
        status, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines if line)
        body = await reader.readexactly(int(headers["content-length"]))
        assert status.split()[1] == "200", body
        head = orjson.loads(body[:int(headers["inference-header-content-length"])])
        shape = head["outputs"][0]["shape"]
        return np.frombuffer(body[int(headers["inference-header-content-length"]):], np.float32).reshape(shape)

    connections = await asyncio.gather(*(asyncio.open_connection(address.hostname, address.port) for _ in rows))
    with worker_paused(example_server):
        for (_, writer), x in zip(connections, rows, strict=True):
            writer.write(http(x))
        await asyncio.sleep(0.3)
    results = await asyncio.gather(*(answer(reader) for reader, _ in connections))
    for _, writer in connections:
        writer.close()
    for x, y in zip(rows, results, strict=True):
        assert y.shape == (x.shape[0], 10)
        np.testing.assert_allclose(y, mlp_numpy(x), rtol=1e-4, atol=1e-5)
    after = settled_stats(example_server.url, "mlp")
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == len(rows)
    assert after["inference_count"] - before["inference_count"] == sum(sizes)
    assert after["execution_count"] - before["execution_count"] < len(rows)
