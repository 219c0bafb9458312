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

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import Server, module_server
from .test_ensemble import infer, outputs, repo  # noqa: F401  (repo: the module fixture, reused)


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


def traces(trace_file: Path, model: str, n: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while True:
        found = []
        for path in sorted(trace_file.parent.glob(trace_file.name + "*")):
            found += [t for t in json.loads(path.read_text()) if t["model_name"] == model]
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_an_ensembles_trace_has_no_compute_span_of_its_own(server: Server, trace_file: Path) -> None:
    """As Triton's: the ensemble's trace is its model span; before, a worker-run ensemble's showed a
    compute from its queue start to its end (its reply carried its whole latency as compute)."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        client.update_trace_settings("mlp_classify", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                                      "trace_count": "-1", "log_frequency": "1"})
        x = np.random.default_rng(12).standard_normal((1, 256)).astype(np.float32)
        for _ in range(2):
            outputs(infer(server, "mlp_classify", {"x": x}))
        found = traces(trace_file, "mlp_classify", 2)
    finally:
        client.update_trace_settings("mlp_classify", {"trace_level": ["OFF"]})
        client.close()
    assert len(found) == 2
    for trace in found:
        names = [t["name"] for t in trace["timestamps"]]
        assert names == ["REQUEST_START", "QUEUE_START", "REQUEST_END"], trace

