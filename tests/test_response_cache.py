"""Triton's response cache on a real `despina serve` with DESPINA_RESPONSE_CACHE_BYTES: a model with
response_cache { enable: true } answers a repeated request without running, counts hits and misses as
Triton does, keeps nothing that failed, and answers from its new files after a reload; and the cache
itself (response_cache.py), its key and its bound."""
from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from despina.contract.errors import ConfigError
from despina.contract.modelconfig import normalize, parse_text, validate
from despina.contract.records import InferReply, Tensor
from despina.response_cache import ENTRY_BYTES, ResponseCache, cache_key

from .conftest import Server, module_server, settled_stats

# y = x * FACTOR; calls = how many requests this process has run so far (a cached answer repeats it);
# a negative x fails the request
COUNTER = '''
import numpy as np
import triton_python_backend_utils as pb_utils

FACTOR = 2.0
calls = 0


class TritonPythonModel:
    def execute(self, requests):
        global calls
        responses = []
        for request in requests:
            calls += 1
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative x")))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("y", (x * FACTOR).astype(np.float32)),
                pb_utils.Tensor("calls", np.full((x.shape[0], 1), calls, dtype=np.int64))]))
        return responses
'''

CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [
  {{ name: "y", data_type: TYPE_FP32, dims: [ 2 ] }},
  {{ name: "calls", data_type: TYPE_INT64, dims: [ 1 ] }}
]
{extra}
'''

CACHED = "response_cache { enable: true }"

# an ensemble of one step, the cached model, itself without the cache: the worker that runs it asks
# that model from its own process
CHAIN = '''
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [
  { name: "y", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "calls", data_type: TYPE_INT64, dims: [ 1 ] }
]
ensemble_scheduling { step [ {
  model_name: "cached" model_version: -1
  input_map { key: "x" value: "x" }
  output_map [ { key: "y" value: "y" }, { key: "calls" value: "calls" } ]
} ] }
'''

# two steps at once: the cached model and one without the cache (a hit on the first answers at once,
# while the second is still to be queued)
PAIR = '''
name: "pair"
platform: "ensemble"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [
  { name: "y_cached", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "y_plain", data_type: TYPE_FP32, dims: [ 2 ] }
]
ensemble_scheduling { step [
  { model_name: "cached" model_version: -1
    input_map { key: "x" value: "x" } output_map { key: "y" value: "y_cached" } },
  { model_name: "plain" model_version: -1
    input_map { key: "x" value: "x" } output_map { key: "y" value: "y_plain" } }
] }
'''


def write_model(root: Path, name: str, extra: str, source: str = COUNTER) -> None:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(source)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache-repo")
    write_model(root, "cached", CACHED)
    write_model(root, "reloaded", CACHED)
    write_model(root, "plain", "")
    (root / "chain").mkdir()
    (root / "chain" / "config.pbtxt").write_text(CHAIN)
    (root / "pair").mkdir()
    (root / "pair" / "config.pbtxt").write_text(PAIR)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    yield from module_server(repo, tmp_path_factory, redis_url, ("cached", "reloaded", "plain", "chain", "pair"),
                             env={"DESPINA_RESPONSE_CACHE_BYTES": str(1 << 20),
                                  "DESPINA_MODEL_CONTROL_MODE": "explicit", "DESPINA_LOAD_MODEL": "*"})


def infer(server: Server, model: str, x: list[float], **extra: object) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": x}], **extra}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)


def answer(r: httpx.Response) -> dict[str, list]:
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"] for o in r.json()["outputs"]}


def test_a_repeated_request_is_answered_without_running_the_model(server: Server) -> None:
    before = settled_stats(server.url, "cached")
    first = answer(infer(server, "cached", [1.0, 2.0]))
    again = answer(infer(server, "cached", [1.0, 2.0]))
    assert first["y"] == [2.0, 4.0] and again == first  # the same calls: the model did not run again
    stats = settled_stats(server.url, "cached")
    counts = {k: stats["inference_stats"][k]["count"] - before["inference_stats"][k]["count"]
              for k in ("success", "cache_hit", "cache_miss", "queue")}
    assert counts == {"success": 2, "cache_hit": 1, "cache_miss": 1, "queue": 2}
    assert stats["inference_count"] - before["inference_count"] == 1  # hits are not inferences (Triton)
    assert stats["execution_count"] - before["execution_count"] == 1
    assert stats["inference_stats"]["cache_hit"]["ns"] > before["inference_stats"]["cache_hit"]["ns"]


def test_what_differs_in_inputs_outputs_or_parameters_runs_again(server: Server) -> None:
    calls = answer(infer(server, "cached", [3.0, 4.0]))["calls"]
    assert answer(infer(server, "cached", [3.0, 4.0]))["calls"] == calls
    assert answer(infer(server, "cached", [3.0, 4.5]))["calls"] != calls
    only_y = answer(infer(server, "cached", [3.0, 4.0], outputs=[{"name": "y"}]))
    assert list(only_y) == ["y"]  # not the cached answer with both outputs
    ran = answer(infer(server, "cached", [3.0, 4.0], parameters={"mode": "other"}))["calls"]
    assert ran != calls  # a Python model may read its parameters: they are part of the key


def test_binary_and_json_requests_share_an_answer(server: Server) -> None:
    """A binary request asking for `calls` alone is another key than all outputs (it runs); asked
    again, binary or JSON, it is answered from the cache."""
    calls = answer(infer(server, "cached", [5.0, 6.0]))["calls"]
    header = (b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}],'
              b'"outputs":[{"name":"calls","parameters":{"binary_data":true}}]}')
    r = httpx.post(f"{server.url}/v2/models/cached/infer", content=header + struct.pack("<2f", 5.0, 6.0),
                   headers={"Inference-Header-Content-Length": str(len(header))}, timeout=30)
    assert r.status_code == 200, r.text
    length = int(r.headers["inference-header-content-length"])
    # only `calls` asked for: another key, so it ran; asked again it is cached
    ran = struct.unpack("<q", r.content[length:])[0]
    assert ran != calls[0]
    again = httpx.post(f"{server.url}/v2/models/cached/infer", content=header + struct.pack("<2f", 5.0, 6.0),
                       headers={"Inference-Header-Content-Length": str(len(header))}, timeout=30)
    assert struct.unpack("<q", again.content[length:])[0] == ran
    as_json = answer(infer(server, "cached", [5.0, 6.0], outputs=[{"name": "calls"}]))
    assert as_json["calls"] == [ran]  # the JSON form of the same cached answer


def test_a_model_without_response_cache_runs_every_time(server: Server) -> None:
    first = answer(infer(server, "plain", [1.0, 2.0]))["calls"]
    assert answer(infer(server, "plain", [1.0, 2.0]))["calls"] != first
    assert settled_stats(server.url, "plain")["inference_stats"]["cache_miss"]["count"] == 0


def test_a_failed_request_is_not_kept(server: Server) -> None:
    """Both reach the model and fail (a batch whose every request failed counts no execution, as in
    Triton: its failures are what show it ran); a kept failure would be a second hit instead."""
    before = settled_stats(server.url, "cached")["inference_stats"]
    for _ in range(2):
        r = infer(server, "cached", [-1.0, 2.0])
        assert r.status_code == 500 and "negative x" in r.json()["error"]
    after = settled_stats(server.url, "cached")["inference_stats"]
    assert after["fail"]["count"] - before["fail"]["count"] == 2
    assert after["cache_hit"]["count"] == before["cache_hit"]["count"]


def test_parameters_count_toward_the_bound(serve: Callable[..., Server], repo: Path) -> None:
    """A request's parameters are part of its key: a string parameter larger than the whole cache keeps
    the answer out, as outputs that large would (it used to be kept, weighed as a few hundred bytes)."""
    server = serve(repo, wait_models=("cached",), env={"DESPINA_RESPONSE_CACHE_BYTES": str(64 << 10)})
    large = {"prompt": "p" * (100 << 10)}
    first = answer(infer(server, "cached", [15.0, 16.0], parameters=large))["calls"]
    assert answer(infer(server, "cached", [15.0, 16.0], parameters=large))["calls"] != first


def test_function_urls_and_generate_use_the_cache_too(server: Server) -> None:
    first = httpx.post(f"{server.url}/fn/cached", json={"x": [7.0, 8.0]}, timeout=30).json()
    assert httpx.post(f"{server.url}/fn/cached", json={"x": [7.0, 8.0]}, timeout=30).json() == first
    gen = httpx.post(f"{server.url}/v2/models/cached/generate", json={"x": [7.0, 8.0]}, timeout=30).json()
    assert gen["calls"] == first["calls"][0]  # the same inputs, shaped the same: the same answer


def test_an_ensemble_step_run_by_the_worker_is_answered_from_the_worker_s_cache(server: Server) -> None:
    before = settled_stats(server.url, "cached")
    first = answer(infer(server, "chain", [11.0, 12.0]))
    again = answer(infer(server, "chain", [11.0, 12.0]))
    assert first["y"] == [22.0, 24.0] and again == first  # the step ran once
    stats = settled_stats(server.url, "cached")
    assert stats["execution_count"] - before["execution_count"] == 1
    assert stats["inference_stats"]["cache_hit"]["count"] - before["inference_stats"]["cache_hit"]["count"] == 1
    chain = settled_stats(server.url, "chain")
    assert chain["inference_stats"]["cache_hit"]["count"] == 0  # the ensemble itself has no cache: it ran
    assert chain["inference_stats"]["success"]["count"] >= 2


def test_a_cached_step_beside_a_step_that_runs_answers_the_ensemble(server: Server) -> None:
    """The cached step's hit comes back at once, while the run is still starting the steps beside it:
    the step that runs is started once, and the ensemble answers (it used to start it twice: a 500)."""
    for _ in range(3):
        assert answer(infer(server, "pair", [13.0, 14.0]))["y_cached"] == [26.0, 28.0]


def test_the_metrics_count_hits_and_misses(server: Server) -> None:
    answer(infer(server, "cached", [9.0, 9.0]))
    answer(infer(server, "cached", [9.0, 9.0]))
    labels = '{model="cached",version="1"}'
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(server.metrics_url, timeout=10).text
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line and not line.startswith("#")}
        if values.get(f"nv_cache_num_hits_per_model{labels}", 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert values[f"nv_cache_num_hits_per_model{labels}"] >= 1
    assert values[f"nv_cache_num_misses_per_model{labels}"] >= 1
    assert f"nv_cache_hit_duration_per_model{labels}" in values
    # as Triton 2.51, which shows the per-model cache families for the versions whose config enables
    # the cache only: a model without it has no series there (it used to show zeros)
    assert not [k for k in values if k.startswith("nv_cache_") and 'model="plain"' in k]


def test_each_processs_cache_figures_reach_the_metrics(server: Server) -> None:
    """The gateway's cache (its report, every few seconds) and the worker's (the chain ensemble's step, in
    its heartbeat): entries, bytes, the bound and evictions, by process."""
    answer(infer(server, "cached", [8.0, 8.0]))
    answer(infer(server, "chain", [8.5, 8.5]))
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(server.metrics_url, timeout=10).text
        entries = {line.split('process="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line.startswith("despina_response_cache_entries{")}
        gateway = [v for p, v in entries.items() if p.startswith("gateway:")]
        worker = [v for p, v in entries.items() if not p.startswith("gateway:")]
        if (gateway and gateway[0] >= 1 and worker and worker[0] >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert gateway and gateway[0] >= 1, text
    assert worker and worker[0] >= 1, entries  # the chain's step, answered in the worker
    assert f'despina_response_cache_capacity_bytes{{process="{next(iter(entries))}"}} {1 << 20}' in text
    assert "# TYPE despina_response_cache_evictions_total counter" in text


def test_new_files_answer_after_a_reload_never_the_old_answer(server: Server, repo: Path) -> None:
    assert answer(infer(server, "reloaded", [1.0, 1.0]))["y"] == [2.0, 2.0]
    assert answer(infer(server, "reloaded", [1.0, 1.0]))["y"] == [2.0, 2.0]  # cached now
    (repo / "reloaded" / "1" / "model.py").write_text(COUNTER.replace("FACTOR = 2.0", "FACTOR = 3.0"))
    r = httpx.post(f"{server.url}/v2/repository/models/reloaded/load", timeout=60)
    assert r.status_code == 200, r.text
    seen = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not seen or seen[-1] != [3.0, 3.0]):
        seen.append(answer(infer(server, "reloaded", [1.0, 1.0]))["y"])
        time.sleep(0.05)
    assert seen[-1] == [3.0, 3.0], seen
    # once the new files answered, the old answer never comes back (it was kept under the old revision)
    for _ in range(20):
        assert answer(infer(server, "reloaded", [1.0, 1.0]))["y"] == [3.0, 3.0]


def test_the_first_request_after_a_reload_is_answered_by_one_runner_or_the_other(server: Server,
                                                                                    repo: Path) -> None:
    """The runner being replaced had a read blocked on the stream; Redis hands the next request to it,
    and it answers that request before it stops (it used to leave it for the visibility timeout)."""
    assert answer(infer(server, "plain", [2.0, 2.0]))["y"] == [4.0, 4.0]
    (repo / "plain" / "1" / "model.py").write_text(COUNTER.replace("FACTOR = 2.0", "FACTOR = 5.0"))
    assert httpx.post(f"{server.url}/v2/repository/models/plain/load", timeout=60).status_code == 200
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [2.0, 2.0]}]}
    for _ in range(3):  # (the default visibility timeout is 60 s: a lost request would time this out)
        r = httpx.post(f"{server.url}/v2/models/plain/infer", json=body, timeout=10)
        assert answer(r)["y"] in ([4.0, 4.0], [10.0, 10.0])


def test_without_the_setting_nothing_is_cached(serve: Callable[..., Server], repo: Path) -> None:
    server = serve(repo, wait_models=("cached",))
    first = answer(infer(server, "cached", [1.0, 2.0]))["calls"]
    assert answer(infer(server, "cached", [1.0, 2.0]))["calls"] != first


def test_a_decoupled_model_with_the_cache_is_refused_at_load() -> None:
    text = ('name: "d" backend: "python" model_transaction_policy { decoupled: true } '
            'response_cache { enable: true }')
    with pytest.raises(ConfigError, match="response cache does not support a decoupled model"):
        validate(normalize("d", parse_text("d", text)))


# ---- the cache itself ------------------------------------------------------------------------------

def reply(data: bytes) -> InferReply:
    return InferReply("r", (Tensor("y", "UINT8", (len(data),), data),))


def key(data: bytes, **changes: object) -> tuple:
    args: dict = {"model": "m", "version": 1, "revision": "abc", "inputs": [Tensor("x", "UINT8", (len(data),), data)],
                  "outputs": (), "parameters": {}}
    args.update(changes)
    return cache_key(**args)


def test_the_key_holds_everything_an_answer_depends_on() -> None:
    base = key(b"\x01\x02")
    assert key(b"\x01\x02") == base
    for changed in (key(b"\x01\x03"), key(b"\x01\x02", version=2), key(b"\x01\x02", revision="abd"),
                    key(b"\x01\x02", outputs=("y",)), key(b"\x01\x02", parameters={"p": 1}),
                    key(b"\x01\x02", model="n"),
                    key(b"", inputs=[Tensor("x", "INT8", (2,), b"\x01\x02")]),
                    key(b"", inputs=[Tensor("x", "UINT8", (1, 2), b"\x01\x02")])):
        assert changed != base
    ones = [key(b"", parameters={"p": v}) for v in (True, 1, 1.0, "1")]  # equal in Python, not to a model
    assert len(set(ones)) == 4
    two = [Tensor("a", "UINT8", (1,), b"\x01"), Tensor("b", "UINT8", (1,), b"\x02")]
    assert key(b"", inputs=two) == key(b"", inputs=two[::-1])  # the order a client lists them in


def test_the_least_recently_used_answers_go_first_past_the_bound() -> None:
    size = ENTRY_BYTES + 2 * 100  # an entry: the overhead, its input's and its output's bytes
    cache = ResponseCache(3 * size)
    for i in range(3):
        assert cache.put(key(bytes([i]) * 100), reply(bytes([i]) * 100))
    assert cache.bytes == 3 * size and len(cache) == 3
    assert cache.get(key(b"\x00" * 100)) is not None  # used: now the most recent
    cache.put(key(b"\x03" * 100), reply(b"\x03" * 100))
    assert cache.get(key(b"\x01" * 100)) is None  # the least recently used went
    assert cache.get(key(b"\x00" * 100)) is not None and cache.evictions == 1 and cache.bytes == 3 * size
    assert not cache.put(key(b"\x04" * 2000), reply(b"\x04" * 2000))  # larger than the whole cache
    assert len(cache) == 3
    cache.put(key(b"\x00" * 100), reply(b"\x09" * 100))  # the same key again replaces its answer
    assert cache.bytes == 3 * size and cache.get(key(b"\x00" * 100)).outputs[0].data == b"\x09" * 100


def test_a_kept_answer_owns_its_bytes() -> None:
    record = bytearray(b"\x05" * 64)
    view = memoryview(bytes(record))[8:16]  # an output sliced out of the reply record it came in
    cache = ResponseCache(10_000)
    cache.put(key(b"\x01"), InferReply("r", (Tensor("y", "UINT8", (8,), view),)))  # type: ignore[arg-type]
    kept = cache.get(key(b"\x01"))
    assert kept is not None and type(kept.outputs[0].data) is bytes and kept.outputs[0].data == b"\x05" * 8


TRITON_CACHE_GAUGES = {  # Triton 2.51's server-wide response cache gauges, HELP word for word
    "nv_cache_util": "Cache utilization [0.0 - 1.0]",
    "nv_cache_num_entries": "Number of responses stored in response cache",
    "nv_cache_num_hits": "Number of cache hits in response cache",
    "nv_cache_num_misses": "Number of cache misses in response cache",
    "nv_cache_num_lookups": "Number of cache lookups in response cache",
    "nv_cache_num_evictions": "Number of cache evictions in response cache",
    "nv_cache_lookup_duration": "Total cache lookup duration (hit and miss), in microseconds",
    "nv_cache_insertion_duration": "Total cache insertion duration, in microseconds",
}


def cache_gauges(server: Server) -> dict[str, float]:
    text = httpx.get(server.metrics_url, timeout=10).text
    return {line.split(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("nv_cache_") and "{" not in line.split(" ", 1)[0]}


def test_the_caches_server_wide_gauges_are_tritons(server: Server) -> None:
    """Triton 2.51 with --cache-config shows server-wide nv_cache_* gauges beside the per-model counters
    (after 4 lookups, 2 hits: nv_cache_num_lookups 4, nv_cache_num_hits 2, nv_cache_num_misses 2,
    nv_cache_num_entries 2, nv_cache_util 0.00027); Despina showed none of them."""
    text = httpx.get(server.metrics_url, timeout=10).text
    for name, help_ in TRITON_CACHE_GAUGES.items():
        assert f"# HELP {name} {help_}\n# TYPE {name} gauge\n" in text, name
    before = cache_gauges(server)
    answer(infer(server, "cached", [31.0, 32.0]))   # a miss, kept
    answer(infer(server, "cached", [31.0, 32.0]))   # a hit
    settled_stats(server.url, "cached")
    after = cache_gauges(server)
    for name, more in (("nv_cache_num_lookups", 2), ("nv_cache_num_hits", 1), ("nv_cache_num_misses", 1)):
        assert after[name] - before[name] == more, (name, before, after)
    assert after["nv_cache_num_lookups"] == after["nv_cache_num_hits"] + after["nv_cache_num_misses"]
    assert after["nv_cache_lookup_duration"] > before["nv_cache_lookup_duration"]
    assert after["nv_cache_insertion_duration"] > before["nv_cache_insertion_duration"]
    deadline = time.monotonic() + 15  # entries and bytes come with each process's report, every few seconds
    while after["nv_cache_num_entries"] <= before["nv_cache_num_entries"] and time.monotonic() < deadline:
        time.sleep(0.2)
        after = cache_gauges(server)
    assert after["nv_cache_num_entries"] > before["nv_cache_num_entries"], (before, after)
    assert 0 < after["nv_cache_util"] < 1
    assert after["nv_cache_num_evictions"] >= 0


def test_without_a_cache_there_are_no_server_wide_cache_gauges(serve: Callable[..., Server], repo: Path) -> None:
    """As Triton without --cache-config: none of the server-wide nv_cache_* gauges."""
    server = serve(repo, wait_models=("plain",))
    answer(infer(server, "plain", [1.0, 1.0]))
    text = httpx.get(server.metrics_url, timeout=10).text
    assert not [name for name in TRITON_CACHE_GAUGES if f"# TYPE {name} " in text]
