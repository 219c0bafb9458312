"""Triton ensembles: the graph checks at load, and real runs through `despina serve`, both ways: run by
the worker that has every model they call (steps queued into those models' batchers), and run by the
gateway (steps queued on their models' streams, chained by the gateway)."""
from __future__ import annotations

import asyncio
import io
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import tritonclient.http as httpclient

from despina.contract.ensemble import Ensemble
from despina.contract.errors import ConfigError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.examples import mlp_numpy

from .conftest import Server, module_server, settled_stats
from .control_support import index, wait_until, worker_hashes
from .test_metrics import scrape

FOUR = 'input [ { name: "IN0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "IN1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'


def ensemble_config(name: str, steps: str, inputs: str = FOUR, outputs: str = "", batch: int = 8) -> str:
    outputs = outputs or 'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {batch}\n{inputs}{outputs}'
            f'ensemble_scheduling {{ step [ {steps} ] }}\n')


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    maps = "".join(f'input_map {{ key: "{k}" value: "{v}" }} ' for k, v in inputs.items())
    maps += "".join(f'output_map {{ key: "{k}" value: "{v}" }} ' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version} {maps}}}'


def write(repo: Path, name: str, config: str, model_py: str | None = None) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config)
    if model_py is not None:
        (folder / "1" / "model.py").write_text(model_py)
    return folder


# -- the graph, checked at load --------------------------------------------------------------------

ADD = step("add_sub", {"a": "IN0", "b": "IN1"}, {"sum": "OUT"})


@pytest.mark.parametrize("steps, outputs, message", [
    ("", "", "needs field 'ensemble_scheduling' with at least one step"),
    (ADD + ", " + step("add_sub", {"a": "IN0", "b": "IN1"}, {"diff": "OUT"}), "",
     "tensor 'OUT' is made by both step 1 .* and step 2"),
    (step("add_sub", {"a": "IN0", "b": "NOPE"}, {"sum": "OUT"}), "",
     "step 1 .* reads ensemble tensor 'NOPE' .* which no input and no step makes"),
    (step("add_sub", {"a": "IN0", "b": "IN1"}, {"sum": "S"}), "", "ensemble output 'OUT' is made by no step"),
    (step("add_sub", {"a": "IN0", "b": "IN0"}, {"sum": "OUT"}), "", "input\\(s\\) IN1 feed no step"),
    (step("add_sub", {"a": "IN0", "b": "B"}, {"sum": "A"}) + ", " +
     step("add_sub", {"a": "IN1", "b": "A"}, {"sum": "B", "diff": "OUT"}), "", "wait on each other \\(a cycle\\)"),
    (step("add_sub", {"a": "IN0", "b": "IN1"}, {"sum": "OUT"}, version=-2), "", "'model_version' must be -1"),
    (step("add_sub", {"a": "IN0", "b": "IN1"}, {}), "", "empty 'output_map'"),
    # as Triton's ValidateEnsembleSchedulingConfig refuses them
    (step("add_sub", {"a": "IN0", "b": "IN1"}, {"sum": "OUT", "diff": "D"}), "",
     "tensor 'D' from step 1 .* is unused: no step reads it and it is no ensemble output"),
    (ADD + ", " + step("gen", {}, {"o": "O"}), 'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }, '
     '{ name: "O" data_type: TYPE_FP32 dims: [ 4 ] } ]\n', "step 2 .* has an empty 'input_map'"),
])
def test_a_graph_that_cannot_run_is_refused_at_load(tmp_path: Path, steps: str, outputs: str, message: str) -> None:
    config = ensemble_config("pipe", steps, outputs=outputs)
    if not steps:
        config = config.replace("ensemble_scheduling { step [  ] }", "ensemble_scheduling { }")
    folder = write(tmp_path, "pipe", config)
    with pytest.raises(ConfigError, match=f"model 'pipe': .*{message}"):
        load_model(folder)


def test_a_scheduling_block_needs_the_ensemble_platform_and_declared_tensors(tmp_path: Path) -> None:
    folder = write(tmp_path, "odd", 'backend: "onnxruntime"\nmax_batch_size: 8\n' + FOUR +
                   'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                   f'ensemble_scheduling {{ step [ {ADD} ] }}\n')
    with pytest.raises(ConfigError, match="'ensemble_scheduling' needs platform \"ensemble\""):
        load_model(folder)
    folder = write(tmp_path, "bare", f'platform: "ensemble"\nensemble_scheduling {{ step [ {ADD} ] }}\n')
    with pytest.raises(ConfigError, match="declares its inputs and outputs"):
        load_model(folder)


@pytest.mark.parametrize("field", ['instance_group [ { count: 2 kind: KIND_CPU } ]',
                                   'optimization { priority: PRIORITY_MAX }',
                                   'model_warmup [ { name: "w" batch_size: 1 inputs { key: "IN0" value { '
                                   'data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]'])
def test_an_ensemble_takes_no_instances_optimization_or_warmup(tmp_path: Path, field: str) -> None:
    """As Triton's ValidateEnsembleSchedulingConfig: they are its steps' models' to have."""
    folder = write(tmp_path, "pipe", ensemble_config("pipe", ADD) + field + "\n")
    with pytest.raises(ConfigError, match=f"model 'pipe': an ensemble takes no field '{field.split()[0]}'"):
        load_model(folder)


def test_an_ensemble_needs_no_version_folder(tmp_path: Path) -> None:
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "config.pbtxt").write_text(ensemble_config("pipe", ADD))
    entry = load_model(folder)
    assert entry.versions == (1,) and entry.state == "READY"


def spec(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec.from_config({"max_batch_size": 8, "platform": "onnxruntime_onnx", **config})


ADD_SUB = spec({"name": "add_sub", "input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [4]},
                                              {"name": "b", "data_type": "TYPE_FP32", "dims": [4]}],
                "output": [{"name": "sum", "data_type": "TYPE_FP32", "dims": [4]},
                           {"name": "diff", "data_type": "TYPE_FP32", "dims": [4]}]})


@pytest.mark.parametrize("change, message", [
    ({"add_sub": None}, "step 1 \\(model 'add_sub'\\): gone"),
    ({"output": "total"}, "the model has no output 'total'"),
    ({"data_type": "TYPE_INT32"}, "input 'a' is INT32 but ensemble tensor 'IN0' from the ensemble's input is FP32"),
    ({"dims": [5]}, "input 'a' has shape \\[-1, 5\\] but ensemble tensor 'IN0' .* has \\[-1, 4\\]"),
    ({"max_batch_size": 4}, "max_batch_size 4 is below the ensemble's 8"),
])
def test_the_models_an_ensemble_calls_must_fit_its_graph(tmp_path: Path, change: dict[str, Any],
                                                         message: str) -> None:
    config = load_model(write(tmp_path, "pipe", ensemble_config("pipe", step(
        "add_sub", {"a": "IN0", "b": "IN1"}, {change.get("output", "sum"): "OUT"})))).config
    model = dict(ADD_SUB.config)
    if "data_type" in change or "dims" in change:
        a = {**model["input"][0], **{k: v for k, v in change.items() if k in ("data_type", "dims")}}
        model["input"] = [a, model["input"][1]]
    if "max_batch_size" in change:
        model["max_batch_size"] = change["max_batch_size"]
    called = None if "add_sub" in change else ModelSpec.from_config(model)
    why = Ensemble.from_config(config).problems(ModelSpec.from_config(config),
                                                lambda name: (called, "gone"))
    assert why and re.search(message, why), why


def test_ensembles_that_call_each_other_are_refused(tmp_path: Path) -> None:
    a = load_model(write(tmp_path, "a", ensemble_config("a", step("b", {"IN0": "IN0", "IN1": "IN1"},
                                                                   {"OUT": "OUT"})))).config
    b = load_model(write(tmp_path, "b", ensemble_config("b", step("a", {"IN0": "IN0", "IN1": "IN1"},
                                                                   {"OUT": "OUT"})))).config
    specs = {"a": ModelSpec.from_config(a), "b": ModelSpec.from_config(b)}
    why = Ensemble.from_config(a).problems(specs["a"], lambda name: (specs[name], ""))
    assert "call each other in a cycle" in why


# -- served ------------------------------------------------------------------------------------------

PICKY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.sqrt(x))]))
        return responses
'''
PICKY_CONFIG = ('name: "picky"\nbackend: "python"\nmax_batch_size: 8\n'
                'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                'instance_group [ { count: 1, kind: KIND_CPU } ]\n')


# returns OUTPUT0 only, though it declares OUTPUT1 too
SPARSE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            request, "INPUT").as_numpy())]) for request in requests]
'''
SPARSE_CONFIG = ('name: "sparse"\nbackend: "python"\nmax_batch_size: 8\n'
                 'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                 'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, '
                 '{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                 'instance_group [ { count: 1, kind: KIND_CPU } ]\n')
ONE_IN = 'input [ { name: "IN0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'


@pytest.fixture(scope="module")
def repo(example_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ensembles") / "repo"
    root.mkdir()
    for name in ("add_sub", "add_sub_python", "mlp", "classify_post", "mlp_classify"):
        shutil.copytree(example_repository / name, root / name)
    write(root, "picky", PICKY_CONFIG, PICKY)
    # a diamond: two steps at once on the inputs, a third on both their outputs
    write(root, "diamond", ensemble_config("diamond", ", ".join([
        step("add_sub", {"a": "IN0", "b": "IN1"}, {"sum": "S", "diff": "D"}),
        step("add_sub_python", {"INPUT0": "IN0", "INPUT1": "IN1"}, {"OUTPUT0": "S2", "OUTPUT1": "D2"}),
        step("add_sub", {"a": "S", "b": "S2"}, {"sum": "TOTAL"})]),
        outputs='output [ { name: "TOTAL" data_type: TYPE_FP32 dims: [ 4 ] }, '
                '{ name: "D" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "D2" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'))
    write(root, "nested", ensemble_config("nested", step("mlp_classify", {"x": "x"}, {"label": "label"}),
                                          inputs='input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ]\n',
                                          outputs='output [ { name: "label" data_type: TYPE_INT64 dims: [ 1 ] } ]\n',
                                          batch=128))
    write(root, "roots", ensemble_config("roots", ", ".join([
        step("add_sub", {"a": "IN0", "b": "IN1"}, {"diff": "D"}),
        step("picky", {"INPUT": "D"}, {"OUTPUT": "OUT"})])))
    # two branches: the sum, and picky's root of IN0 (which fails on a negative IN0)
    write(root, "branches", ensemble_config("branches", ", ".join([
        step("add_sub", {"a": "IN0", "b": "IN1"}, {"sum": "S"}), step("picky", {"INPUT": "IN0"}, {"OUTPUT": "R"})]),
        outputs='output [ { name: "S" data_type: TYPE_FP32 dims: [ 4 ] }, '
                '{ name: "R" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'))
    # a batching ensemble over a model that does not batch, whose dims take the batch in: Triton allows it
    write(root, "unbatched", PICKY_CONFIG.replace("picky", "unbatched").replace("max_batch_size: 8", "max_batch_size: 0")
          .replace("dims: [ 4 ]", "dims: [ -1, 4 ]"), PICKY)
    write(root, "mixed", ensemble_config("mixed", step("unbatched", {"INPUT": "IN0"}, {"OUTPUT": "OUT"}), inputs=ONE_IN))
    write(root, "sparse", SPARSE_CONFIG, SPARSE)
    write(root, "gaps", ensemble_config("gaps", step("sparse", {"INPUT": "IN0"}, {"OUTPUT0": "A", "OUTPUT1": "B"}),
                                        inputs=ONE_IN,
                                        outputs='output [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, '
                                                '{ name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'))
    write(root, "orphan", ensemble_config("orphan", step("no_such_model", {"a": "IN0", "b": "IN1"},
                                                         {"sum": "OUT"})))
    write(root, "unpinned", ensemble_config("unpinned", step("add_sub", {"a": "IN0", "b": "IN1"},
                                                             {"sum": "OUT"}, version=7)))
    # an ensemble that calls itself, and two that call each other
    write(root, "loop", ensemble_config("loop", step("loop", {"IN0": "IN0", "IN1": "IN1"}, {"OUT": "OUT"})))
    write(root, "ping", ensemble_config("ping", step("pong", {"IN0": "IN0", "IN1": "IN1"}, {"OUT": "OUT"})))
    write(root, "pong", ensemble_config("pong", step("ping", {"IN0": "IN0", "IN1": "IN1"}, {"OUT": "OUT"})))
    return root


@pytest.fixture(scope="module", params=["worker", "gateway"])
def server(request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory,
           redis_url: str) -> Iterator[Server]:
    """Every test below runs twice: with the worker (that has every model) running the ensembles, and
    with the gateway running them step by step, as it does when their models are on different workers."""
    env = {"DESPINA_HOST_ENSEMBLES": "false"} if request.param == "gateway" else None
    yield from module_server(repo, tmp_path_factory, redis_url,
                             ("mlp", "add_sub", "add_sub_python", "classify_post", "picky", "sparse", "unbatched"),
                             env=env)


def test_which_process_runs_the_ensemble(server: Server, redis_url: str,
                                         request: pytest.FixtureRequest) -> None:
    """Run by the worker, an ensemble request is read from the ensemble's own stream; run by the gateway,
    that stream is never made. The answers are the same either way (the tests below)."""
    x = np.zeros((2, 256), np.float32)
    wait_until(lambda: httpx.get(f"{server.url}/v2/models/mlp_classify/ready").status_code == 200, 20,
               what="the ensemble to be ready")
    for _ in range(3):
        assert infer(server, "mlp_classify", {"x": x}).status_code == 200
    r = redis.Redis.from_url(redis_url)
    try:
        stream = f"{server.prefix}:req:mlp_classify:1"
        if request.node.callspec.params["server"] == "worker":
            groups = r.xinfo_groups(stream)
            assert groups and groups[0]["entries-read"] >= 3 and r.xlen(stream) == 0  # read, answered, acked
            assert "ensemble mlp_classify version 1: run in this worker" in server.logs()
        else:
            assert not r.exists(stream)
    finally:
        r.close()


def infer(server: Server, model: str, inputs: dict[str, np.ndarray], **extra: Any) -> httpx.Response:
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
                       for n, a in inputs.items()], **extra}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)


def outputs(response: httpx.Response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in response.json()["outputs"]}


def softmax(y: np.ndarray) -> np.ndarray:
    e = np.exp(y - y.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_the_example_ensemble_matches_its_steps_done_by_hand(server: Server) -> None:
    x = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32)
    got = outputs(infer(server, "mlp_classify", {"x": x}))
    logits = mlp_numpy(x)
    assert np.allclose(got["probabilities"], softmax(logits), atol=1e-5)
    assert got["label"].ravel().tolist() == logits.argmax(axis=1).tolist()
    assert got["label"].shape == (5, 1)
    # the function URL and a chosen output
    fn = httpx.post(f"{server.url}/fn/mlp_classify", json={"x": x[0].tolist()}, timeout=30).json()
    assert fn["label"] == [int(logits[0].argmax())]
    only = infer(server, "mlp_classify", {"x": x[:1]}, outputs=[{"name": "label"}]).json()["outputs"]
    assert [o["name"] for o in only] == ["label"]


def test_tritonclient_binary_tensors_through_an_ensemble(server: Server) -> None:
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        assert client.is_model_ready("mlp_classify")
        meta = client.get_model_metadata("mlp_classify")
        assert meta["platform"] == "ensemble" and meta["inputs"][0]["shape"] == [-1, 256]
        x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
        given = httpclient.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=True)
        wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("probabilities", "label")]
        result = client.infer("mlp_classify", [given], outputs=wanted)
        assert np.allclose(result.as_numpy("probabilities"), softmax(mlp_numpy(x)), atol=1e-5)
        assert result.as_numpy("label").dtype == np.int64
    finally:
        client.close()


def test_independent_steps_and_a_step_on_both_their_outputs(server: Server) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)
    got = outputs(infer(server, "diamond", {"IN0": a, "IN1": b}))
    assert np.allclose(got["TOTAL"], 2 * (a + b)) and np.allclose(got["D"], a - b)
    assert np.allclose(got["D2"], a - b)


def test_an_ensemble_can_call_an_ensemble(server: Server) -> None:
    x = np.random.default_rng(5).standard_normal((2, 256)).astype(np.float32)
    got = outputs(infer(server, "nested", {"x": x}))
    assert got["label"].ravel().tolist() == mlp_numpy(x).argmax(axis=1).tolist()


def test_concurrent_ensemble_requests_each_get_their_own_rows(server: Server) -> None:
    rows = np.random.default_rng(6).standard_normal((64, 256)).astype(np.float32)

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(f"{server.url}/fn/mlp_classify", json={"x": r.tolist()})
                                          for r in rows))

    answers = asyncio.run(all_at_once())
    assert [r.json()["label"][0] for r in answers] == mlp_numpy(rows).argmax(axis=1).tolist()
    stats = settled_stats(server.url, "classify_post")
    assert stats["execution_count"] < stats["inference_count"]  # the step was batched across requests


def test_an_ensembles_own_statistics_count_its_steps_compute_and_its_batch(server: Server) -> None:
    """Triton's ensemble reports each request's compute as the sum of its steps' compute, counted once
    per successful request, and an execution of the request's batch size (ensemble_scheduler.cc's
    FinishEnsemble): perf_analyzer's CSV reads an ensemble's compute from these, not its steps'."""
    before = settled_stats(server.url, "mlp_classify")
    x = np.random.default_rng(7).standard_normal((3, 256)).astype(np.float32)
    infer(server, "mlp_classify", {"x": x})
    after = settled_stats(server.url, "mlp_classify")
    grown = {k: after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"]
             for k in ("success", "compute_input", "compute_infer", "compute_output")}
    assert grown == {"success": 1, "compute_input": 1, "compute_infer": 1, "compute_output": 1}
    assert after["inference_stats"]["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]
    batches = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert batches.get(3, 0) == 1 + {b["batch_size"]: b["compute_infer"]["count"]
                                     for b in before["batch_stats"]}.get(3, 0)


def test_an_ensembles_own_queue_time_is_its_wait_before_its_graph_began(server: Server,
                                                                         request: pytest.FixtureRequest) -> None:
    """Triton's ensemble counts as its queue time its own wait, from its enqueue until the ensemble
    scheduler starts its graph (ensemble_scheduler.cc: the request's queue start to its context's compute
    start), none of its steps' (each counts its own). Run by a worker, an ensemble request waits on the
    ensemble's stream until that worker reads it; run by the gateway, it starts as it arrives: nothing
    queued. The nv_inference_* counters say what the statistics say."""
    before = settled_stats(server.url, "mlp_classify")
    x = np.random.default_rng(8).standard_normal((2, 256)).astype(np.float32)
    for _ in range(3):
        outputs(infer(server, "mlp_classify", {"x": x}))
    after = settled_stats(server.url, "mlp_classify")
    grown = {f"{k}_{f}": after["inference_stats"][k][f] - before["inference_stats"][k][f]
             for k in ("queue", "success") for f in ("count", "ns")}
    assert grown["queue_count"] == grown["success_count"] == 3
    if request.node.callspec.params["server"] == "worker":
        assert 0 < grown["queue_ns"] < grown["success_ns"], grown
    else:
        assert grown["queue_ns"] == 0, grown
    metrics = scrape(server)
    labels = '{model="mlp_classify",version="1"}'
    stats = after["inference_stats"]
    for name, figure in (("queue", "queue"), ("request", "success"), ("compute_infer", "compute_infer")):
        assert metrics[f"nv_inference_{name}_duration_us{labels}"] == pytest.approx(stats[figure]["ns"] / 1000)
    assert metrics[f"despina_queue_latency_seconds_count{labels}"] == stats["queue"]["count"]
    assert metrics[f"despina_queue_latency_seconds_sum{labels}"] == pytest.approx(stats["queue"]["ns"] / 1e9)


def test_a_failing_step_fails_the_request_and_says_which(server: Server) -> None:
    ok = outputs(infer(server, "roots", {"IN0": np.full((1, 4), 9, np.float32), "IN1": np.ones((1, 4), np.float32)}))
    assert np.allclose(ok["OUT"], np.sqrt(8))
    bad = infer(server, "roots", {"IN0": np.zeros((1, 4), np.float32), "IN1": np.ones((1, 4), np.float32)})
    assert bad.status_code in (400, 500)
    assert "ensemble 'roots' step 2 (model 'picky')" in bad.json()["error"]
    assert "negative input" in bad.json()["error"]
    def stats() -> dict[str, Any]:
        return httpx.get(f"{server.url}/v2/models/roots/stats").json()["model_stats"][0]["inference_stats"]

    counted = wait_until(lambda: next((s for s in [stats()] if s["fail"]["count"]), None), 10,
                         what="the failure to be counted")  # the gateway writes its counts within 50 ms
    assert counted["fail"]["count"] == 1 and counted["success"]["count"] >= 1
    # a failure's duration is counted, the ensemble's and its step's, as Triton's (it was always 0)
    assert counted["fail"]["ns"] > 0
    picky = settled_stats(server.url, "picky")["inference_stats"]["fail"]
    assert picky["count"] == 1 and picky["ns"] > 0


def test_an_output_a_step_did_not_return_is_left_out_of_the_answer(server: Server) -> None:
    """As in Triton, whose ensemble answers with the outputs its steps returned: `sparse` returns OUTPUT0
    alone, so the ensemble's B is missing, and the answer has A."""
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    got = outputs(infer(server, "gaps", {"IN0": x}))
    assert list(got) == ["A"] and np.allclose(got["A"], x)


def test_only_the_steps_the_requested_outputs_need_run(server: Server) -> None:
    """As in Triton, which prunes the steps no requested output needs: asked for S alone, `branches` does
    not call picky, which would fail on the negative IN0."""
    a, b = np.full((1, 4), -4, np.float32), np.ones((1, 4), np.float32)
    before = settled_stats(server.url, "picky")["inference_stats"]["fail"]["count"]
    got = outputs(infer(server, "branches", {"IN0": a, "IN1": b}, outputs=[{"name": "S"}]))
    assert list(got) == ["S"] and np.allclose(got["S"], a + b)
    assert settled_stats(server.url, "picky")["inference_stats"]["fail"]["count"] == before
    both = infer(server, "branches", {"IN0": a, "IN1": b})
    assert both.status_code != 200 and "negative input" in both.json()["error"]


def test_a_batching_ensemble_can_call_a_model_that_does_not_batch(server: Server) -> None:
    """As in Triton, where a step's max_batch_size of 0 is allowed when the full shapes agree: `mixed`
    ([-1, 4] with its batch dimension) passes its rows whole to `unbatched` (dims [-1, 4])."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = outputs(infer(server, "mixed", {"IN0": x}))
    assert np.allclose(got["OUT"], np.sqrt(x)) and got["OUT"].shape == (3, 4)


def test_bad_inputs_are_refused_before_any_step_runs(server: Server) -> None:
    wrong = infer(server, "diamond", {"IN0": np.zeros((1, 5), np.float32), "IN1": np.zeros((1, 5), np.float32)})
    assert wrong.status_code == 400 and "does not match" in wrong.json()["error"]
    missing = infer(server, "diamond", {"IN0": np.zeros((1, 4), np.float32)})
    assert missing.status_code == 400 and "needs input(s) IN1" in missing.json()["error"]
    unknown = infer(server, "diamond", {"IN0": np.zeros((1, 4), np.float32), "IN1": np.zeros((1, 4), np.float32)},
                    outputs=[{"name": "S"}])
    assert unknown.status_code == 400 and "unexpected inference output 'S' for model 'diamond'" in unknown.json()["error"]


def test_an_ensemble_calling_a_missing_model_is_unavailable_with_the_reason(server: Server) -> None:
    row = next(r for r in index(server.url) if r["name"] == "orphan")
    assert row["state"] == "UNAVAILABLE"
    assert "step 1 (model 'no_such_model')" in row["reason"] and "not in the repository" in row["reason"]
    answer = infer(server, "orphan", {"IN0": np.zeros((1, 4), np.float32), "IN1": np.zeros((1, 4), np.float32)})
    # Triton's 404: no version of it serves (it was a 503)
    assert answer.status_code == 404 and "no_such_model" in answer.json()["error"], answer.text
    assert "has no available versions" in answer.json()["error"]
    assert httpx.get(f"{server.url}/v2/models/orphan/ready").status_code == 400
    row = next(r for r in index(server.url) if r["name"] == "unpinned")
    assert row["state"] == "UNAVAILABLE" and "version 7 of model 'add_sub' is not loaded" in row["reason"]
    for name in ("mlp_classify", "diamond", "nested"):
        assert next(r for r in index(server.url) if r["name"] == name)["state"] == "READY"
        assert httpx.get(f"{server.url}/v2/models/{name}/ready").status_code == 200


def test_ensembles_in_a_cycle_say_so_and_their_reason_stays_put(server: Server) -> None:
    # once one of them was marked failed, the other named that failure ("model 'ping' failed to load: step
    # 1 (model 'pong'): model 'pong' failed to load: ..."), one level deeper at every tick of the control
    # plane: the reason (catalog, index, log lines) grew without end
    def reasons() -> dict[str, str]:
        return {r["name"]: r.get("reason", "") for r in index(server.url) if r["name"] in ("loop", "ping", "pong")}

    first = reasons()
    time.sleep(2.5)  # a few ticks
    assert reasons() == first
    assert first == {name: f"step 1 (model '{called}'): the ensembles call each other in a cycle"
                     for name, called in (("loop", "loop"), ("ping", "pong"), ("pong", "ping"))}


def test_the_status_page_and_metrics_show_ensembles(server: Server, request: pytest.FixtureRequest) -> None:
    assert infer(server, "diamond", {"IN0": np.ones((1, 4), np.float32), "IN1": np.ones((1, 4), np.float32)}
                 ).status_code == 200
    base = server.metrics_url.removesuffix("/metrics")
    # which workers run it themselves: the one worker, or none (the gateways chain its steps)
    by_worker = request.node.callspec.params["server"] == "worker"

    def status() -> dict[str, dict] | None:
        """The rows once the status (sampled every 2 s) has the workers' word on what they run."""
        rows = {m["name"]: m for m in httpx.get(f"{base}/status.json").json()["models"]}
        if rows.get("add_sub", {}).get("workers") and (not by_worker or rows.get("diamond", {}).get("workers")):
            return rows
        return None

    rows = wait_until(status, 10, what="the status")
    assert rows["diamond"]["ensemble"] and not rows["diamond"]["failed"] and not rows["diamond"]["reason"]
    assert rows["add_sub"]["workers"]
    assert rows["diamond"]["workers"] == (rows["add_sub"]["workers"] if by_worker else [])
    assert rows["orphan"]["ensemble"] and rows["orphan"]["failed"] and "no_such_model" in rows["orphan"]["reason"]
    assert not rows["mlp"]["ensemble"]
    success = 'nv_inference_request_success{model="diamond",version="1"}'
    metrics = wait_until(lambda: next((t for t in [httpx.get(server.metrics_url).text] if success in t), None),
                         10, what="the ensemble's metrics")
    assert 'nv_inference_exec_count{model="diamond",version="1"}' in metrics


def test_explicit_mode_loading_an_ensemble_loads_what_it_calls(
        serve: Callable[..., Server], repo: Path, tmp_path: Path) -> None:
    server = serve(repo, "--model-control-mode", "explicit", "--load-model", "nested", health="live")
    wait_until(lambda: httpx.get(f"{server.url}/v2/models/nested/ready").status_code == 200, 60,
               what="the nested ensemble to be ready")
    states = {r["name"]: r.get("state") for r in index(server.url)}
    assert states["nested"] == states["mlp_classify"] == states["mlp"] == states["classify_post"] == "READY"
    assert "state" not in {r["name"]: r for r in index(server.url)}["add_sub"]  # not called: not loaded
    x = np.zeros((1, 256), np.float32)
    assert outputs(infer(server, "nested", {"x": x}))["label"].ravel().tolist() == [int(mlp_numpy(x).argmax())]
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
    try:
        wait_until(lambda: settled_stats(server.url, "nested")["inference_count"] == 1, 15,
                   what="the request counted")
        # a model an ensemble calls, unloaded: as Triton 2.51's (seen, explicit mode), the ensembles on top
        # are unloaded with it (index UNAVAILABLE "unloaded", a request 404 "has no available versions", one
        # naming version 1 503 "not at ready state"), and load again once it is back, their statistics
        # afresh. Despina left them loaded, UNAVAILABLE with the step and why, a version 503 "cannot serve".
        # (unload_dependents unloads what the model calls, and classify_post calls nothing.)
        client.unload_model("classify_post", unload_dependents=True)
        states = {r["name"]: (r.get("state"), r.get("reason", "")) for r in index(server.url)}
        assert states["classify_post"] == ("UNAVAILABLE", "unloaded")
        assert states["mlp_classify"] == states["nested"] == ("UNAVAILABLE", "unloaded"), states
        assert states["mlp"] == ("READY", "")
        r = infer(server, "nested", {"x": x})
        assert r.status_code == 404 and "has no available versions" in r.json()["error"], r.text
        r = httpx.post(f"{server.url}/v2/models/nested/versions/1/infer", timeout=30,
                       json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.0] * 256}]})
        assert r.status_code == 503 and r.json()["error"] == \
            "Request for unknown model: 'nested' version 1 is not at ready state", r.text
        # loaded again (by name this time), the ensembles serve again
        client.load_model("classify_post")
        wait_until(lambda: httpx.get(f"{server.url}/v2/models/nested/ready").status_code == 200, 30,
                   what="the ensembles to serve again")
        assert settled_stats(server.url, "nested")["inference_count"] == 0
        # an ensemble unloaded by name stays unloaded when the model it calls comes back
        client.unload_model("classify_post")
        client.unload_model("nested")
        client.load_model("classify_post")
        states = {r["name"]: (r.get("state"), r.get("reason", "")) for r in index(server.url)}
        assert states["nested"] == ("UNAVAILABLE", "unloaded") and states["mlp_classify"][0] == "READY", states
        client.load_model("nested")
        # unload_dependents on the ensemble unloads the models it loaded as its steps (mlp_classify and
        # mlp), not one loaded by name (classify_post), nor one nothing loaded for it (add_sub)
        client.load_model("add_sub")
        client.unload_model("nested", unload_dependents=True)
    finally:
        client.close()
    states = {r["name"]: (r.get("state"), r.get("reason", "")) for r in index(server.url)}
    assert states["nested"] == states["mlp_classify"] == states["mlp"] == ("UNAVAILABLE", "unloaded")
    assert states["classify_post"] == states["add_sub"] == ("READY", "")


def test_a_step_scaled_to_zero_is_woken_by_the_ensemble(serve: Callable[..., Server], repo: Path,
                                                        tmp_path: Path) -> None:
    idle = tmp_path / "repo"
    for name in ("mlp", "classify_post", "mlp_classify"):
        shutil.copytree(repo / name, idle / name)
    config = idle / "classify_post" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "idle_timeout_s" value: { string_value: "1" } }\n')
    server = serve(idle, "--model-control-mode", "explicit", "--load-model", "mlp_classify",
                   wait_models=("mlp", "classify_post"))
    wait_until(lambda: next(r for r in index(server.url) if r["name"] == "mlp_classify")["state"] == "UNAVAILABLE",
               20, what="classify_post to go idle")
    row = next(r for r in index(server.url) if r["name"] == "mlp_classify")
    assert row["reason"].startswith("idle") and "classify_post" in row["reason"]
    # loading the ensemble again answers at once: an idle step is loaded as far as it goes
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=20)
    try:
        client.load_model("mlp_classify")
    finally:
        client.close()
    x = np.ones((1, 256), np.float32)
    got = outputs(infer(server, "mlp_classify", {"x": x}))
    assert got["label"].ravel().tolist() == [int(mlp_numpy(x).argmax())]


def test_an_ensemble_in_s3_with_a_pinned_step_version(serve: Callable[..., Server], s3_env: Any,
                                                      tmp_path: Path) -> None:
    """An ensemble folder in S3 is only its config.pbtxt (a store has no empty folders); a step that
    names a version calls that one while a newer one serves the model's own URL."""
    from despina.registry.transfer import push

    from .control_support import ROW, expected, mlp_folder

    url, settings = s3_env.url(), s3_env.settings()
    push(mlp_folder(tmp_path / "src", versions={1: 0, 2: 1}, extra='version_policy { all { } }'), url, settings,
         out=io.StringIO())
    pinned = write(tmp_path / "src", "pinned", ensemble_config("pinned", step("mlp", {"x": "x"}, {"y": "y"}, version=1),
                                                               inputs='input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ]\n',
                                                               outputs='output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] } ]\n',
                                                               batch=8))
    (pinned / "1").rmdir()
    said = io.StringIO()
    push(pinned, url, settings, out=said)
    assert "pushed pinned (an ensemble: its config)" in said.getvalue()
    server = serve(url, wait_models=("mlp", "pinned"), env={**s3_env.env, "DESPINA_CACHE_DIR": str(tmp_path / "cache")})
    row = np.array([ROW], np.float32)
    direct = outputs(infer(server, "mlp", {"x": row}))["y"]
    via = outputs(infer(server, "pinned", {"x": row}))["y"]
    assert np.allclose(direct, expected(1), atol=1e-4) and np.allclose(via, expected(0), atol=1e-4)
    assert [r["version"] for r in index(server.url) if r["name"] == "pinned"] == ["1"]


def test_with_two_workers_an_ensembles_models_are_placed_together(serve: Callable[..., Server], repo: Path,
                                                                   tmp_path: Path, redis_url: str,
                                                                   key_prefix: str) -> None:
    """Placement keeps the models an ensemble calls on one worker, which then runs the ensemble (without
    the rule, the second model goes to the other, emptier worker; tests/test_control_placement.py has
    the rule itself)."""
    two = tmp_path / "repo"
    for name in ("mlp", "classify_post", "mlp_classify"):
        shutil.copytree(repo / name, two / name)
    server = serve(two, "--workers", "2", wait_models=("mlp", "classify_post"))
    wait_until(lambda: len(worker_hashes(redis_url, key_prefix)) == 2, 20, what="two workers")
    base = server.metrics_url.removesuffix("/metrics")
    placed = wait_until(lambda: next((p for p in [{m["name"]: m["placed"] for m in
                                                    httpx.get(f"{base}/status.json").json()["models"]}]
                                      if p.get("mlp") and p.get("classify_post")), None), 20, what="placement")
    assert placed["mlp"] == placed["classify_post"]
    wait_until(lambda: "ensemble mlp_classify version 1: run in this worker" in server.logs(), 20,
               what="the worker to run the ensemble")
    x = np.random.default_rng(8).standard_normal((3, 256)).astype(np.float32)
    got = outputs(infer(server, "mlp_classify", {"x": x}))
    assert got["label"].ravel().tolist() == mlp_numpy(x).argmax(axis=1).tolist()
    r = redis.Redis.from_url(redis_url)
    try:
        assert r.xinfo_groups(f"{key_prefix}:req:mlp_classify:1")[0]["entries-read"] >= 1
    finally:
        r.close()


def test_requests_in_flight_when_a_step_model_unloads_all_get_an_answer(
        serve: Callable[..., Server], repo: Path, tmp_path: Path) -> None:
    """The worker stops running the ensemble before the model it calls unloads: whatever it had read,
    or was queued for it, is answered (a result, or a clear error), never left to time out."""
    own = tmp_path / "repo"
    for name in ("mlp", "classify_post", "mlp_classify"):
        shutil.copytree(repo / name, own / name)
    server = serve(own, "--model-control-mode", "explicit", "--load-model", "mlp_classify",
                   wait_models=("mlp", "classify_post"))
    wait_until(lambda: "ensemble mlp_classify version 1: run in this worker" in server.logs(), 20,
               what="the worker to run the ensemble")
    x = np.random.default_rng(9).standard_normal((1, 256)).astype(np.float32).ravel().tolist()

    async def traffic() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:
            async def one(i: int) -> httpx.Response:
                await asyncio.sleep(i * 0.01)
                return await client.post(f"{server.url}/fn/mlp_classify", json={"x": x})

            async def unload() -> None:
                await asyncio.sleep(0.3)
                r = await client.post(f"{server.url}/v2/repository/models/classify_post/unload")
                assert r.status_code == 200, r.text

            *answers, _ = await asyncio.gather(*(one(i) for i in range(150)), unload())
            return answers

    answers = asyncio.run(traffic())
    codes = [r.status_code for r in answers]
    # (in flight at the unload: 503; sent after it, Triton's 404, the ensemble having no version that serves)
    assert codes[0] == 200 and set(codes) <= {200, 404, 503}, codes
    assert all("error" in r.json() for r in answers if r.status_code != 200)
    assert {404, 503} & set(codes)  # the last ones came after the unload


def test_steady_ensemble_traffic_keeps_its_models_from_going_idle(serve: Callable[..., Server], repo: Path,
                                                                   tmp_path: Path) -> None:
    """Steps run inside the worker count as their models' use (their counters ride along with later
    pipelines), and so does a request queued or running for the ensemble: a model called only through
    the ensemble is not scaled to zero while it is called. (Once, on a loaded machine, it was: its idle
    clock had started before it served, and nothing counted the ensemble's requests as its own.)"""
    own = tmp_path / "repo"
    for name in ("mlp", "classify_post", "mlp_classify"):
        shutil.copytree(repo / name, own / name)
    config = own / "classify_post" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "idle_timeout_s" value: { string_value: "1" } }\n')
    server = serve(own, wait_models=("mlp", "classify_post"))
    wait_until(lambda: "ensemble mlp_classify version 1: run in this worker" in server.logs(), 20,
               what="the worker to run the ensemble")
    x = {"x": np.zeros(256).tolist()}
    unloaded = "model classify_post: no request for"
    sent: list[float] = []
    with httpx.Client(timeout=20) as client:
        # (a start slower than the idle timeout may scale it to zero before it is called: that is no
        # use, and the first request brings it back; what counts is the steady traffic that follows)
        assert client.post(f"{server.url}/fn/mlp_classify", json=x).status_code == 200
        before = server.logs().count(unloaded)
        for _ in range(20):  # 4 s of requests, four times the idle timeout
            sent.append(time.monotonic())
            assert client.post(f"{server.url}/fn/mlp_classify", json=x).status_code == 200
            time.sleep(0.2)
    # A request is the model's use from the moment it is sent (queued, then run) until it ends; the only
    # time it is not called is from one request's step to the next request: shorter than the time from one
    # send to the next. A machine that stalled this test for the idle timeout between two sends left the
    # model truly idle.
    stalled = max(b - a for a, b in zip(sent, sent[1:])) > 1.0
    assert server.logs().count(unloaded) == before or stalled, (sent, server.logs())
    stats = httpx.get(f"{server.url}/v2/models/classify_post/stats").json()["model_stats"][0]
    assert stats["inference_count"] >= 20  # the steps are counted in the model's own statistics
