"""An ensemble's own statistics and trace against its composing models', as Triton keeps them, through a
real `despina serve`, both ways (run by the worker that has every model it calls, and by the gateway).

Triton's ensemble scheduler (ensemble_scheduler.cc) gives every step's request the ensemble request's
own statistics aggregator as a second one; when the ensemble ends it reports as its compute input, infer
and output the sums of what its steps reported there. A step that is itself an ensemble reports there
the sums of its own steps (InferenceRequest::ReportStatisticsWithDuration), never its whole latency.
The ensemble's trace has a model span only (REQUEST_START, QUEUE_START, REQUEST_END): no compute span of
its own, its steps have theirs (trace.md: "every composing model produces model and compute spans in
addition to one model span for the ensemble")."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import Server, module_server, settled_stats
from .test_ensemble import infer, outputs, repo  # noqa: F401  (repo: the module fixture, reused)
from .test_trace import ORDER, STEP, check_timestamps

COMPUTE = ("compute_input", "compute_infer", "compute_output")


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "trace.json"


@pytest.fixture(scope="module", params=["worker", "gateway"])
def server(request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
           redis_url: str, trace_file: Path) -> Iterator[Server]:
    env = {"DESPINA_TRACE_FILE": str(trace_file)}
    if request.param == "gateway":
        env["DESPINA_HOST_ENSEMBLES"] = "false"
    yield from module_server(repo, tmp_path_factory, redis_url, ("mlp", "classify_post"), env=env)


def compute_ns(stats: dict) -> int:
    return sum(stats["inference_stats"][k]["ns"] for k in COMPUTE)


def grown(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per model: the requests it answered, its compute and its latency since `before`."""
    return {m: {"success": after[m]["inference_stats"]["success"]["count"]
                - before[m]["inference_stats"]["success"]["count"],
                "compute_ns": compute_ns(after[m]) - compute_ns(before[m]),
                "success_ns": after[m]["inference_stats"]["success"]["ns"]
                - before[m]["inference_stats"]["success"]["ns"]}
            for m in before}


def test_a_nested_ensembles_compute_is_its_inner_steps_compute(server: Server) -> None:
    """'nested' calls the ensemble mlp_classify, which calls mlp then classify_post. The outer's compute is
    the inner's compute (the sum of mlp's and classify_post's), not the inner's latency (which counts its
    queue and its trips through Redis) nor nothing."""
    models = ("nested", "mlp_classify", "mlp", "classify_post")
    x = np.random.default_rng(11).standard_normal((2, 256)).astype(np.float32)
    outputs(infer(server, "nested", {"x": x}))  # every model warm, once
    before = {m: settled_stats(server.url, m) for m in models}
    for _ in range(3):  # one at a time: each step runs alone, its model's compute is this request's
        outputs(infer(server, "nested", {"x": x}))
    after = {m: settled_stats(server.url, m) for m in models}
    g = grown(before, after)
    assert {m: g[m]["success"] for m in models} == dict.fromkeys(models, 3), g
    assert g["nested"]["compute_ns"] == g["mlp_classify"]["compute_ns"], g
    steps = g["mlp"]["compute_ns"] + g["classify_post"]["compute_ns"]
    # a step's reply carries its execution's time up to its outputs, in whole microseconds; its model
    # counts that and splitting its outputs too: a little more (the bound leaves 100 us a step for clocks)
    assert 0 < g["mlp_classify"]["compute_ns"] <= steps + 3 * 2 * 100_000, g
    for m in ("nested", "mlp_classify"):
        assert g[m]["compute_ns"] < g[m]["success_ns"], g


def test_an_ensembles_compute_input_infer_and_output_are_its_steps_sums(server: Server) -> None:
    """As Triton 2.51's (an ensemble of two Python-backend steps, after 5 requests: its compute_input,
    compute_infer and compute_output ns each the sum of its steps'): not all of it as infer."""
    models = ("mlp_classify", "mlp", "classify_post")
    x = np.random.default_rng(13).standard_normal((1, 256)).astype(np.float32)
    outputs(infer(server, "mlp_classify", {"x": x}))
    before = {m: settled_stats(server.url, m)["inference_stats"] for m in models}
    for _ in range(3):  # one at a time: each step runs alone, its model's compute is this request's
        outputs(infer(server, "mlp_classify", {"x": x}))
    after = {m: settled_stats(server.url, m)["inference_stats"] for m in models}
    grew = {m: {k: after[m][k]["ns"] - before[m][k]["ns"] for k in COMPUTE} for m in models}
    assert all(after[m][k]["count"] - before[m][k]["count"] == 3 for m in models for k in COMPUTE), grew
    assert grew["mlp_classify"] == {k: grew["mlp"][k] + grew["classify_post"][k] for k in COMPUTE}, grew
    assert grew["mlp_classify"]["compute_input"] > 0 and grew["mlp_classify"]["compute_output"] > 0, grew


def traces(trace_file: Path, model: str, n: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while True:
        found = []
        for path in sorted(trace_file.parent.glob(trace_file.name + "*")):
            found += [t for t in json.loads(path.read_text()) if t["model_name"] == model]
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


@contextlib.contextmanager
def tracing(server: Server, trace_file: Path, log_frequency: str) -> Iterator[None]:
    """Every request traced at level TIMESTAMPS meanwhile; then tracing off and the trace files gone."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                               "trace_count": "-1", "log_frequency": log_frequency})
        yield
    finally:
        client.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": "1000",
                                               "log_frequency": "0"})
        client.close()
        for path in trace_file.parent.iterdir():
            path.unlink()


def test_an_ensembles_trace_has_no_compute_span_of_its_own_and_a_child_trace_per_step(
        server: Server, trace_file: Path) -> None:
    """As Triton 2.51's, whoever runs the ensemble (a worker that has its steps, or the gateway): its trace
    is its model span and the HTTP stamps, no compute of its own; each step writes a child trace
    ("parent_id", REQUEST_START..REQUEST_END with its compute's four stamps) inside the ensemble's time.
    Before, a worker-run ensemble wrote no child traces."""
    with tracing(server, trace_file, "1"):
        x = np.random.default_rng(12).standard_normal((1, 256)).astype(np.float32)
        for _ in range(2):
            outputs(infer(server, "mlp_classify", {"x": x}))
        found = traces(trace_file, "mlp_classify", 2)
        steps = traces(trace_file, "classify_post", 2) + traces(trace_file, "mlp", 2)
    assert len(found) == 2
    for trace in found:
        check_timestamps(trace, [n for n in ORDER if not n.startswith("COMPUTE")])
        stamps = {n["name"]: n["ns"] for n in trace["timestamps"]}
        children = sorted((t for t in steps if t.get("parent_id") == trace["id"]), key=lambda t: t["id"])
        assert [t["model_name"] for t in children] == ["mlp", "classify_post"], steps
        for child in children:
            assert list(child) == ["id", "model_name", "model_version", "parent_id", "timestamps"]
            assert child["id"] > trace["id"] and child["model_version"] == 1
            check_timestamps(child, STEP)
            assert stamps["QUEUE_START"] <= child["timestamps"][0]["ns"]
            assert child["timestamps"][-1]["ns"] <= stamps["INFER_RESPONSE_COMPLETE"]
        assert children[0]["timestamps"][-1]["ns"] <= children[1]["timestamps"][0]["ns"]  # one after the other


def test_log_frequency_counts_an_ensembles_trace_with_its_steps_as_one(server: Server, trace_file: Path) -> None:
    """As Triton 2.51's (`perf_analyzer -m ens --trace-level TIMESTAMPS --log-frequency 2`): each
    ${trace_file}.N holds log_frequency whole traces, an ensemble's with its steps' child traces (before
    it), never a step's child trace apart from its parent. Before, each child trace counted as one: .0 held
    the first request's two steps, .1 its ensemble and a step of the next, and so on."""
    with tracing(server, trace_file, "2"):
        x = np.random.default_rng(14).standard_normal((1, 256)).astype(np.float32)
        for _ in range(4):
            outputs(infer(server, "mlp_classify", {"x": x}))
        assert len(traces(trace_file, "mlp_classify", 4)) == 4
        parts = sorted(trace_file.parent.glob(trace_file.name + ".*"), key=lambda p: int(p.suffix[1:]))
        written = [[(t["model_name"], t.get("parent_id")) for t in json.loads(p.read_text())] for p in parts]
    assert [[name for name, _ in part] for part in written] == \
        [["mlp", "classify_post", "mlp_classify"] * 2] * 2, written
