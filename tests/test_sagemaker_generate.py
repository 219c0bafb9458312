"""SageMaker's /invocations as Triton's generate extension (SAGEMAKER_TRITON_INFERENCE_TYPE=generate or
generate_stream; gateway/sagemaker.py), against a real `despina serve --sagemaker` of the example streaming
model, driven as Triton's own SageMaker tests (qa/L0_sagemaker) drive its image."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from despina.embedded import die_with_parent, free_port
from despina.settings import BadSetting, Settings

from .conftest import Server
from .test_generate import events
from .test_sagemaker import multi_model_endpoint, outputs, v2_body

STREAM = "text/event-stream; charset=utf-8"


def llm_repo(example_repository: Path, tmp_path: Path) -> Path:
    """SageMaker's /opt/ml/model of the example streaming model (a decoupled one, as an LLM's is)."""
    shutil.copytree(example_repository / "text_stream", tmp_path / "model" / "text_stream")
    return tmp_path / "model"


def test_the_inference_type_comes_from_sagemakers_variable() -> None:
    assert Settings.from_sources({"sagemaker": True}, {}).sagemaker_inference_type == "infer"
    for kind in ("infer", "generate", "generate_stream"):
        s = Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_TRITON_INFERENCE_TYPE": kind})
        assert s.sagemaker_inference_type == kind
    # DESPINA_* wins; without --sagemaker SageMaker's variable changes nothing
    s = Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_TRITON_INFERENCE_TYPE": "generate",
                                                    "DESPINA_SAGEMAKER_INFERENCE_TYPE": "generate_stream"})
    assert s.sagemaker_inference_type == "generate_stream"
    assert Settings.from_sources({}, {"SAGEMAKER_TRITON_INFERENCE_TYPE": "nonsense"}).sagemaker_inference_type \
        == "infer"
    for bad in ("Generate", "stream", "generate-stream"):
        with pytest.raises(BadSetting, match="SAGEMAKER_TRITON_INFERENCE_TYPE='.*': expected infer, generate "
                                             "or generate_stream"):
            Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_TRITON_INFERENCE_TYPE": bad})
    with pytest.raises(BadSetting, match="DESPINA_SAGEMAKER_INFERENCE_TYPE must be one of infer, generate, "
                                         "generate_stream"):
        Settings.from_sources({"sagemaker": True}, {"DESPINA_SAGEMAKER_INFERENCE_TYPE": "stream"})


def test_an_unknown_inference_type_is_refused_at_start(
        example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # Triton's image stops at start ("ERROR: Invalid SAGEMAKER_TRITON_INFERENCE_TYPE"); Despina ignored the
    # variable and served /invocations as V2 infer, so an LLM endpoint's every request got 400
    repo = llm_repo(example_repository, tmp_path)
    done = subprocess.run([sys.executable, "-m", "despina", "serve", "--sagemaker", "--model-repository",
                           str(repo), "--redis-url", redis_url, "--key-prefix", key_prefix, "--http-port",
                           str(free_port()), "--metrics-port", "0", "--host", "127.0.0.1"],
                          capture_output=True, text=True, timeout=60, preexec_fn=die_with_parent,
                          env={**os.environ, "SAGEMAKER_TRITON_INFERENCE_TYPE": "incorrect_inference_type"})
    assert done.returncode == 2, done.stderr[-2000:]
    said = done.stderr.strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert said == ("despina serve: SAGEMAKER_TRITON_INFERENCE_TYPE='incorrect_inference_type': expected "
                    "infer, generate or generate_stream"), said


def llm_endpoint(serve, example_repository: Path, tmp_path: Path, kind: str, **env: str) -> Server:
    """A single-model endpoint of the example streaming model, /invocations as `kind`."""
    return serve(llm_repo(example_repository, tmp_path), "--sagemaker", "--host", "127.0.0.1",
                 env={"SAGEMAKER_TRITON_INFERENCE_TYPE": kind, **env})


def test_invocations_as_generate(serve, example_repository: Path, tmp_path: Path) -> None:
    server = llm_endpoint(serve, example_repository, tmp_path, "generate")
    assert httpx.get(f"{server.url}/ping").status_code == 200
    call = f"{server.url}/invocations"
    r = httpx.post(call, content=json.dumps({"text_input": "hello", "word_delay_ms": 1}), timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"model_name": "text_stream", "model_version": "1", "text_output": "hello", "index": 0}
    # the model's several responses: /invocations under generate answers with one, and says what streams
    r = httpx.post(call, json={"text_input": "one two", "word_delay_ms": 1}, timeout=30)
    assert r.status_code == 400, r.text
    assert "SAGEMAKER_TRITON_INFERENCE_TYPE=generate_stream" in r.json()["error"], r.text
    # bad bodies: a clear 400, never a 500 (a V2 infer request is no generate request)
    for body, words in ((b"{not json", "JSON"), (b"[1, 2]", "JSON object"),
                        (json.dumps(v2_body()).encode(), "'inputs' is not an input of model 'text_stream'"),
                        (b"{}", "text_input")):
        r = httpx.post(call, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert words in r.json()["error"], (body, r.text)
    # the V2 routes serve as ever beside the contract
    r = httpx.post(f"{server.url}/v2/models/text_stream/generate", json={"text_input": "hi"}, timeout=30)
    assert r.json()["text_output"] == "hi"


def test_invocations_as_generate_stream(serve, example_repository: Path, tmp_path: Path) -> None:
    mine, other = "k" * 24 + "-llm", "k" * 24 + "-mlp"
    server = llm_endpoint(serve, example_repository, tmp_path, "generate_stream",
                          DESPINA_API_KEYS=f"{mine}: text_stream; {other}: mlp", DESPINA_AUTH_INFERENCE="true")
    call, key = f"{server.url}/invocations", {"authorization": f"Bearer {mine}"}
    r = httpx.post(call, content=json.dumps({"text_input": "one two three", "word_delay_ms": 1}),
                   headers={"accept": "text/event-stream", **key}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == STREAM
    assert [(d["model_name"], d["text_output"], d["index"]) for d in events(r)] == \
        [("text_stream", "one", 0), ("text_stream", "two", 1), ("text_stream", "three", 2)]
    # each event as the model sends it, not the whole answer at its end
    with httpx.stream("POST", call, json={"text_input": "a b", "word_delay_ms": 300}, headers=key,
                      timeout=30) as streamed:
        chunks = streamed.iter_raw()
        assert json.loads(next(chunks).removeprefix(b"data: "))["text_output"] == "a"
        assert streamed.headers["content-type"] == STREAM
    # refused before the model ran: a JSON error with its status
    for body, words in ((b"{not json", "JSON"), (b"{}", "text_input")):
        r = httpx.post(call, content=body, headers=key, timeout=30)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json" and words in r.json()["error"], r.text
    # the key's scope is checked against the model /invocations runs, as under infer
    r = httpx.post(call, json={"text_input": "hi"}, headers={"authorization": f"Bearer {other}"}, timeout=30)
    assert r.status_code == 403 and "text_stream" in r.json()["error"], r.text
    assert httpx.post(call, json={"text_input": "hi"}, timeout=30).status_code == 401


def test_invocations_under_infer_names_the_variable_for_a_decoupled_model(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # Triton's default: /invocations is V2 infer, which takes no decoupled model; the error said to call
    # .../generate_stream, a route SageMaker never sends to
    server = llm_endpoint(serve, example_repository, tmp_path, "infer")
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    r = httpx.post(f"{server.url}/invocations", json=body, timeout=30)
    assert r.status_code == 501, r.text  # as V2 infer refuses one, in Triton and here
    assert "SAGEMAKER_TRITON_INFERENCE_TYPE=generate_stream" in r.json()["error"], r.text


def test_a_multi_model_endpoints_invoke_stays_v2_infer(serve, example_repository: Path, tmp_path: Path) -> None:
    # as Triton's image: the inference type is /invocations' alone; /models/{name}/invoke is V2 infer
    server = multi_model_endpoint(serve, tmp_path, SAGEMAKER_TRITON_INFERENCE_TYPE="generate")
    archive = tmp_path / "models" / "0a1b2c" / "model"
    shutil.copytree(example_repository / "add_sub", archive)
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(archive)}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/models/m1/invoke", json=v2_body(), timeout=30)
    assert r.status_code == 200, r.text
    assert outputs(r.json())["sum"] == [2.0, 3.0, 4.0, 5.0]
