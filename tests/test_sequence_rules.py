"""Triton's sequence batcher rules, checked one by one against a real `despina serve`: the control
tensors' values and data types, the correlation ID's type against the CORRID control's, a sequence
closed by its END, Direct's queue delay, and the implicit state's load-time checks (test_sequence.py
has the batcher's main paths)."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina.contract.errors import ConfigError

from .conftest import FULL_QUEUE_DELAY, Server, module_server, settled_stats
from .test_sequence import spec

# answers with each control input it got: its data type, shape and value; sleeps when x < 0, so that a
# test can hold a request in the model
SHOWS = '''
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

CONTROLS = ("START", "END", "READY", "CORRID")


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = float(pb_utils.get_input_tensor_by_name(request, "x").as_numpy().ravel()[0])
            if x < 0:
                time.sleep(-x)
            got = {}
            for name in CONTROLS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    value = tensor.as_numpy()
                    first = value.ravel()[0]
                    got[name] = [str(value.dtype), list(value.shape),
                                 first.decode() if isinstance(first, bytes) else first.item()]
            got["rows"] = len(requests)  # the batch it ran in (Direct's empty rows included)
            out = np.array([[json.dumps(got).encode()]], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("got", out)]))
        return responses
'''
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "got" data_type: TYPE_STRING dims: [ 1 ] }} ]
sequence_batching {{
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START {start} }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ -1.5, 2.5 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid} }} ] }}
  ]
  {strategy}
}}
"""
MODELS = {
    "numbered": dict(start="int32_false_true: [ 7, 9 ]", corrid="TYPE_UINT64", strategy="oldest { }"),
    # Direct's delay only counts with minimum_slot_utilization (Triton's DirectSequenceBatch): here none
    "named": dict(start="bool_false_true: [ false, true ]", corrid="TYPE_STRING",
                  strategy="direct { max_queue_delay_microseconds: 10000000 }"),
    # Oldest with a queue delay
    "delayed": dict(start="int32_false_true: [ 0, 1 ]", corrid="TYPE_UINT64",
                    strategy="oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 500000 }"),
    # a batch of 4 slots goes once 2 hold a request (0.5), or once its oldest waited 2 s (its sequences
    # never idle out under a loaded test run)
    "utilized": dict(start="int32_false_true: [ 0, 1 ]", corrid="TYPE_UINT64",
                     strategy="max_sequence_idle_microseconds: 60000000 "
                     "direct { max_queue_delay_microseconds: 2000000 minimum_slot_utilization: 0.5 }"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("sequence-rules-repo")
    for name, fields in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(SHOWS)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, **fields))
    # Triton's batching to the letter: a batch waits out its delay even when no request can join it
    yield from module_server(root, tmp_path_factory, redis_url, tuple(MODELS), env=FULL_QUEUE_DELAY)


def infer(server: Server, model: str, x: float, **parameters: Any) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}],
            "parameters": parameters}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)


def controls(r: httpx.Response) -> dict[str, list[Any]]:
    assert r.status_code == 200, r.text
    got: dict[str, list[Any]] = json.loads(r.json()["outputs"][0]["data"][0])
    got.pop("rows")
    return got


def rows(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(json.loads(r.json()["outputs"][0]["data"][0])["rows"])


def test_the_control_tensors_have_the_configs_values_and_data_types(server: Server) -> None:
    """int32_false_true, fp32_false_true and bool_false_true give INT32, FP32 and BOOL tensors of the
    configured values, shape [1, 1] for a batching model; CORRID is the ID in the control's type."""
    first = controls(infer(server, "numbered", 1.0, sequence_id=2**63 + 5, sequence_start=True))
    assert first == {"START": ["int32", [1, 1], 9], "END": ["float32", [1, 1], -1.5],
                     "READY": ["bool", [1, 1], True], "CORRID": ["uint64", [1, 1], 2**63 + 5]}
    last = controls(infer(server, "numbered", 1.0, sequence_id=2**63 + 5, sequence_end=True))
    assert (last["START"][2], last["END"][2]) == (7, 2.5)
    got = controls(infer(server, "named", 1.0, sequence_id="session-a", sequence_start=True, sequence_end=True))
    assert got["START"] == ["bool", [1, 1], True] and got["CORRID"] == ["object", [1, 1], "session-a"]


def test_an_id_of_the_wrong_type_for_the_corrid_control_is_refused_with_tritons_message(server: Server) -> None:
    """Triton refuses a string ID where CORRID is a number and a number where it is TYPE_STRING
    (qa/L0_sequence_corrid_batcher): it does not turn the number into text."""
    r = infer(server, "numbered", 1.0, sequence_id="abc", sequence_start=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == ("sequence batching control 'CORRID' data-type is 'BYTES', but model "
                                 "'numbered' expects 'UINT64'")
    r = infer(server, "named", 1.0, sequence_id=42, sequence_start=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == ("sequence batching control 'CORRID' data-type is 'UINT64', but model "
                                 "'named' expects 'BYTES'")


def test_a_request_the_sequence_batcher_refuses_is_no_failure_in_the_statistics(server: Server) -> None:
    """Triton 2.51 refuses these before its scheduler queues them: get_inference_statistics counts no
    failure for them, nor its metrics, and they were never pending."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    x = httpclient.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[1.0]], np.float32))
    try:
        before = settled_stats(server.url, "numbered")
        for wrong in ({"sequence_id": 31337},  # a new sequence without START
                      {"sequence_id": "abc", "sequence_start": True}):  # the wrong type for CORRID
            with pytest.raises(InferenceServerException) as raised:
                client.infer("numbered", [x], **wrong)
            assert raised.value.status() == "400"
        client.infer("numbered", [x], sequence_id=31338, sequence_start=True, sequence_end=True)
        after = settled_stats(server.url, "numbered")
        assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
        assert after["inference_stats"]["fail"] == before["inference_stats"]["fail"]
        metrics = httpx.get(server.metrics_url, timeout=10).text
        failures = [line for line in metrics.splitlines()
                    if line.startswith('nv_inference_request_failure{model="numbered"')]
        assert len(failures) == 4 and all(line.endswith("} 0") for line in failures), failures
        assert 'nv_inference_pending_request_count{model="numbered",version="1"} 0' in metrics
    finally:
        client.close()


def test_a_sequence_ends_when_its_end_request_comes_not_when_it_has_run(server: Server) -> None:
    """Triton forgets a sequence's ID as its END request is queued: a request after it that does not
    START a new sequence is refused at once, though the END has not run yet; one that does, starts it."""
    assert infer(server, "numbered", 1.0, sequence_id=4242, sequence_start=True).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        ending = pool.submit(infer, server, "numbered", -1.5, sequence_id=4242, sequence_end=True)  # 1.5 s
        time.sleep(0.5)
        r = infer(server, "numbered", 1.0, sequence_id=4242)
        assert r.status_code == 400, r.text  # (it waited for the END, then ran in the ended sequence)
        assert not ending.done()
        assert r.json()["error"] == ("inference request for sequence 4242 to model 'numbered' must specify "
                                     "the START flag on the first request of the sequence")
        again = infer(server, "numbered", 1.0, sequence_id=4242, sequence_start=True)
        assert controls(ending.result(timeout=30))["END"][2] == 2.5
    assert controls(again)["START"][2] == 9
    assert infer(server, "numbered", 1.0, sequence_id=4242, sequence_end=True).status_code == 200


def test_directs_queue_delay_does_not_hold_a_request_without_minimum_slot_utilization(server: Server) -> None:
    """Triton's Direct strategy waits max_queue_delay_microseconds only to reach minimum_slot_utilization;
    with none (0, the default) a ready request runs at once. `named` has a 10 s delay."""
    began = time.monotonic()
    r = infer(server, "named", 1.0, sequence_id="quick", sequence_start=True, sequence_end=True)
    assert r.status_code == 200, r.text
    assert time.monotonic() - began < 5.0  # it waited out the 10 s delay before
    assert spec("direct { max_queue_delay_microseconds: 5000 }").sequence.max_queue_delay_us == 0
    assert spec("oldest { max_queue_delay_microseconds: 5000 }").sequence.max_queue_delay_us == 5000


def test_directs_batch_goes_once_minimum_slot_utilization_is_reached(server: Server) -> None:
    """Triton's DirectSequenceBatch runs a batch once ready slots / max_batch_size reaches
    minimum_slot_utilization, or once its oldest request waited max_queue_delay_microseconds: with 0.5 of
    4 slots, a second sequence's request sends the first's at once; one alone waits out the 2 s."""
    began = time.monotonic()
    assert rows(infer(server, "utilized", 1.0, sequence_id=61, sequence_start=True)) == 1
    assert time.monotonic() - began >= 1.9  # alone: 1 of 4 slots, short of 0.5
    with ThreadPoolExecutor(2) as pool:
        began = time.monotonic()
        first = pool.submit(infer, server, "utilized", 2.0, sequence_id=62, sequence_start=True)
        time.sleep(0.3)
        second = pool.submit(infer, server, "utilized", 3.0, sequence_id=63, sequence_start=True)
        answers = first.result(timeout=30), second.result(timeout=30)
    assert time.monotonic() - began < 1.5  # 2 of 4 slots ready: they went at once, not after 2 s
    assert [rows(r) for r in answers] == [3, 3]  # sequence 61's slot, not ready, and theirs
    with ThreadPoolExecutor(3) as pool:
        ends = [pool.submit(infer, server, "utilized", 9.0, sequence_id=s, sequence_end=True) for s in (61, 62, 63)]
        assert [f.result(timeout=30).status_code for f in ends] == [200] * 3


def test_oldests_queue_delay_counts_from_when_a_request_may_run_not_from_its_arrival(server: Server) -> None:
    """Triton's Oldest hands a sequence's request to its dynamic batcher once the one before has run, and
    the queue delay counts from there (DynamicBatchScheduler::Enqueue captures the batcher start again,
    "in the case of oldest sequence batcher, this will overwrite the value"): an END that came 0.2 s
    after a request of 0.5 s delay and 1 s run waited 0.5 s more in Triton 2.51 (answered at 2.0 s),
    none in Despina (at 1.5 s, with it)."""
    assert infer(server, "delayed", 1.0, sequence_id=71, sequence_start=True).status_code == 200
    done: dict[str, float] = {}

    def timed(name: str, x: float, **parameters: Any) -> httpx.Response:
        r = infer(server, "delayed", x, sequence_id=71, **parameters)
        done[name] = time.monotonic()
        return r

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(timed, "slow", -1.0)  # waits the 0.5 s delay, then runs 1 s
        time.sleep(0.2)
        end = pool.submit(timed, "end", 1.0, sequence_end=True)
        assert controls(slow.result(timeout=30))["END"][2] == -1.5
        assert controls(end.result(timeout=30))["END"][2] == 2.5
    assert done["end"] - done["slow"] >= 0.4, done  # its own 0.5 s delay, counted from 1.5 s


@pytest.mark.parametrize("initial, why", [
    ('data_type: TYPE_FP32 dims: [ 2 ] zero_data: true', "Field 'name' must be set when using initial_state"),
    ('data_type: TYPE_FP32 name: "z" zero_data: true', "Number of dimensions in 'initial_state' doesn't match"),
    ('data_type: TYPE_FP32 dims: [ 3 ] name: "z" zero_data: true', "'initial_state' dim for input name 'S' "
     "doesn't match 'state' dim description. 3 != 2"),
])
def test_an_initial_state_is_checked_against_its_state_as_triton_checks_it(initial: str, why: str) -> None:
    """Triton refuses these at load; Despina loaded them, and the first START fed the model a state of
    the wrong shape (or, without dims, the state's)."""
    with pytest.raises(ConfigError, match=why):
        spec(f'state [ {{ input_name: "S" output_name: "T" data_type: TYPE_FP32 dims: [ 2 ] '
             f'initial_state: {{ {initial} }} }} ]')
    ok = spec('state [ { input_name: "S" output_name: "T" data_type: TYPE_FP32 dims: [ -1 ] '
              'initial_state: { data_type: TYPE_FP32 dims: [ 3 ] name: "z" zero_data: true } } ]')
    assert ok.sequence is not None and ok.sequence.states[0].initial_dims == (3,)


def test_state_buffer_hints_are_accepted() -> None:
    """use_same_buffer_for_input_output and use_growable_memory only tell Triton how to place the state
    in memory; a config with them loads."""
    s = spec('state [ { input_name: "S" output_name: "T" data_type: TYPE_FP32 dims: [ -1 ] '
             'use_same_buffer_for_input_output: true use_growable_memory: true } ]')
    assert s.sequence is not None and s.sequence.states[0].dims == (-1,)


def test_minimum_slot_utilization_becomes_the_batch_sizes_that_go_at_once() -> None:
    """Triton compares ready / max_batch_size with minimum_slot_utilization in float32; the sizes that reach
    it are Direct's preferred sizes (spec() has max_batch_size 4). Without a delay nothing waits."""
    def sizes(utilization: str, delay: int = 1000) -> tuple[tuple[int, ...], int]:
        policy = spec(f"direct {{ max_queue_delay_microseconds: {delay} minimum_slot_utilization: {utilization} }}")
        assert policy.sequence is not None
        return policy.sequence.preferred, policy.sequence.max_queue_delay_us
    assert sizes("0.5") == ((2, 3, 4), 1000)
    assert sizes("0.3") == ((2, 3, 4), 1000)  # 1/4 is short of 0.3
    assert sizes("0.25") == ((1, 2, 3, 4), 1000)
    assert sizes("0.75") == ((3, 4), 1000) and sizes("1") == ((4,), 1000)
    assert sizes("0") == ((), 0) and sizes("0.5", delay=0)[1] == 0


@pytest.mark.parametrize("given, shown", [(1.5, "1.5"), (True, "True"), (2**64, "18446744073709551616")])
def test_a_correlation_id_that_is_no_id_says_what_an_id_must_be(server: Server, given: Any, shown: str) -> None:
    """Triton answers these with a 500 ("attempt to access JSON non-string as string"); Despina said a
    non-zero ID was missing, though one was given."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
                       "parameters": {"sequence_id": given, "sequence_start": True}})
    r = httpx.post(f"{server.url}/v2/models/numbered/infer", content=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"] in (f"parameter 'sequence_id' must be an unsigned integer or a string, got {shown}",
                                 f"parameter 'sequence_id' {shown} is outside the range of a uint64")
