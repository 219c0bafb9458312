"""Corners of Triton's `triton_python_backend_utils` API that a model.py may use, each with a real model
against a real `despina serve` (or the model's own process, through the repository's loader): what a
request tells its model (its timeout), the names of Triton's classes a model may annotate or check with
isinstance, and auto_complete_config's checks of the config it completes.

Every model.py here is written against Triton's documented `triton_python_backend_utils` API only.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from despina.contract.catalog import CatalogEntry
from despina.contract.errors import ConfigError, DespinaError
from despina.contract.keys import Keys
from despina.control.repository import load_model

from .conftest import Server, module_server
from .test_backend_python import backend_for, write_model

# Each request's timeout (µs) as the model reads it.
TIMEOUTS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("T", np.array([r.timeout()], np.uint64))])
                for r in requests]
'''
TIMEOUTS_CONFIG = '''name: "timeouts"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "T", data_type: TYPE_UINT64, dims: [ 1 ] } ]
'''

# Calls `timeouts` with a timeout of 30.000007 s: T is what the called model read, OWN its own request's.
CALLS_TIMEOUTS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="timeouts", requested_output_names=["T"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "X")], timeout=30_000_007)
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            own = pb_utils.Tensor("OWN", np.array([request.timeout()], np.uint64))
            responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(answer, "T"), own]))
        return responses
'''
CALLS_TIMEOUTS_CONFIG = TIMEOUTS_CONFIG.replace('"timeouts"', '"calls_timeouts"').replace(
    'output [ { name: "T", data_type: TYPE_UINT64, dims: [ 1 ] } ]',
    'output [ { name: "T", data_type: TYPE_UINT64, dims: [ 1 ] }, '
    '{ name: "OWN", data_type: TYPE_UINT64, dims: [ 1 ] } ]')

# Names Triton's classes in annotations that run when model.py is imported, and checks what its
# request's sender, a decoupled call's iterator and the memory types are.
NAMES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


def answer(sender: pb_utils.InferenceResponseSender, checks: list) -> None:
    flags = np.array(checks, dtype=bool)
    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OK", flags)]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def first(responses: pb_utils.ResponseIterator) -> pb_utils.InferenceResponse:
    return next(iter(responses))


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="timeouts", requested_output_names=["T"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "X")],
                preferred_memory=pb_utils.PreferredMemory(pb_utils.MemoryType.TRITONSERVER_MEMORY_CPU))
            responses = call.exec(decoupled=True)
            checks = [isinstance(responses, pb_utils.ResponseIterator), not first(responses).has_error(),
                      isinstance(request.get_response_sender(), pb_utils.InferenceResponseSender),
                      pb_utils.TRITONSERVER_MEMORY_CPU == pb_utils.MemoryType.TRITONSERVER_MEMORY_CPU,
                      pb_utils.TRITONSERVER_MEMORY_GPU == pb_utils.MemoryType.TRITONSERVER_MEMORY_GPU]
            answer(request.get_response_sender(), checks)
        return None
'''
NAMES_CONFIG = '''name: "names"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OK", data_type: TYPE_BOOL, dims: [ 5 ] } ]
'''

# What Triton's stub tells a model about itself and its requests, as JSON (a BYTES output): the model's
# folder (get_model_dir: auto_complete_config checks it, initialize tells it), and a request's asked outputs and
# parameters as the model reads them.
ABOUT = '''
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils



class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):  # (in a process of its own: it cannot tell execute what it saw)
        if not os.path.isfile(os.path.join(pb_utils.get_model_dir(), "model.py")):
            raise ValueError(f"get_model_dir() is {pb_utils.get_model_dir()!r} in auto_complete_config")
        return config

    def initialize(self, args):
        self.about = {"initialize": pb_utils.get_model_dir(),
                      "version_dir": os.path.join(args["model_repository"], args["model_version"])}

    def execute(self, requests):
        responses = []
        for request in requests:
            asked = request.requested_output_names()
            about = dict(self.about, asked=sorted(asked), asked_type=type(asked).__name__,
                         parameters=request.parameters())
            text = np.array([json.dumps(about).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ABOUT", text)]))
        return responses
'''
ABOUT_CONFIG = '''name: "about"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "ABOUT", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("api-repo")
    write_model(root, "timeouts", TIMEOUTS, TIMEOUTS_CONFIG)
    write_model(root, "calls_timeouts", CALLS_TIMEOUTS, CALLS_TIMEOUTS_CONFIG)
    write_model(root, "names", NAMES, NAMES_CONFIG)
    write_model(root, "about", ABOUT, ABOUT_CONFIG)
    yield from module_server(root, tmp_path_factory, redis_url, ("timeouts", "calls_timeouts", "names", "about"))


def infer(server: Server, model: str, **parameters: Any) -> dict[str, list[Any]]:
    body: dict[str, Any] = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    if parameters:
        body["parameters"] = parameters
    response = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return {o["name"]: o["data"] for o in response.json()["outputs"]}


def test_a_request_tells_its_model_the_timeout_its_client_asked_for(server: Server) -> None:
    """Triton's request.timeout(): the request's timeout in µs (the client's `timeout` parameter), 0 when
    it asked for none. It was always 0."""
    assert infer(server, "timeouts", timeout=25_000_000) == {"T": [25_000_000]}
    assert infer(server, "timeouts") == {"T": [0]}


def test_a_model_call_gives_the_called_request_its_timeout(server: Server) -> None:
    """Triton sets a BLS request's timeout on the request it makes: the called model reads it. It read 0."""
    assert infer(server, "calls_timeouts", timeout=20_000_000) == {"T": [30_000_007], "OWN": [20_000_000]}


def test_a_model_naming_tritons_sender_iterator_and_memory_types_loads_and_runs(server: Server) -> None:
    """pb_utils.InferenceResponseSender, ResponseIterator and MemoryType are Triton's names: a model.py
    whose annotations use them failed to import (AttributeError), so it could not load."""
    assert infer(server, "names") == {"OK": [True] * 5}


def about(server: Server, **body: Any) -> dict[str, Any]:
    body["inputs"] = [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1.0]}]
    response = httpx.post(f"{server.url}/v2/models/about/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return json.loads(response.json()["outputs"][0]["data"][0])


def test_a_model_knows_its_folder(server: Server) -> None:
    """Triton's pb_utils.get_model_dir() (the folder of the model's model.py: its version folder), in
    auto_complete_config and after. pb_utils had no get_model_dir: a model calling it failed to load."""
    seen = about(server)
    assert seen["initialize"] == seen["version_dir"]
    assert os.path.isfile(os.path.join(seen["initialize"], "model.py"))


def test_a_request_tells_its_model_the_outputs_asked_for_and_its_parameters_as_triton_does(
        server: Server) -> None:
    """Triton 2.51's requested_output_names() is a set (a model may not rely on their order), and
    parameters() compact JSON of the client's own parameters (those Triton reads itself left out). They
    were a list, and JSON with spaces."""
    seen = about(server, outputs=[{"name": "ABOUT"}],
                 parameters={"i": 3, "f": 1.5, "b": True, "s": "x", "priority": 0, "timeout": 5_000_000})
    assert (seen["asked"], seen["asked_type"]) == (["ABOUT"], "set")
    assert seen["parameters"] == '{"i":3,"f":1.5,"b":true,"s":"x"}'


def test_a_model_call_through_redis_gives_the_called_request_its_timeout(
        serve: Any, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The same call with the caller and the called model on two workers (room for one model each): the
    request written to the called model's stream carries the timeout."""
    memory = 'parameters { key: "memory_mb" value: { string_value: "100" } }\n'
    write_model(tmp_path / "repo", "timeouts", TIMEOUTS, TIMEOUTS_CONFIG + memory)
    write_model(tmp_path / "repo", "calls_timeouts", CALLS_TIMEOUTS, CALLS_TIMEOUTS_CONFIG + memory)
    far = serve(tmp_path / "repo", "--workers", "2", env={"DESPINA_WORKER_MEMORY_MB": "150"},
                wait_models=("timeouts", "calls_timeouts"))
    client = redis.Redis.from_url(redis_url)
    try:
        placed = [CatalogEntry.loads(client.hget(Keys(key_prefix).catalog, name)).workers
                  for name in ("timeouts", "calls_timeouts")]
    finally:
        client.close()
    assert not set(placed[0]) & set(placed[1]), placed
    assert infer(far, "calls_timeouts") == {"T": [30_000_007], "OWN": [0]}


# auto_complete_config adds an input the config declares, with another `optional`.
OPTIONAL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [1], "optional": True})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1]})
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, np.float32))]) for _ in requests]
'''


def test_auto_complete_may_not_change_whether_a_declared_input_is_optional(tmp_path: Path) -> None:
    """Triton's ModelConfig.add_input refuses an input whose `optional` differs from the config's (which
    lists every field, so an input of config.pbtxt says false); it was taken, the input made optional."""
    declared = 'name: "optional"\nbackend: "python"\ninput [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
    with pytest.raises(ConfigError, match="the model expects optional True but the model configuration "
                                          "specifies optional False") as refused:
        load_model(write_model(tmp_path / "declared", "optional", OPTIONAL, declared))
    # named once (it read "model 'optional': auto_complete_config failed: model 'optional': auto_complete
    # failed: ValueError: ...")
    assert refused.value.message.startswith("model 'optional': auto_complete_config failed: ValueError: ")
    bare = 'name: "optional"\nbackend: "python"\n'
    entry = load_model(write_model(tmp_path / "bare", "optional", OPTIONAL, bare))
    assert [(i["name"], i.get("optional")) for i in entry.config["input"]] == [("X", True)]


def test_auto_complete_that_returns_no_model_config_is_refused_in_tritons_words(tmp_path: Path) -> None:
    """An auto_complete_config that forgets `return config` fails the load as Triton's does; Despina's
    message was its own ("auto_complete_config must return the ModelConfig it was given")."""
    forgets = OPTIONAL.replace("        return config\n", "")
    with pytest.raises(ConfigError) as refused:
        load_model(write_model(tmp_path, "forgets", forgets, 'name: "forgets"\nbackend: "python"\n'))
    assert refused.value.message == ("model 'forgets': auto_complete_config failed: auto_complete_config "
                                     "function in model 'forgets' must return a valid pb.ModelConfig object.")


def test_a_line_logged_by_auto_complete_names_its_model(tmp_path: Path,
                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """pb_utils.Logger prefixes the model's name; in auto_complete_config it read "model '': ..." (the name
    was set for initialize only). Triton 2.51 logs it there too ("model.py:6] ac-logger-line")."""
    logs = OPTIONAL.replace("        return config\n", "        pb_utils.Logger.log_info('completing')\n"
                            "        return config\n", 1)
    load_model(write_model(tmp_path, "logs", logs, 'name: "logs"\nbackend: "python"\n'))
    assert [line.split("INFO ", 1)[1] for line in capfd.readouterr().err.splitlines()
            if line.endswith("completing")] == ["model 'logs': completing"]


# auto_complete_config writing to as_dict() beyond what ModelConfig's methods set.
WRITES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1]})
        written = config.as_dict()
        written["max_batch_size"] = 4
        written["dynamic_batching"] = {"max_queue_delay_microseconds": 77, "preferred_batch_size": [2]}
        written["parameters"] = {"k": {"string_value": "v"}}
        written["version_policy"] = {"all": {}}
        written["instance_group"] = [{"count": 3, "kind": "KIND_CPU"}]
        written["response_cache"] = {"enable": True}
        written["optimization"] = {"priority": "PRIORITY_MAX"}
        written["metric_tags"] = {"a": "b"}
        written["model_warmup"] = [{"name": "w", "batch_size": 1, "inputs": {
            "X": {"data_type": "TYPE_FP32", "dims": [1], "zero_data": True}}}]
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, np.float32))]) for _ in requests]
'''


def test_auto_complete_changes_only_the_fields_triton_takes_from_it(tmp_path: Path) -> None:
    """Triton 2.51 takes max_batch_size, the inputs and outputs, the scheduler (dynamic or sequence
    batching) and the transaction policy from what auto_complete_config returns, and keeps the rest of the
    config as config.pbtxt gave it (seen on GET .../config for this model.py). Despina took everything:
    the model's parameters, version policy, instance groups (3 instances), response cache, optimization,
    metric tags and warmup."""
    entry = load_model(write_model(tmp_path, "writes", WRITES, 'name: "writes"\nbackend: "python"\n'))
    config = entry.config
    assert config["max_batch_size"] == 4 and [i["name"] for i in config["input"]] == ["X"]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 77
    assert config["dynamic_batching"]["preferred_batch_size"] == [2]
    assert config["parameters"] == {} and config["version_policy"] == {"latest": {"num_versions": 1}}
    assert [(g["name"], g["count"]) for g in config["instance_group"]] == [("writes", 1)]
    assert "response_cache" not in config and config["metric_tags"] == {} and config["model_warmup"] == []
    assert config["optimization"]["priority"] == "PRIORITY_DEFAULT"


SHADOW = "raise ImportError(\"the model's own {name} was imported in place of Despina's\")\n"


def test_a_models_own_modules_cannot_shadow_pb_utils_private_modules(tmp_path: Path) -> None:
    """pb_utils is split into private modules beside it (_despina_*); the model's folders go first on
    sys.path, so a file of the model's with one of their names would win if one were imported after the
    model's folders are there. The stub imports them all before: the model's own never runs."""
    folder = write_model(tmp_path, "optional", OPTIONAL, 'name: "optional"\nbackend: "python"\n')
    stub = Path(__file__).parent.parent / "despina" / "workers" / "backends" / "python_stub"
    for module in sorted(stub.glob("_despina_*.py")) + [stub / "triton_python_backend_utils.py"]:
        for place in (folder, folder / "1"):
            (place / module.name).write_text(SHADOW.format(name=module.name))
    entry = load_model(folder)
    assert [(i["name"], i.get("optional")) for i in entry.config["input"]] == [("X", True)]


# Makes a response of a numpy array, not a Tensor (line 7), then asks pb_utils for what is not there.
NOT_A_TENSOR = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([np.zeros(1, np.float32)]) for _ in requests]
'''


def test_a_models_mistake_inside_pb_utils_is_shown_at_the_models_line(tmp_path: Path) -> None:
    """An exception raised inside pb_utils by the model's call is shown where the model made that call, as
    Triton's traceback shows the model's line; it was shown at pb_utils' own line (_despina_requests.py)."""
    config = ('name: "m"\nbackend: "python"\nmax_batch_size: 0\n'
              'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
              'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    backend: Any = backend_for(write_model(tmp_path, "m", NOT_A_TENSOR, config))
    backend.load()
    try:
        [failed] = backend.execute_requests([{"X": np.zeros(1, np.float32)}], [["Y"]])
    finally:
        backend.unload()
    assert isinstance(failed, DespinaError)
    assert failed.message == ("model 'm': execute failed: TypeError: InferenceResponse: output_tensors must be "
                              "pb_utils.Tensor objects, not ndarray (model.py:7)")
