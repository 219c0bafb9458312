"""Ensembles with a decoupled step, as Triton 2.51 runs them: each response of the decoupled step goes
through the steps after it, and each time those give the ensemble's outputs that is a response of the
ensemble, which is itself decoupled (its /config says so, /infer refuses it with a 501, its responses
stream from /generate_stream). Checked against a real Triton 2.51 with these same models."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from despina.contract.ensemble import Ensemble
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model

from .conftest import Server, module_server, settled_stats
from .test_ensemble import step, write

# a response per count up to IN (OUT = its index), then the final flag alone; at index ERR an error
# response instead, a moment later than the others (so the responses before it are out first); with ERR
# -2 the last response carries the final flag
DEC = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            err = int(pb_utils.get_input_tensor_by_name(request, "ERR").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                if i == err:
                    time.sleep(0.3)
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"bad response {i}")))
                    continue
                out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
                if err == -2 and i == n - 1:  # the last response with the final flag
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    break
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
PLUS = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", (x + 100).astype(np.int32))]))
        return out
"""
IN_ERR = ('input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }, '
          '{ name: "ERR" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
Y = 'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
DEC_STEP = step("dec", {"IN": "IN", "ERR": "ERR"}, {"OUT": "mid"})


def ens_config(name: str, steps: list[str], outputs: str = Y) -> str:
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 0\n{IN_ERR}{outputs}'
            f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n')


def build(repo: Path) -> None:
    write(repo, "dec", 'name: "dec"\nbackend: "python"\nmax_batch_size: 0\n'
          'model_transaction_policy { decoupled: true }\n' + IN_ERR
          + 'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n', DEC)
    write(repo, "plus", 'name: "plus"\nbackend: "python"\nmax_batch_size: 0\n'
          'input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\n' + Y, PLUS)
    write(repo, "ens", ens_config("ens", [DEC_STEP, step("plus", {"X": "mid"}, {"Y": "Y"})]))
    # an ensemble over that one: decoupled too, each of its responses through one more step
    write(repo, "outer", ens_config("outer", [step("ens", {"IN": "IN", "ERR": "ERR"}, {"Y": "Z"}),
                                              step("plus", {"X": "Z"}, {"Y": "Y"})]))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    """The worker has every model the ensemble calls: it would run a plain ensemble itself."""
    repo = tmp_path_factory.mktemp("ens_decoupled") / "repo"
    repo.mkdir()
    build(repo)
    yield from module_server(repo, tmp_path_factory, redis_url, ("dec", "plus", "ens", "outer"))


def events(r: httpx.Response) -> list[dict]:
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = r.text.split("\n\n")
    assert chunks[-1] == ""
    return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


def post(server: Server, route: str, n: int, err: int = -1, model: str = "ens") -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/{route}", content=json.dumps({"IN": n, "ERR": err}),
                      timeout=30)


def ys(docs: list[dict], model: str = "ens") -> list[int]:
    assert all(d["model_name"] == model and d["model_version"] == "1" for d in docs), docs
    return [d["Y"] for d in docs]


def test_each_response_of_the_decoupled_step_is_a_response_of_the_ensemble(server: Server) -> None:
    r = post(server, "generate_stream", 3)
    assert r.status_code == 200, r.text
    assert ys(events(r)) == [100, 101, 102]
    r = post(server, "generate_stream", 1)
    assert r.status_code == 200 and ys(events(r)) == [100]
    r = post(server, "generate_stream", 0)  # no response, then the final flag alone: no event
    assert r.status_code == 200 and r.text == ""
    r = post(server, "generate_stream", 2, err=-2)  # the last response with the final flag goes through too
    assert r.status_code == 200 and ys(events(r)) == [100, 101]
    r = post(server, "generate", 1, err=-2)
    assert r.status_code == 200 and ys([r.json()]) == [100]
    # the gateway runs it: a worker runs only ensembles that answer once
    assert "ensemble ens version 1: run in this worker" not in server.logs()


def test_an_ensemble_over_a_decoupled_ensemble_streams_too(server: Server) -> None:
    config = httpx.get(f"{server.url}/v2/models/outer/config", timeout=10).json()
    assert config["model_transaction_policy"] == {"decoupled": True}
    r = post(server, "generate_stream", 3, model="outer")
    assert r.status_code == 200, r.text
    assert ys(events(r), "outer") == [200, 201, 202]
    r = post(server, "generate_stream", 3, err=1, model="outer")
    assert r.status_code == 200 and ys(events(r)[:1], "outer") == [200]
    assert events(r)[1:] == [{"error": "ensemble 'outer' step 1 (model 'ens'): ensemble 'ens' step 1 (model "
                                       "'dec'): bad response 1"}]


def test_generate_takes_one_response_and_infer_refuses_the_ensemble(server: Server) -> None:
    r = post(server, "generate", 1)
    assert r.status_code == 200 and ys([r.json()]) == [100]
    for n in (0, 3):  # Triton's words (under Despina's 400, as for any decoupled model)
        r = post(server, "generate", n)
        assert r.status_code == 400 and "use generate stream" in r.json()["error"], r.text
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [2]},
                       {"name": "ERR", "datatype": "INT32", "shape": [1], "data": [-1]}]}
    r = httpx.post(f"{server.url}/v2/models/ens/infer", json=body, timeout=30)
    assert r.status_code == 501 and "decoupled" in r.json()["error"], r.text


def test_an_error_response_ends_the_stream_after_the_responses_before_it(server: Server) -> None:
    r = post(server, "generate_stream", 4, err=2)  # Triton: two events, then the error, under a 200
    assert r.status_code == 200, r.text
    docs = events(r)
    assert ys(docs[:2]) == [100, 101] and len(docs) == 3
    assert re.fullmatch(r"ensemble 'ens' step 1 \(model 'dec'\): bad response 2", docs[2]["error"]), docs
    r = post(server, "generate_stream", 3, err=0)  # the error first: a 400 and its event
    assert r.status_code == 400 and [d["error"] for d in events(r)] == [
        "ensemble 'ens' step 1 (model 'dec'): bad response 0"]
    r = post(server, "generate", 3, err=0)
    assert r.status_code == 400 and "bad response 0" in r.json()["error"]


def test_the_ensemble_shows_itself_decoupled_and_counts_each_request_once(server: Server) -> None:
    config = httpx.get(f"{server.url}/v2/models/ens/config", timeout=10).json()
    assert config["model_transaction_policy"] == {"decoupled": True}  # as Triton shows it
    before = settled_stats(server.url, "ens")
    plus_before = settled_stats(server.url, "plus")
    for n, err in ((2, -1), (0, -1), (3, 1)):
        post(server, "generate_stream", n, err)
    after = settled_stats(server.url, "ens")
    stats = after["inference_stats"]
    old = before["inference_stats"]
    assert stats["success"]["count"] - old["success"]["count"] == 2
    assert stats["fail"]["count"] - old["fail"]["count"] == 1
    # the step after the decoupled one ran once per response before the error: 2 + 0 + 1
    plus = settled_stats(server.url, "plus")["inference_stats"]["success"]["count"]
    assert plus - plus_before["inference_stats"]["success"]["count"] == 3


def test_a_plain_ensemble_still_shows_itself_not_decoupled(tmp_path: Path) -> None:
    write(tmp_path, "plain", ens_config("plain", [step("plus", {"X": "IN"}, {"Y": "Y"})],
                                        ).replace(IN_ERR, 'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'))
    config = load_model(tmp_path / "plain").config
    assert config["model_transaction_policy"] == {"decoupled": False}


def spec_of(repo: Path, name: str) -> ModelSpec:
    return ModelSpec.from_config(load_model(repo / name).config)


@pytest.mark.parametrize("steps, outputs, message", [
    # an ensemble output made once, beside the decoupled step's responses
    ([DEC_STEP, step("plus", {"X": "mid"}, {"Y": "Y"}), step("plus", {"X": "IN"}, {"Y": "Z"})],
     Y.replace(" ] }", " ] }, { name: \"Z\" data_type: TYPE_INT32 dims: [ 1 ] }"),
     "ensemble output 'Z' is made by step 3 \\(model 'plus'\\), which is not after decoupled step 1"),
    # a step after the decoupled one that also reads what a step beside it makes
    ([DEC_STEP, step("plus", {"X": "IN"}, {"Y": "side"}), step("pair", {"A": "mid", "B": "side"}, {"Y": "Y"})],
     Y, "step 3 \\(model 'pair'\\) reads 'side' from step 2 \\(model 'plus'\\), which is not after decoupled step 1"),
])
def test_ensembles_whose_other_steps_cannot_follow_each_response_are_refused(
        tmp_path: Path, steps: list[str], outputs: str, message: str) -> None:
    build(tmp_path)
    write(tmp_path, "pair", 'name: "pair"\nbackend: "python"\nmax_batch_size: 0\n'
          'input [ { name: "A" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
          + Y, PLUS)
    write(tmp_path, "bad", ens_config("bad", steps, outputs))
    config = load_model(tmp_path / "bad").config
    specs = {n: spec_of(tmp_path, n) for n in ("dec", "plus", "pair")}
    why = Ensemble.from_config(config).problems(ModelSpec.from_config(config), lambda n: (specs[n], ""))
    assert re.search(message, why), why
    # the good one passes, and not with the response cache on (as Triton refuses it)
    write(tmp_path, "cached", ens_config("cached", [DEC_STEP, step("plus", {"X": "mid"}, {"Y": "Y"})])
          + "response_cache { enable: true }\n")
    cached = load_model(tmp_path / "cached").config
    why = Ensemble.from_config(cached).problems(ModelSpec.from_config(cached), lambda n: (specs[n], ""))
    assert "the response cache does not support it" in why, why
    good = load_model(tmp_path / "ens").config
    assert Ensemble.from_config(good).problems(ModelSpec.from_config(good), lambda n: (specs[n], "")) == ""
