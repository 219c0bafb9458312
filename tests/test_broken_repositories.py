"""Broken model configs and repositories, each held against what Triton 2.51 answers for it: the broken
model is UNAVAILABLE with a reason that says what to fix, and the others serve on."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from despina.contract.errors import ConfigError
from despina.control.repository import load_model

from .conftest import Server
from .control_support import index

MODEL_PY = """import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
"""
IO = ('input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
      'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')


def python_model(root: Path, name: str, extra: str = "", io: str = IO, model: str = MODEL_PY,
                 versions: tuple[str, ...] = ("1",)) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.pbtxt").write_text(f'backend: "python"\nmax_batch_size: 8\n{io}{extra}')
    for v in versions:
        (folder / v).mkdir()
        (folder / v / "model.py").write_text(model)
    return folder


def test_a_tensor_without_dims_is_refused_as_triton_refuses_it(tmp_path: Path) -> None:
    # Triton 2.51: "model input 'INPUT0' must specify 'dims' for m"; Despina loaded it and served it
    folder = python_model(tmp_path, "m", io=IO.replace(" dims: [ 4 ] } ]\noutput", " } ]\noutput"))
    with pytest.raises(ConfigError, match=r"model 'm': input 'INPUT0' must specify 'dims' \(a scalar per "
                                          r"row: dims \[ 1 \] with reshape \{ shape: \[ \] \}\)"):
        load_model(folder)
    folder = python_model(tmp_path, "n", io=IO.replace(" dims: [ 4 ] } ]\n", " } ]\n").replace(
        'TYPE_FP32 } ]\noutput', 'TYPE_FP32 dims: [ 4 ] } ]\noutput'))
    with pytest.raises(ConfigError, match=r"model 'n': output 'OUTPUT0' must specify 'dims'"):
        load_model(folder)


def test_an_empty_reshape_of_a_model_that_does_not_batch_is_refused(tmp_path: Path) -> None:
    # Triton 2.51: "model input 'INPUT0' cannot have empty reshape for non-batching model as scalar tensors
    # are not supported"; Despina loaded it
    io = IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ 1 ] reshape: { shape: [ ] } } ]\noutput")
    folder = python_model(tmp_path, "m", io=io)
    folder.joinpath("config.pbtxt").write_text(f'backend: "python"\nmax_batch_size: 0\n{io}')
    with pytest.raises(ConfigError, match=r"model 'm': input 'INPUT0' cannot have empty reshape for "
                                          r"non-batching model as scalar tensors are not supported"):
        load_model(folder)
    folder.joinpath("config.pbtxt").write_text(f'backend: "python"\nmax_batch_size: 8\n{io}')
    assert load_model(folder).config["input"][0]["reshape"] == {"shape": []}  # a scalar per row of a batch: served


def test_a_version_policy_that_chooses_nothing_serves_every_version(tmp_path: Path) -> None:
    # Triton 2.51 reads "version_policy { }" as all { } (VersionsToLoad: specific, latest, else all) and served
    # versions 1 and 2; Despina served the latest alone
    folder = python_model(tmp_path, "m", extra="version_policy { }\n", versions=("1", "2"))
    assert load_model(folder).versions == (1, 2)


def test_latest_with_no_versions_selects_none_as_triton_says(tmp_path: Path) -> None:
    # Triton 2.51: "at least one version must be available under the version policy of model 'm'";
    # Despina took num_versions 0 for 1 and served version 1
    for policy in ("latest: { num_versions: 0 }", "latest { }"):
        folder = python_model(tmp_path / policy, "m", extra=f"version_policy: {{ {policy} }}\n")
        with pytest.raises(ConfigError, match=r"model 'm': field 'version_policy.latest.num_versions' is 0: "
                                              r"no version is selected \(at least one version must be available "
                                              r"under the version policy\)"):
            load_model(folder)


def test_a_config_pbtxt_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    # Triton 2.51 ends (std::length_error: basic_string::_M_replace_aux, signal 6) on loading it; Despina
    # took the model for one without a config and auto-completed it
    folder = python_model(tmp_path, "m")
    (folder / "config.pbtxt").unlink()
    (folder / "config.pbtxt").mkdir()
    with pytest.raises(ConfigError, match=r"model 'm': config.pbtxt is a folder, not a file"):
        load_model(folder)


def test_broken_models_are_unavailable_with_their_reasons_and_the_others_serve(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "ok")
    python_model(repo, "syntax", model="def broken(:\n")
    python_model(repo, "nodims", io=IO.replace(" dims: [ 4 ] } ]\noutput", " } ]\noutput"))
    server = serve(repo, "--model-control-mode", "explicit")
    answers = {name: httpx.post(f"{server.url}/v2/repository/models/{name}/load", timeout=60)
               for name in ("syntax", "nodims", "ok")}
    assert answers["ok"].status_code == 200, answers["ok"].text
    assert {n: r.status_code for n, r in answers.items()} == {"syntax": 400, "nodims": 400, "ok": 200}
    rows = {r["name"]: r for r in index(server.url)}
    assert rows["ok"]["state"] == "READY"
    # Triton 2.51: "SyntaxError: invalid syntax (model.py, line 1)"; Despina added a place inside Python's
    # import machinery: "... (model.py, line 1) (<frozen importlib._bootstrap>:241)"
    assert rows["syntax"]["state"] == "UNAVAILABLE"
    assert rows["syntax"]["reason"].endswith("initialize failed: SyntaxError: invalid syntax (model.py, line 1)"), rows
    assert rows["nodims"]["state"] == "UNAVAILABLE"
    assert "input 'INPUT0' must specify 'dims'" in rows["nodims"]["reason"], rows


def test_a_model_that_fails_again_says_its_new_reason(serve: Callable[..., Server], tmp_path: Path) -> None:
    # Triton 2.51's index gives the latest load's reason; Despina's kept the first failure's: a model that
    # never served was put back as it was after its second load failed, with the first load's reason
    repo = tmp_path / "repo"
    folder = python_model(repo, "m", model="def broken(:\n")
    server = serve(repo, "--model-control-mode", "explicit")

    def load_and_reason() -> tuple[int, str]:
        r = httpx.post(f"{server.url}/v2/repository/models/m/load", timeout=60)
        row = next(row for row in index(server.url) if row["name"] == "m")
        return r.status_code, f"{row['state']}: {row.get('reason', '')}"

    status, reason = load_and_reason()
    assert status == 400 and reason.startswith("UNAVAILABLE: ") and "SyntaxError" in reason, reason
    (folder / "1" / "model.py").write_text("import no_such_module_of_h13\n")
    status, reason = load_and_reason()
    assert status == 400 and "No module named 'no_such_module_of_h13'" in reason, reason
    (folder / "1" / "model.py").write_text(MODEL_PY)
    assert load_and_reason() == (200, "READY: ")


def test_dynamic_batching_of_a_model_that_does_not_batch_loads_and_runs_each_request_alone(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    # Triton 2.51 loads it READY (its dynamic batcher queues such a model's requests, one at a time: the
    # queue policy applies); Despina refused it: "field 'dynamic_batching' needs max_batch_size > 0"
    repo = tmp_path / "repo"
    folder = python_model(repo, "m", extra="dynamic_batching { max_queue_delay_microseconds: 100 "
                                           "default_queue_policy { max_queue_size: 4 } }\n")
    (folder / "config.pbtxt").write_text((folder / "config.pbtxt").read_text()
                                         .replace("max_batch_size: 8", "max_batch_size: 0"))
    assert load_model(folder).config["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    server = serve(repo, "--model-control-mode", "explicit")
    r = httpx.post(f"{server.url}/v2/repository/models/m/load", timeout=60)
    assert r.status_code == 200, r.text
    body = {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    r = httpx.post(f"{server.url}/v2/models/m/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [4] and r.json()["outputs"][0]["data"] == [1, 2, 3, 4]


def test_a_model_py_that_is_a_folder_is_a_config_error(tmp_path: Path) -> None:
    # Despina answered the load with a 500 ("control plane: load failed: [Errno 21] Is a directory") and
    # listed the model with no state; Triton 2.51: 400, UNAVAILABLE "ModuleNotFoundError: No module named
    # '1.model'"
    folder = python_model(tmp_path, "m", versions=())
    (folder / "1" / "model.py").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"model 'm': model file .*/m/1/model.py is not a file"):
        load_model(folder)


def test_an_instance_count_below_1_is_1_as_in_triton(tmp_path: Path) -> None:
    # Triton 2.51 loads "count: -1" READY with count 1 (its config shows it so: a count below 1 is 1);
    # Despina refused it: "field 'instance_group.count' must be >= 0"
    folder = python_model(tmp_path, "m", extra="instance_group [ { count: -1 kind: KIND_CPU } ]\n")
    assert [g["count"] for g in load_model(folder).config["instance_group"]] == [1]


def test_two_tensors_of_one_name_are_refused_in_words_that_say_so(tmp_path: Path) -> None:
    # Triton 2.51 loads both: two inputs named alike answer every request 400 "expected 2 inputs but got 1
    # inputs" (and "input 'INPUT0' already exists in request" to one that gives it twice): unusable; two
    # outputs alike answer with one, and the metadata lists it twice. Despina refuses both at load, and said
    # "input 'INPUT0': field 'name' appears twice"
    one = '{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }'
    folder = python_model(tmp_path, "m", io=IO.replace(one, f"{one}, {one}"))
    with pytest.raises(ConfigError, match=r"^model 'm': two inputs are named 'INPUT0' \(a request could not "
                                          r"tell them apart\)$"):
        load_model(folder)
    one = one.replace("INPUT0", "OUTPUT0")
    folder = python_model(tmp_path, "n", io=IO.replace(one, f"{one}, {one}"))
    with pytest.raises(ConfigError, match=r"^model 'n': two outputs are named 'OUTPUT0' \(a response could "
                                          r"not tell them apart\)$"):
        load_model(folder)
    # an input and an output of one name are two tensors, as in Triton 2.51, which serves them
    folder = python_model(tmp_path, "o", io=IO.replace('"INPUT0"', '"OUTPUT0"'))
    assert [t["name"] for t in (*load_model(folder).config["input"], *load_model(folder).config["output"])] == [
        "OUTPUT0", "OUTPUT0"]


def test_a_config_pbtxt_with_a_byte_order_mark_is_refused_in_words_that_name_it(tmp_path: Path) -> None:
    # Triton 2.51 refuses it too ("Interpreting non ascii codepoint 239", "failed to read text proto");
    # Despina said "1:1 : '\ufeffbackend: ...': Expected identifier or number, got \ufeff." (an invisible mark)
    folder = python_model(tmp_path, "m")
    (folder / "config.pbtxt").write_bytes(b"\xef\xbb\xbf" + (folder / "config.pbtxt").read_bytes())
    with pytest.raises(ConfigError, match=r"^model 'm': invalid config.pbtxt: it begins with a byte order mark "
                                          r"\(U\+FEFF\), which Triton's parser refuses too: save it as UTF-8 "
                                          r"without one$"):
        load_model(folder)
    crlf = python_model(tmp_path, "crlf")  # Windows line ends are read, as Triton reads them
    (crlf / "config.pbtxt").write_bytes((crlf / "config.pbtxt").read_bytes().replace(b"\n", b"\r\n"))
    assert load_model(crlf).config["max_batch_size"] == 8
