"""Large tensors end to end: what a gateway, a worker and Redis keep of them once answered, and requests
and answers of more bytes than Redis takes in one value (its proto-max-bulk-len, lowered to 1 MB here)."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from onnx import TensorProto

from despina.contract.keys import GROUP, Keys
from despina.examples import build_identity

from .conftest import Server, module_server, start_server, stop_server
from .reliability_support import own_redis, role_pids

COLUMNS = 1024  # ident's rows: 4 KiB each
# what a role may hold more after large requests went: half of one (36-40 MB), so that one kept fails;
# a memory bound, not a speed: it is waited for (SETTLE_S) while the roles finish their part of the work
KEPT_MB = 18
SETTLE_S = 30.0
BLOWUP = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "in").as_numpy()
            times = int(pb_utils.get_input_tensor_by_name(r, "times").as_numpy()[0])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("out", np.tile(x, times))]))
        return out
"""


def repository(root: Path) -> Path:
    """ident: FP32 [-1, 1024] -> the same (ONNX, its memory arena off: what it allocates is freed after
    each run); blowup: FP32 [-1] and `times` -> the input repeated that many times (Python)."""
    build_identity(root / "ident" / "1" / "model.onnx", TensorProto.FLOAT, COLUMNS)
    (root / "ident" / "config.pbtxt").write_text(
        f'backend: "onnxruntime"\nmax_batch_size: 0\n'
        f'input [{{ name: "in", data_type: TYPE_FP32, dims: [-1, {COLUMNS}] }}]\n'
        f'output [{{ name: "out", data_type: TYPE_FP32, dims: [-1, {COLUMNS}] }}]\n'
        'parameters { key: "enable_mem_arena" value: { string_value: "0" } }\n')
    (root / "blowup" / "1").mkdir(parents=True)
    (root / "blowup" / "1" / "model.py").write_text(BLOWUP)
    (root / "blowup" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "in", data_type: TYPE_FP32, dims: [-1] }, '
        '{ name: "times", data_type: TYPE_INT32, dims: [1] }]\n'
        'output [{ name: "out", data_type: TYPE_FP32, dims: [-1] }]\n')
    return root


def binary(*inputs: tuple[str, np.ndarray, str]) -> tuple[bytes, dict[str, str]]:
    """A V2 body with binary tensors, and its headers; the outputs come back binary too."""
    header = json.dumps({
        "inputs": [{"name": n, "datatype": d, "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
                   for n, a, d in inputs],
        "parameters": {"binary_data_output": True}}).encode()
    return header + b"".join(a.tobytes() for _, a, _ in inputs), \
        {"inference-header-content-length": str(len(header)), "content-type": "application/octet-stream"}


def ident_body(rows: int) -> tuple[bytes, dict[str, str]]:
    return binary(("in", np.ones((rows, COLUMNS), np.float32), "FP32"))


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


@pytest.fixture(scope="module")
def small_bulk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A serve on a Redis of its own that takes at most 1 MB in one value (proto-max-bulk-len's least),
    and that Redis's URL."""
    tmp = tmp_path_factory.mktemp("bulk")
    with own_redis(tmp) as store:
        client = redis.Redis.from_url(store.url)
        client.config_set("proto-max-bulk-len", str(1 << 20))
        client.close()
        server = start_server(repository(tmp / "repo"), tmp, store.url, "despina",
                              env={"DESPINA_REQUEST_TIMEOUT_S": "15"}, wait_models=("ident", "blowup"))
        yield server, store.url
        stop_server(server)


def test_an_answer_over_what_redis_takes_is_refused_with_413_and_acknowledged(
        small_bulk: tuple[Server, str]) -> None:
    """Its XADD closed the worker's connection (a protocol error), with the acknowledgement: the request
    was run again at each visibility timeout until dead-lettered as if it had killed the worker, its client
    answered 504 (or 500, "the worker died each time it ran it") minutes later."""
    server, url = small_bulk
    x = np.ones(100_000, np.float32)  # 400 kB

    def blowup(times: int) -> httpx.Response:
        body, headers = binary(("in", x, "FP32"), ("times", np.array([times], np.int32), "INT32"))
        return httpx.post(f"{server.url}/v2/models/blowup/infer", content=body, headers=headers, timeout=30)

    r = blowup(10)
    assert r.status_code == 413, r.text
    assert "model 'blowup' answered with" in r.json()["error"] and "proto-max-bulk-len" in r.json()["error"]
    client = redis.Redis.from_url(url)
    assert client.xpending(Keys("despina").request_stream("blowup", 1), GROUP)["pending"] == 0
    client.close()
    r = blowup(2)
    assert r.status_code == 200 and len(r.content) > 2 * x.nbytes  # the worker answers on


async def test_requests_over_what_redis_takes_together_go_apart(small_bulk: tuple[Server, str]) -> None:
    """Requests that arrive together go in one stream entry: 12 of 400 kB made one over the limit, and the
    connection it closed failed them all with 503, each under the limit."""
    server, _ = small_bulk
    body, headers = ident_body(100)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=12)) as http:
        answers = await asyncio.gather(*[http.post(f"{server.url}/v2/models/ident/infer", content=body,
                                                   headers=headers) for _ in range(12)])
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers if a.status_code != 200]


async def test_a_request_over_what_redis_takes_is_refused_with_413_alone(small_bulk: tuple[Server, str]) -> None:
    """Refused before it is queued; the requests that went with it are answered."""
    server, _ = small_bulk
    url = f"{server.url}/v2/models/ident/infer"
    (big_body, big_headers), (body, headers) = ident_body(300), ident_body(2)  # 1.2 MB, 8 kB
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=5)) as http:
        big, *small = await asyncio.gather(http.post(url, content=big_body, headers=big_headers),
                                           *[http.post(url, content=body, headers=headers) for _ in range(4)])
    assert big.status_code == 413 and "proto-max-bulk-len" in big.json()["error"], big.text
    assert [a.status_code for a in small] == [200] * 4


@pytest.fixture(scope="module")
def ident_server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    yield from module_server(repository(tmp_path_factory.mktemp("ident")), tmp_path_factory, redis_url,
                             ("ident",))


def test_a_large_requests_memory_is_let_go_once_answered(ident_server: Server, redis_url: str) -> None:
    """What the gateway and the worker hold after answering 36 MB requests (each on a connection of its own,
    as curl sends them) is what they held before: the gateway kept every body until a garbage collection
    (which bytes do not bring about), the last replies read, and hiredis's buffer of them; the worker its
    last batch, its last read and hiredis's buffer. (36 MB: more than glibc's largest mmap threshold, so
    that what is freed leaves the process's memory at once.) Redis keeps none of the replies read: the
    reply stream was trimmed every 1000 replies or on a read that found none, which an idle gateway does
    not make, and kept up to 1000 large replies."""
    server = ident_server
    (gateway,), (worker,) = role_pids(server, "gateway"), role_pids(server, "worker")
    url = f"{server.url}/v2/models/ident/infer"
    small, big = ident_body(1), ident_body(9216)
    assert httpx.post(url, content=small[0], headers=small[1]).status_code == 200
    before = rss_mb(gateway), rss_mb(worker)
    for _ in range(4):
        r = httpx.post(url, content=big[0], headers=big[1], timeout=60)
        assert r.status_code == 200 and len(r.content) > len(big[0]) - 1000
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + SETTLE_S
    while True:  # let go, and trimmed, once the answer went (under load the gateway may not have run its
        # part after the last write yet when the client has read it all)
        after = rss_mb(gateway), rss_mb(worker)
        kept = sum(client.xlen(key) for key in client.scan_iter(f"{server.prefix}:rep:*"))
        if not kept and after[0] - before[0] < KEPT_MB and after[1] - before[1] < KEPT_MB \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    client.close()
    assert after[0] - before[0] < KEPT_MB, f"the gateway holds {after[0] - before[0]:.0f} MB more"
    assert after[1] - before[1] < KEPT_MB, f"the worker holds {after[1] - before[1]:.0f} MB more"
    assert kept == 0, f"the reply stream keeps {kept} replies read"


@pytest.mark.parametrize("model", ["ident", "iden%74"], ids=["hot", "asgi"])  # escaped: served through ASGI
def test_a_gateway_holds_a_large_request_at_most_three_times_over(ident_server: Server, model: str) -> None:
    """A 48 MB binary request and its answer: the body, the decoded tensor and its message to Redis at the
    most. Each was joined into the command and into the pipeline besides (two copies more), and the body
    and the decoded inputs stayed while the answer was awaited, and decoded (two more)."""
    (gateway,) = role_pids(ident_server, "gateway")
    url = f"{ident_server.url}/v2/models/{model}/infer"
    body, headers = ident_body(12288)
    assert httpx.post(url, content=body, headers=headers, timeout=60).status_code == 200
    Path(f"/proc/{gateway}/clear_refs").write_text("5")  # its peak (VmHWM) starts again from now
    before = rss_mb(gateway)
    assert httpx.post(url, content=body, headers=headers, timeout=60).status_code == 200
    status = Path(f"/proc/{gateway}/status").read_text()
    peak = int(status.split("VmHWM:")[1].split()[0]) / 1024 - before
    size = len(body) / 2**20
    assert peak < 3.5 * size, f"the gateway's peak: {peak:.0f} MB for a {size:.0f} MB request"


def test_a_gateway_parses_a_large_json_request_in_little_more_than_its_body(ident_server: Server) -> None:
    """A 4 MB tensor as 19 MB of JSON, at its first sight and once its document is remembered: the body
    (twice over as it is read) at the most. Its numbers parsed at once, as Python floats in a list and
    orjson's document of them, took 10 times the body, 50 times the tensor."""
    (gateway,) = role_pids(ident_server, "gateway")
    url = f"{ident_server.url}/v2/models/ident/infer"
    x = np.random.default_rng(0).random((1024, COLUMNS), dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "in", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.reshape(-1).tolist()}],
                       "outputs": [{"name": "out", "parameters": {"binary_data": True}}]}).encode()
    size = len(body) / 2**20
    for sight in ("first", "second", "remembered"):
        Path(f"/proc/{gateway}/clear_refs").write_text("5")
        before = rss_mb(gateway)
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.content[int(r.headers["inference-header-content-length"]):] == x.tobytes()
        status = Path(f"/proc/{gateway}/status").read_text()
        peak = int(status.split("VmHWM:")[1].split()[0]) / 1024 - before
        assert peak < 2.5 * size, f"the gateway's peak: {peak:.0f} MB for a {size:.0f} MB request ({sight} sight)"


def test_uploads_cut_short_leave_no_memory_behind(ident_server: Server) -> None:
    """Clients that go away with 40 MB of a body sent: the gateway kept each part-read body (its protocol and
    the request refer to each other) until a garbage collection, 200 MB for four."""
    (gateway,) = role_pids(ident_server, "gateway")
    host, port = ident_server.url.removeprefix("http://").split(":")
    before = rss_mb(gateway)
    for _ in range(4):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 50000000\r\n\r\n")
            for _ in range(40):
                s.sendall(b" " * 1_000_000)
            time.sleep(0.2)  # read by the gateway before the connection ends
    deadline = time.monotonic() + SETTLE_S
    while (kept := rss_mb(gateway) - before) >= KEPT_MB and time.monotonic() < deadline:
        time.sleep(0.1)  # the last disconnection seen
    assert kept < KEPT_MB, f"the gateway holds {kept:.0f} MB more"
