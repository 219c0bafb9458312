"""SageMaker's container contract (gateway/sagemaker.py, sagemaker_mme.py): /ping, /invocations, the
multi-model /models API, against a real `despina serve --sagemaker`, driven the way SageMaker and Triton's
own SageMaker tests do (tritonclient builds and parses the binary bodies)."""
from __future__ import annotations

import asyncio
import errno
import gzip
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from despina.embedded import die_with_parent, free_port
from despina.examples import mlp_numpy
from despina.gateway.auth import classify
from despina.gateway.sagemaker_mme import _copy_error, _load_error
from despina.settings import BadSetting, Settings

from .conftest import Server

BINARY = "application/vnd.sagemaker-triton.binary+json;json-header-size="
A = [1.0, 2.0, 3.0, 4.0]
B = [1.0, 1.0, 1.0, 1.0]


def v2_body(a: list[float] = A, b: list[float] = B) -> dict:
    return {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 4], "data": a},
                       {"name": "b", "datatype": "FP32", "shape": [1, 4], "data": b}]}


def outputs(doc: dict) -> dict[str, list[float]]:
    return {o["name"]: o["data"] for o in doc["outputs"]}


def binary_request() -> tuple[bytes, int]:
    inputs = []
    for name, data in (("a", A), ("b", B)):
        t = httpclient.InferInput(name, [1, 4], "FP32")
        t.set_data_from_numpy(np.array([data], np.float32), binary_data=True)
        inputs.append(t)
    wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("sum", "diff")]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs=wanted)
    return body, json_size


def one_model_repo(example_repository: Path, root: Path, name: str = "add_sub") -> Path:
    shutil.copytree(example_repository / "add_sub", root / name)
    return root


def refused_at_start(repo: Path, redis_url: str, key_prefix: str, **env: str) -> str:
    """What `despina serve --sagemaker` of `repo` says as it stops at start (exit 2, one line)."""
    done = subprocess.run([sys.executable, "-m", "despina", "serve", "--sagemaker", "--model-repository",
                           str(repo), "--redis-url", redis_url, "--key-prefix", key_prefix, "--http-port",
                           str(free_port()), "--metrics-port", "0", "--host", "127.0.0.1"],
                          capture_output=True, text=True, timeout=60, preexec_fn=die_with_parent,
                          env={**os.environ, **env})
    assert done.returncode == 2, done.stderr[-2000:]
    said = done.stderr.strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    return said


# -- settings and routing, no server ---------------------------------------------------------------

def test_sagemaker_takes_its_port_folder_and_default_model_from_sagemakers_variables() -> None:
    s = Settings.from_sources({"sagemaker": True}, {})
    assert (s.http_port, s.host, s.model_repository, s.model_control_mode) == \
        (8080, "0.0.0.0", "/opt/ml/model", "none")
    # SageMaker gives an invocation 60 s: Despina's own timeout (and its 504) comes first
    assert s.request_timeout_s == 55.0
    assert Settings.from_sources({"sagemaker": True}, {"DESPINA_REQUEST_TIMEOUT_S": "30"}).request_timeout_s == 30
    assert Settings.from_sources({}, {}).request_timeout_s == 60.0
    s = Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_BIND_TO_PORT": "9090",
                                                    "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "mlp"})
    assert (s.http_port, s.sagemaker_model) == (9090, "mlp")
    # an option or a DESPINA_* variable wins over what SageMaker's variables say
    s = Settings.from_sources({"sagemaker": True, "http_port": 8000},
                              {"SAGEMAKER_BIND_TO_PORT": "9090", "DESPINA_SAGEMAKER_MODEL": "add_sub",
                               "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "mlp"})
    assert (s.http_port, s.sagemaker_model) == (8000, "add_sub")
    s = Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_MULTI_MODEL": "true"})
    assert (s.model_control_mode, s.model_repository) == ("explicit", "/tmp/despina-sagemaker")
    assert Path(s.model_repository).is_dir()
    # without --sagemaker, SageMaker's variables change nothing
    assert Settings.from_sources({}, {"SAGEMAKER_BIND_TO_PORT": "9090"}).http_port == 8000
    with pytest.raises(BadSetting, match="SAGEMAKER_BIND_TO_PORT"):
        Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_BIND_TO_PORT": "eighty"})
    # SageMaker lets a container listen on its port and on SAGEMAKER_SAFE_PORT_RANGE only: metrics go there
    assert Settings.from_sources({"sagemaker": True}, {}).metrics_port == 8002
    assert Settings.from_sources({"sagemaker": True},
                                 {"SAGEMAKER_SAFE_PORT_RANGE": "23000-23999"}).metrics_port == 23000
    assert Settings.from_sources({"sagemaker": True, "metrics_port": 0},
                                 {"SAGEMAKER_SAFE_PORT_RANGE": "23000-23999"}).metrics_port == 0
    for bad in ("23000", "\u00b2-5", "24000-23000"):
        with pytest.raises(BadSetting, match="SAGEMAKER_SAFE_PORT_RANGE"):
            Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_SAFE_PORT_RANGE": bad})
    # batch transform sends payloads up to MaxPayloadInMB (at most 100): the body limit takes it, never less
    # than its own default, and DESPINA_MAX_BODY_BYTES still wins
    mb = 1024 * 1024
    assert Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "100"}).max_body_bytes == \
        100 * mb
    assert Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "6"}).max_body_bytes == \
        64 * mb
    assert Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "100",
                                                       "DESPINA_MAX_BODY_BYTES": "1000"}).max_body_bytes == 1000
    assert Settings.from_sources({}, {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "100"}).max_body_bytes == 64 * mb
    for bad in ("many", "\u00b2", "-5"):
        with pytest.raises(BadSetting, match="SAGEMAKER_MAX_PAYLOAD_IN_MB"):
            Settings.from_sources({"sagemaker": True}, {"SAGEMAKER_MAX_PAYLOAD_IN_MB": bad})


def test_sagemaker_paths_fall_under_the_api_groups_keys_and_restrictions_name() -> None:
    assert classify("/invocations") == ("inference", None, None)
    assert classify("/ping") == ("health", None, None)
    assert classify("/models/m1/invoke") == ("inference", "m1", None)
    assert classify("/models") == ("model-repository", None, None)
    assert classify("/models/m1") == ("model-repository", "m1", None)


# -- a single-model endpoint -------------------------------------------------------------------------

def test_a_single_model_endpoint_answers_ping_and_invocations_json_and_binary(
        serve, example_repository: Path, tmp_path: Path) -> None:
    repo = one_model_repo(example_repository, tmp_path / "model")
    server: Server = serve(repo, "--sagemaker", "--host", "127.0.0.1")
    assert httpx.get(f"{server.url}/ping").status_code == 200

    r = httpx.post(f"{server.url}/invocations", json=v2_body())
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["model_name"] == "add_sub"
    assert outputs(r.json()) == {"sum": [2.0, 3.0, 4.0, 5.0], "diff": [0.0, 1.0, 2.0, 3.0]}

    body, json_size = binary_request()
    r = httpx.post(f"{server.url}/invocations", content=body,
                   headers={"content-type": f"{BINARY}{json_size}"})
    assert r.status_code == 200, r.text
    ctype = r.headers["content-type"]
    assert ctype.startswith(BINARY)
    result = httpclient.InferenceServerClient.parse_response_body(
        r.content, header_length=int(ctype[len(BINARY):]))
    np.testing.assert_array_equal(result.as_numpy("sum"), [[2, 3, 4, 5]])
    np.testing.assert_array_equal(result.as_numpy("diff"), [[0, 1, 2, 3]])
    # gzip, json-header-size counting the body before compression (as Inference-Header-Content-Length)
    packed = httpx.post(f"{server.url}/invocations", content=gzip.compress(body),
                        headers={"content-type": f"{BINARY}{json_size}", "content-encoding": "gzip"})
    assert (packed.status_code, packed.content) == (200, r.content), packed.text

    # bad framing: a clear 400, never a 500
    for ctype, content in ((f"text/plain;{BINARY}{json_size}", body),   # the binary type not first
                           (f"{BINARY}many", body),
                           (f"{BINARY}{len(body) + 1}", body),          # past the body
                           (f"{BINARY}0", body),                        # raw: add_sub has two inputs
                           ("application/json", b"{not json")):
        r = httpx.post(f"{server.url}/invocations", content=content, headers={"content-type": ctype})
        assert r.status_code == 400, (ctype, r.status_code, r.text)
        assert r.json()["error"]
    bad = v2_body()
    bad["inputs"][0]["shape"] = [1, 5]
    r = httpx.post(f"{server.url}/invocations", json=bad)
    assert r.status_code == 400 and "a" in r.json()["error"]
    assert httpx.get(f"{server.url}/invocations").status_code == 405
    # the V2 routes serve as ever beside the contract
    assert httpx.post(f"{server.url}/v2/models/add_sub/infer", json=v2_body()).status_code == 200


def test_a_json_header_size_of_0_is_a_raw_binary_request_as_in_triton(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # json-header-size=0 is Triton's raw binary request, as Inference-Header-Content-Length: 0 is on the V2
    # route: the body is the one input's data, the answer binary. Triton 2.51's SageMaker port answers 200;
    # Despina's answered 400 "json-header-size must be a number from 1 to the body's length"
    repo = tmp_path / "model"
    shutil.copytree(example_repository / "mlp", repo / "mlp")
    server: Server = serve(repo, "--sagemaker", "--host", "127.0.0.1")
    x = np.linspace(-1, 1, 256, dtype=np.float32)
    r = httpx.post(f"{server.url}/invocations", content=x.tobytes(), headers={"content-type": f"{BINARY}0"})
    assert r.status_code == 200, r.text
    ctype = r.headers["content-type"]
    assert ctype.startswith(BINARY)
    result = httpclient.InferenceServerClient.parse_response_body(
        r.content, header_length=int(ctype[len(BINARY):]))
    np.testing.assert_allclose(result.as_numpy("y"), mlp_numpy(x[None]), rtol=1e-5, atol=1e-5)
    # a body not of the input's size: a 400 saying so, as Triton's
    r = httpx.post(f"{server.url}/invocations", content=x.tobytes()[:100], headers={"content-type": f"{BINARY}0"})
    assert r.status_code == 400 and "1024 bytes" in r.json()["error"], r.text


def test_a_single_model_endpoint_refuses_a_model_load_before_copying_anything(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # POST /models copied the archive into /opt/ml/model and only then learnt that loads are refused: the
    # folder stayed, and at the next start the repository had two models, so /invocations and /ping failed
    repo = one_model_repo(example_repository, tmp_path / "model")
    server: Server = serve(repo, "--sagemaker", "--host", "127.0.0.1")
    archive = tmp_path / "models" / "0a1b2c" / "model"
    shutil.copytree(example_repository / "add_sub", archive)
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(archive)}, timeout=60)
    assert r.status_code == 400, r.text
    assert "--model-control-mode explicit" in r.json()["error"]
    assert sorted(p.name for p in repo.iterdir()) == ["add_sub"]
    assert httpx.get(f"{server.url}/ping").status_code == 200


def test_an_archive_of_the_model_folder_itself_is_refused_at_start_saying_the_layout(
        example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # model.tar.gz packed from inside the model's folder (/opt/ml/model/config.pbtxt, /opt/ml/model/1/...):
    # Despina served it as a repository of one model named '1' with no config.pbtxt, and /ping said 400 for
    # ever. Triton's image refuses it at start ("Incorrect directory structure"); so does Despina, saying how
    flat = tmp_path / "model"
    shutil.copytree(example_repository / "add_sub", flat)
    (flat / "config.pbtxt").write_text('name: "add_sub"\n' + (flat / "config.pbtxt").read_text())
    versions_only = tmp_path / "versions"  # no config.pbtxt (Triton's auto-complete), a version folder on top
    shutil.copytree(example_repository / "add_sub" / "1", versions_only / "1")
    for repo, name in ((flat, "add_sub"), (versions_only, "MODEL_NAME")):
        said = refused_at_start(repo, redis_url, key_prefix)
        assert said.startswith(f"despina serve: {repo} is a model's own folder"), said
        assert f"{name}/config.pbtxt" in said and f"{name}/1/" in said, said


def test_a_default_model_the_repository_has_no_folder_for_is_refused_at_start(
        example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # SAGEMAKER_TRITON_DEFAULT_MODEL_NAME misspelt: Despina started, and /ping said 400 until SageMaker gave
    # up on the endpoint; Triton's image stops at start, naming the variable
    repo = one_model_repo(example_repository, tmp_path / "model")
    said = refused_at_start(repo, redis_url, key_prefix, SAGEMAKER_TRITON_DEFAULT_MODEL_NAME="add-sub")
    assert "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME" in said and "'add-sub'" in said and "add_sub" in said, said


def test_a_batch_transform_payload_over_64_mib_is_not_refused_as_too_large(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # SageMaker sets SAGEMAKER_MAX_PAYLOAD_IN_MB to the largest body it sends (MaxPayloadInMB, up to 100):
    # past Despina's default 64 MiB every such mini-batch got 413
    repo = one_model_repo(example_repository, tmp_path / "model")
    server: Server = serve(repo, "--sagemaker", "--host", "127.0.0.1",
                           env={"SAGEMAKER_BATCH": "true", "SAGEMAKER_MAX_PAYLOAD_IN_MB": "80"})
    body = b"[" + b" " * (70 * 1024 * 1024) + b"]"  # read in full, then refused as no V2 request
    r = httpx.post(f"{server.url}/invocations", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert httpx.post(f"{server.url}/invocations", content=b" " * (81 * 1024 * 1024),
                      timeout=60).status_code == 413


def test_a_repository_of_several_models_and_no_default_model_is_refused_at_start(
        serve, example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    # several models and no SAGEMAKER_TRITON_DEFAULT_MODEL_NAME: Despina started, /ping said 400 for ever and
    # SageMaker gave up on the endpoint; Triton's image stops at start ("More than 1 model directory"), and
    # at none ("No model found"); so does Despina, in one line
    repo = one_model_repo(example_repository, tmp_path / "model")
    shutil.copytree(example_repository / "add_sub", repo / "add_sub_too")
    said = refused_at_start(repo, redis_url, key_prefix)
    assert said.startswith(f"despina serve: {repo} holds 2 models (add_sub, add_sub_too)"), said
    assert "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME" in said, said
    empty = tmp_path / "empty"
    (empty / ".hidden").mkdir(parents=True)
    said = refused_at_start(empty, redis_url, key_prefix)
    assert said.startswith(f"despina serve: {empty} holds no model"), said

    # the model named, it serves; the others are there for its ensemble, as in Triton's image
    other: Server = serve(repo, "--sagemaker", "--host", "127.0.0.1",
                          env={"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "add_sub_too"})
    r = httpx.post(f"{other.url}/invocations", json=v2_body())
    assert r.status_code == 200, r.text
    assert r.json()["model_name"] == "add_sub_too"


def test_invocations_needs_a_default_model_when_the_repository_gains_a_second_one(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # what start cannot see: a repository polled for changes that gains a model, /invocations has no model
    repo = one_model_repo(example_repository, tmp_path / "model")
    server: Server = serve(repo, "--sagemaker", "--host", "127.0.0.1", "--model-control-mode", "poll",
                           "--repository-poll-secs", "0.5")
    shutil.copytree(example_repository / "add_sub", repo / "add_sub_too")
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/v2/models/add_sub_too/ready").status_code != 200:
        assert time.monotonic() < deadline, server.logs()[-3000:]
        time.sleep(0.2)
    r = httpx.post(f"{server.url}/invocations", json=v2_body())
    assert r.status_code == 400
    assert "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME" in r.json()["error"]
    assert httpx.get(f"{server.url}/ping").status_code == 400


def test_a_key_limited_to_the_endpoints_model_may_call_invocations(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # /invocations names no model in its path: the key's scope is checked against the model it runs
    repo = one_model_repo(example_repository, tmp_path / "model")
    shutil.copytree(example_repository / "mlp", repo / "mlp")
    mine, other = "k" * 24 + "-add-sub", "k" * 24 + "-mlp"
    server: Server = serve(repo, "--sagemaker", "--host", "127.0.0.1", "--sagemaker-model", "add_sub",
                           wait_models=("add_sub", "mlp"),
                           env={"DESPINA_API_KEYS": f"{mine}: add_sub; {other}: mlp",
                                "DESPINA_AUTH_INFERENCE": "true"})
    call = f"{server.url}/invocations"
    r = httpx.post(call, json=v2_body(), headers={"authorization": f"Bearer {mine}"})
    assert r.status_code == 200, r.text
    r = httpx.post(call, json=v2_body(), headers={"authorization": f"Bearer {other}"})
    assert r.status_code == 403 and "add_sub" in r.json()["error"]
    assert httpx.post(call, json=v2_body()).status_code == 401
    # the key's other routes are as before: its own model's V2 route, not another's
    assert httpx.post(f"{server.url}/v2/models/add_sub/infer", json=v2_body(),
                      headers={"authorization": f"Bearer {mine}"}).status_code == 200
    assert httpx.post(f"{server.url}/v2/models/mlp/infer", json=v2_body(),
                      headers={"authorization": f"Bearer {mine}"}).status_code == 403


# -- a multi-model endpoint --------------------------------------------------------------------------

READY = {"SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "ready"}  # /ping as readiness (a multi-model endpoint's: live)


def multi_model_endpoint(serve, tmp_path: Path, **env: str) -> Server:
    """A server as SageMaker starts one for a multi-model endpoint, staging into tmp_path/staged."""
    (tmp_path / "staged").mkdir()
    return serve(tmp_path / "staged", "--sagemaker", "--host", "127.0.0.1",
                 env={"SAGEMAKER_MULTI_MODEL": "true", **env})


def test_a_multi_model_endpoint_loads_lists_invokes_and_unloads_models(
        serve, example_repository: Path, tmp_path: Path) -> None:
    url = multi_model_endpoint(serve, tmp_path).url
    assert httpx.get(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/models").json() == {"models": []}

    # as SageMaker unpacks an archive: /opt/ml/models/<hash>/model/<the model's folder>
    archive = tmp_path / "models" / "0a1b2c" / "model"
    shutil.copytree(example_repository / "add_sub", archive / "add_sub")
    config = archive / "add_sub" / "config.pbtxt"
    config.write_text('name: "add_sub"\n' + config.read_text())  # the model's name, not the one it loads as
    r = httpx.post(f"{url}/models", json={"model_name": "m1", "url": str(archive)}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/models", json={"model_name": "m1", "url": str(archive)}).status_code == 409

    # SageMaker names the model by the hash it chose (m1 here) and sends InvokeEndpoint's TargetModel along:
    # the answer names the TargetModel, the name the client gave, as Triton's image answers (it loads the
    # model under that name); the hash was all a client saw
    target = {"X-Amzn-SageMaker-Target-Model": "team-a/add_sub.tar.gz"}
    r = httpx.post(f"{url}/models/m1/invoke", json=v2_body(), headers=target)
    assert r.status_code == 200, r.text
    assert outputs(r.json())["sum"] == [2.0, 3.0, 4.0, 5.0]
    assert r.json()["model_name"] == "team-a/add_sub.tar.gz"
    assert httpx.get(f"{url}/v2/models/m1/config").json()["name"] == "m1"  # the config takes the name
    # its errors name the TargetModel too, not the hash the client never sent (Triton's name the model it
    # loads under the TargetModel); the V2 route's name the model as loaded
    unknown = v2_body()
    unknown["inputs"][1]["name"] = "c"
    for bad in ({"inputs": v2_body()["inputs"][:1]}, unknown):
        r = httpx.post(f"{url}/models/m1/invoke", json=bad, headers=target)
        said = r.json()["error"]
        assert r.status_code == 400 and "'team-a/add_sub.tar.gz'" in said and "m1" not in said, r.text
        assert "'m1'" in httpx.post(f"{url}/v2/models/m1/infer", json=bad).json()["error"]
    body, json_size = binary_request()
    for _ in range(2):  # the second answer's JSON header is the one remembered for the request's shape
        r = httpx.post(f"{url}/models/m1/invoke", content=body,
                       headers={"content-type": f"{BINARY}{json_size}", **target})
        assert r.status_code == 200 and r.headers["content-type"].startswith(BINARY)
        header = r.content[:int(r.headers["content-type"].rsplit("=", 1)[1])]
        assert orjson.loads(header)["model_name"] == "team-a/add_sub.tar.gz"
    # without the header (a test on one's own machine) the answer names SageMaker's name, as Triton's does;
    # the V2 route names the model as loaded
    r = httpx.post(f"{url}/models/m1/invoke", content=body, headers={"content-type": f"{BINARY}{json_size}"})
    assert orjson.loads(r.content[:int(r.headers["content-type"].rsplit("=", 1)[1])])["model_name"] == "m1"
    assert httpx.post(f"{url}/v2/models/m1/infer", json=v2_body()).json()["model_name"] == "m1"

    # a second model, from a folder that is the model itself; the list pages
    second = tmp_path / "models" / "3d4e5f" / "model"
    shutil.copytree(example_repository / "add_sub", second)
    assert httpx.post(f"{url}/models", json={"model_name": "m2", "url": str(second)},
                      timeout=60).status_code == 200
    both = [{"modelName": "m1", "modelUrl": str(archive)}, {"modelName": "m2", "modelUrl": str(second)}]
    assert httpx.get(f"{url}/models").json() == {"models": both}
    first = httpx.get(f"{url}/models", params={"max_results": 1}).json()
    assert first == {"models": both[:1], "nextPageToken": "1"}
    assert httpx.get(f"{url}/models", params={"max_results": 1, "next_page_token": 1}).json() == \
        {"models": both[1:]}
    for bad in ("x", "\u00b2", "-1"):  # a superscript digit once gave 500 (str.isdigit takes it)
        assert httpx.get(f"{url}/models", params={"max_results": bad}).status_code == 400
        assert httpx.get(f"{url}/models", params={"next_page_token": bad}).status_code == 400
    assert httpx.get(f"{url}/models/m1").json() == both[0]

    assert httpx.delete(f"{url}/models/m1", timeout=60).status_code == 200
    assert httpx.get(f"{url}/models/m1").status_code == 404
    assert httpx.delete(f"{url}/models/m1").status_code == 404
    # SageMaker's contract: invoking a model that is not loaded is a 404 (it was a 400, "not loaded")
    r = httpx.post(f"{url}/models/m1/invoke", json=v2_body())
    assert r.status_code == 404 and "not loaded" in r.json()["error"], r.text
    r = httpx.post(f"{url}/models/m1/invoke", json=v2_body(), headers=target)
    assert r.status_code == 404 and r.json()["error"] == "model 'team-a/add_sub.tar.gz' is not loaded", r.text
    assert httpx.get(f"{url}/models").json() == {"models": both[1:]}
    # loaded again after its unload
    assert httpx.post(f"{url}/models", json={"model_name": "m1", "url": str(archive)},
                      timeout=60).status_code == 200
    assert httpx.post(f"{url}/models/m1/invoke", json=v2_body()).status_code == 200


async def test_loads_of_one_new_name_at_once_load_it_once(serve, example_repository: Path, tmp_path: Path) -> None:
    """Two loads of one name at once both found it free: both staged its files into one folder (a mix, for
    archives that differ) and both answered 200. One loads it now; the others get 409 at once."""
    url = multi_model_endpoint(serve, tmp_path).url
    archives = []
    for i in range(3):
        archive = tmp_path / "models" / f"a{i}" / "model"
        shutil.copytree(example_repository / "add_sub", archive)
        archives.append(archive)
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(*(client.post(f"{url}/models", json={"model_name": "m1", "url": str(a)})
                                         for a in archives))
    assert sorted(a.status_code for a in answers) == [200, 409, 409], [a.text for a in answers]
    (won,) = [str(a) for a, r in zip(archives, answers) if r.status_code == 200]
    assert httpx.get(f"{url}/models").json() == {"models": [{"modelName": "m1", "modelUrl": won}]}
    assert httpx.post(f"{url}/models/m1/invoke", json=v2_body()).status_code == 200
    # the claim goes with the load: unloaded, the name may be loaded again
    assert httpx.delete(f"{url}/models/m1", timeout=60).status_code == 200
    assert httpx.post(f"{url}/models", json={"model_name": "m1", "url": won}, timeout=60).status_code == 200


def test_an_archive_of_an_ensemble_and_its_models_loads_as_one_endpoint_model(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # as Triton's SageMaker front end reads an archive of several models: the ensemble is the endpoint's
    # model, the models it calls load beside it under their own names, and go with it
    url = multi_model_endpoint(serve, tmp_path, **READY).url
    archive = tmp_path / "models" / "9f8e7d" / "model"
    for name in ("mlp_classify", "mlp", "classify_post"):
        shutil.copytree(example_repository / name, archive / name)
    r = httpx.post(f"{url}/models", json={"model_name": "pipeline", "url": str(archive)}, timeout=120)
    assert r.status_code == 200, r.text
    x = np.ones((1, 256), np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": x.ravel().tolist()}]}
    r = httpx.post(f"{url}/models/pipeline/invoke", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert outputs(r.json())["label"] == [int(mlp_numpy(x).argmax())]
    assert httpx.get(f"{url}/models").json() == {"models": [{"modelName": "pipeline", "modelUrl": str(archive)}]}
    # the same models again under another name: Triton's 409, nothing loaded twice
    r = httpx.post(f"{url}/models", json={"model_name": "again", "url": str(archive)}, timeout=60)
    assert r.status_code == 409 and "classify_post" in r.json()["error"]

    assert httpx.delete(f"{url}/models/pipeline", timeout=60).status_code == 200
    states = {row["name"]: row.get("state") for row in httpx.post(f"{url}/v2/repository/index").json()}
    assert states["pipeline"] == states["mlp"] == states["classify_post"] == "UNAVAILABLE"
    assert sorted((tmp_path / "staged").iterdir()) == []  # their copies with them, the steps' too
    assert httpx.get(f"{url}/ping").status_code == 200
    # and loaded again after that
    r = httpx.post(f"{url}/models", json={"model_name": "pipeline", "url": str(archive)}, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/models/pipeline/invoke", json=body, timeout=30).status_code == 200


def test_a_multi_model_endpoint_refuses_bad_loads_with_400(
        serve, example_repository: Path, tmp_path: Path) -> None:
    server = multi_model_endpoint(serve, tmp_path)
    repo = tmp_path / "staged"
    two = tmp_path / "two"
    for name in ("x", "y"):
        shutil.copytree(example_repository / "add_sub", two / name)
    good = str(two / "x")
    twice = tmp_path / "twice"  # two ensembles: which is the endpoint's model?
    for name in ("mlp_classify", "other"):
        shutil.copytree(example_repository / "mlp_classify", twice / name)
    (twice / "other" / "config.pbtxt").write_text(
        (twice / "other" / "config.pbtxt").read_text().replace('name: "mlp_classify"', 'name: "other"'))
    odd = tmp_path / "odd" / "\u00b2"  # str.isdigit() takes '²' for a version folder; int() does not
    odd.mkdir(parents=True)
    (odd / "model.onnx").write_bytes(b"x")
    for doc in ({}, {"model_name": "m"}, {"url": good}, {"model_name": 5, "url": good},
                {"model_name": "a b/c", "url": good},
                {"model_name": "m", "url": "/proc/self"},
                {"model_name": "m", "url": str(tmp_path / "missing")},
                {"model_name": "m", "url": str(two)},                # two models, neither the archive's
                {"model_name": "m", "url": str(twice)},              # two ensembles
                {"model_name": "m", "url": str(tmp_path)},           # no model at all: nothing is copied
                {"model_name": "m", "url": str(odd.parent)}):
        r = httpx.post(f"{server.url}/models", json=doc)
        assert r.status_code == 400, (doc, r.status_code, r.text)
        assert r.json()["error"]
    assert not (repo / "m").exists()  # refused before anything was copied
    r = httpx.post(f"{server.url}/models", content=b"{oops")
    assert r.status_code == 400
    assert httpx.get(f"{server.url}/models").json() == {"models": []}
    assert httpx.post(f"{server.url}/models/nothing/invoke", json=v2_body()).status_code == 404


def test_a_model_no_worker_has_room_for_gets_507_and_leaves_the_endpoint_healthy(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # SageMaker answers 507 by unloading other models and trying again; a load left waiting for a worker
    # would keep /ping failing, and SageMaker would replace the instance
    server = multi_model_endpoint(serve, tmp_path, **READY, DESPINA_WORKER_MEMORY_MB="512")
    big = tmp_path / "big" / "model" / "add_sub"
    shutil.copytree(example_repository / "add_sub", big)
    with (big / "config.pbtxt").open("a") as f:
        f.write('parameters { key: "memory_mb" value { string_value: "100000" } }\n')
    started = time.monotonic()
    r = httpx.post(f"{server.url}/models", json={"model_name": "big", "url": str(big.parent)}, timeout=30)
    assert r.status_code == 507, r.text
    assert time.monotonic() - started < 20  # at once, not after the load timeout (300 s)
    assert "MiB" in r.json()["error"]
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/models").json() == {"models": []}
    small = tmp_path / "small" / "model"
    shutil.copytree(example_repository / "add_sub", small)
    r = httpx.post(f"{server.url}/models", json={"model_name": "small", "url": str(small)}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/ping").status_code == 200


def test_a_multi_model_endpoint_refuses_the_name_of_a_model_the_v2_api_loaded(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # the staged repository's own add_sub, loaded through the repository API: an archive under its name
    # would overwrite the files it loads from, and its V2 clients would reach another model (it did: 200)
    server = multi_model_endpoint(serve, tmp_path)
    shutil.copytree(example_repository / "add_sub", tmp_path / "staged" / "add_sub")
    before = {p.relative_to(tmp_path / "staged"): p.read_bytes()
              for p in (tmp_path / "staged").rglob("*") if p.is_file()}
    r = httpx.post(f"{server.url}/v2/repository/models/add_sub/load", timeout=60)
    assert r.status_code == 200, r.text
    other = tmp_path / "models" / "4b5c6d" / "model"
    shutil.copytree(example_repository / "mlp", other)
    r = httpx.post(f"{server.url}/models", json={"model_name": "add_sub", "url": str(other)}, timeout=60)
    assert r.status_code == 409, r.text
    assert "already loaded" in r.json()["error"]
    after = {p.relative_to(tmp_path / "staged"): p.read_bytes()
             for p in (tmp_path / "staged").rglob("*") if p.is_file()}
    assert after == before
    inputs = [i["name"] for i in httpx.get(f"{server.url}/v2/models/add_sub").json()["inputs"]]
    assert inputs == ["a", "b"]
    assert httpx.get(f"{server.url}/models").json() == {"models": []}


def test_a_model_whose_load_failed_may_be_loaded_again_under_its_name(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # SageMaker retries a failed load under the same model_name; a load that failed left the name
    # taken (409 "already loaded") and its invocations answered 503 for good
    server = multi_model_endpoint(serve, tmp_path, **READY)
    broken = tmp_path / "models" / "1a2b3c" / "model"
    shutil.copytree(example_repository / "add_sub", broken)
    for onnx in broken.rglob("*.onnx"):
        onnx.write_bytes(b"not a model")
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(broken)}, timeout=60)
    assert r.status_code == 400, r.text
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/models/m1/invoke", json=v2_body()).status_code == 404
    good = tmp_path / "models" / "4d5e6f" / "model"
    shutil.copytree(example_repository / "add_sub", good)
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(good)}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/models/m1/invoke", json=v2_body())
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/models").json() == {"models": [{"modelName": "m1", "modelUrl": str(good)}]}



def test_an_unloaded_models_copy_leaves_the_repository_and_so_does_a_failed_loads(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # SageMaker loads and unloads model after model on one instance, and frees the disk of those it
    # unloads: Triton's image unregisters an unloaded (or failed) model's repository, and its index is
    # empty after. Despina's copies stayed in the staged repository for good, one per model ever loaded,
    # until the disk filled
    server = multi_model_endpoint(serve, tmp_path, **READY)
    staged = tmp_path / "staged"
    archive = tmp_path / "models" / "0a1b2c" / "model"
    shutil.copytree(example_repository / "add_sub", archive / "add_sub")
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(archive)}, timeout=60)
    assert r.status_code == 200, r.text
    assert (staged / "m1" / "config.pbtxt").is_file()
    assert httpx.delete(f"{server.url}/models/m1", timeout=60).status_code == 200
    assert sorted(staged.iterdir()) == []
    # loaded again from its archive after that, as SageMaker does
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(archive)}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/models/m1/invoke", json=v2_body()).status_code == 200

    broken = tmp_path / "models" / "1a2b3c" / "model"
    shutil.copytree(example_repository / "add_sub", broken)
    for onnx in broken.rglob("*.onnx"):
        onnx.write_bytes(b"not a model")
    r = httpx.post(f"{server.url}/models", json={"model_name": "m2", "url": str(broken)}, timeout=60)
    assert r.status_code == 400, r.text
    assert [p.name for p in staged.iterdir()] == ["m1"]
    assert httpx.post(f"{server.url}/models/m1/invoke", json=v2_body()).status_code == 200


def test_a_failed_load_removes_only_the_folders_it_made(serve, example_repository: Path, tmp_path: Path) -> None:
    # a failed load takes back what it staged, and only that: a folder of that name already in the repository
    # (left by an earlier gateway, or staged by another load of the same step) is not the failed load's to
    # delete; it was removed whole
    server = multi_model_endpoint(serve, tmp_path, **READY)
    kept = tmp_path / "staged" / "m2"
    kept.mkdir(parents=True)
    (kept / "notes.txt").write_text("not this load's")
    broken = tmp_path / "models" / "1a2b3c" / "model"
    shutil.copytree(example_repository / "add_sub", broken)
    for onnx in broken.rglob("*.onnx"):
        onnx.write_bytes(b"not a model")
    r = httpx.post(f"{server.url}/models", json={"model_name": "m2", "url": str(broken)}, timeout=60)
    assert r.status_code == 400, r.text
    assert (kept / "notes.txt").read_text() == "not this load's"


def test_a_load_whose_files_cannot_be_copied_is_a_400_and_leaves_nothing(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # a file of the archive that cannot be copied (here a named pipe) raised an OSError out of the load:
    # a 500 "internal error", and the half-copied folder stayed in the staged repository
    server = multi_model_endpoint(serve, tmp_path)
    archive = tmp_path / "models" / "0a1b2c" / "model"
    shutil.copytree(example_repository / "add_sub", archive / "add_sub")
    os.mkfifo(archive / "add_sub" / "1" / "weights.bin")
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(archive)}, timeout=60)
    assert r.status_code == 400 and "named pipe" in r.json()["error"], r.text
    assert sorted((tmp_path / "staged").iterdir()) == []
    (archive / "add_sub" / "1" / "weights.bin").unlink()
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(archive)}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_copy_that_fills_the_disk_is_a_507() -> None:
    # a full disk is Triton's 507 ("No space left on device"): SageMaker unloads others and retries
    full = _load_error(_copy_error(OSError(errno.ENOSPC, "No space left on device"), "/a"), "m1", None)
    assert full.status_code == 507 and b"No space left on device" in full.body
    assert _load_error(_copy_error(OSError(errno.EIO, "I/O error"), "/a"), "m1", None).status_code == 400


def test_a_multi_model_endpoints_load_errors_name_the_target_model(
        serve, example_repository: Path, tmp_path: Path) -> None:
    # Triton's image loads a model under InvokeEndpoint's TargetModel, which SageMaker sends with the load
    # too: its load errors name that, as our invoke errors do; they named the hash the client never saw
    server = multi_model_endpoint(serve, tmp_path)
    archive = tmp_path / "models" / "0a1b2c" / "model"
    shutil.copytree(example_repository / "add_sub", archive)
    target = {"X-Amzn-SageMaker-Target-Model": "team-a/add_sub.tar.gz"}
    load = {"model_name": "m1", "url": str(archive)}
    assert httpx.post(f"{server.url}/models", json=load, headers=target, timeout=60).status_code == 200
    r = httpx.post(f"{server.url}/models", json=load, headers=target, timeout=60)
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "model 'team-a/add_sub.tar.gz' is already loaded"
    r = httpx.post(f"{server.url}/models", json=load, timeout=60)  # without it (one's own machine): the hash
    assert r.status_code == 409 and r.json()["error"] == "model 'm1' is already loaded", r.text

    bad = tmp_path / "models" / "3d4e5f" / "model"
    shutil.copytree(example_repository / "add_sub", bad)
    config = bad / "config.pbtxt"
    with config.open("a") as f:
        f.write('dynamic_batching { preferred_batch_size: [ 64 ] }\n')  # over max_batch_size 8
    r = httpx.post(f"{server.url}/models", json={"model_name": "m2", "url": str(bad)}, timeout=60,
                   headers={"X-Amzn-SageMaker-Target-Model": "team-b/bad.tar.gz"})
    said = r.json()["error"]
    assert r.status_code == 400 and "'team-b/bad.tar.gz'" in said and "'m2'" not in said, r.text
    assert "preferred_batch_size" in said


OUT_OF_MEMORY_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        first = pb_utils.get_input_tensor_by_name(requests[0], "x").as_numpy()[0]
        if first > 1:
            raise RuntimeError("the weights are on fire")
        if first > 0:
            raise MemoryError("out of memory allocating the activations")
        return [pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
            "CUDA out of memory. Tried to allocate 2.00 GiB")) for _ in requests]
"""


def test_a_models_out_of_memory_failure_answers_an_invoke_or_a_load_with_507(serve, tmp_path: Path) -> None:
    # SageMaker's multi-model contract: 507 says the instance has no memory for the model, and SageMaker
    # unloads others and tries again. Triton's image answers an invoke whose model failed for memory (its
    # list of the frameworks' words: "out of memory", "MemoryError", "CUDA out of memory", ...) with 507;
    # Despina answered 500 and SageMaker went on sending it requests it could not serve
    server = multi_model_endpoint(serve, tmp_path)
    archive = tmp_path / "models" / "0a1b2c" / "model" / "greedy"
    (archive / "1").mkdir(parents=True)
    (archive / "1" / "model.py").write_text(OUT_OF_MEMORY_MODEL)
    (archive / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')
    r = httpx.post(f"{server.url}/models", json={"model_name": "m1", "url": str(archive.parent)}, timeout=60)
    assert r.status_code == 200, r.text

    def invoke(x: float, path: str = "/models/m1/invoke") -> httpx.Response:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [x]}]}
        return httpx.post(f"{server.url}{path}", json=body, timeout=30)

    for x, said in ((1.0, "MemoryError: out of memory"), (-1.0, "CUDA out of memory")):
        r = invoke(x)
        assert r.status_code == 507 and said in r.json()["error"], r.text
        assert invoke(x, "/v2/models/m1/infer").status_code == 500  # the V2 route's as before
    r = invoke(2.0)  # any other failure of the model stays what it was
    assert r.status_code == 500 and "on fire" in r.json()["error"], r.text

    # a load that fails for memory too (Triton's 507; Despina's was a 400), and leaves the endpoint healthy
    (archive / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n"
        "        raise MemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')\n")
    r = httpx.post(f"{server.url}/models", json={"model_name": "m2", "url": str(archive.parent)}, timeout=60)
    assert r.status_code == 507 and "CUDA out of memory" in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/models").json()["models"] == [{"modelName": "m1", "modelUrl": str(archive.parent)}]


def test_ping_mode_is_triton_images_ready_on_a_single_model_endpoint_live_on_a_multi_model_one() -> None:
    # Triton's serve script sets the ping mode from SAGEMAKER_TRITON_OVERRIDE_PING_MODE, else ready on a
    # single-model endpoint and live on a multi-model one (a failed load must not fail /ping, or SageMaker
    # loads nothing more); Despina read SAGEMAKER_TRITON_PING_MODE alone and answered ready on both
    def mode(env: dict[str, str], **args: str) -> str:
        return Settings.from_sources({"sagemaker": True, **args}, env).sagemaker_ping_mode
    mme = {"SAGEMAKER_MULTI_MODEL": "true"}
    assert (mode({}), mode(mme)) == ("ready", "live")
    assert mode({"SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "live"}) == "live"
    assert mode({**mme, "SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "ready"}) == "ready"
    # tritonserver's own variable (what the script sets) where the script's is not set; the script's wins
    assert mode({**mme, "SAGEMAKER_TRITON_PING_MODE": "ready"}) == "ready"
    assert mode({"SAGEMAKER_TRITON_PING_MODE": "live", "SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "ready"}) == "ready"
    # Despina's own setting wins over both
    assert mode({**mme, "SAGEMAKER_TRITON_OVERRIDE_PING_MODE": "live"}, sagemaker_ping_mode="ready") == "ready"
    assert mode({**mme, "DESPINA_SAGEMAKER_PING_MODE": "ready"}) == "ready"
    assert Settings.from_sources({}, mme).sagemaker_ping_mode == "ready"  # without --sagemaker: nothing
    for variable in ("SAGEMAKER_TRITON_OVERRIDE_PING_MODE", "SAGEMAKER_TRITON_PING_MODE"):
        with pytest.raises(BadSetting, match=variable):
            Settings.from_sources({"sagemaker": True}, {variable: "sometimes"})


@pytest.mark.parametrize("mode", ["ready", None])
def test_ping_mode_live_answers_200_while_a_model_loads(
        serve, example_repository: Path, tmp_path: Path, mode: str | None) -> None:
    # ping mode live answers /ping by liveness, so a multi-model endpoint stays healthy while a load runs,
    # as Triton's image answers by default there; Despina answered 400 during every load
    env = {"SAGEMAKER_TRITON_OVERRIDE_PING_MODE": mode} if mode else {}
    server = multi_model_endpoint(serve, tmp_path, **env)
    slow = tmp_path / "models" / "5f6a7b" / "model"
    shutil.copytree(example_repository / "add_sub_python", slow)
    script = slow / "1" / "model.py"
    hold = tmp_path / "hold"  # the model's initialize waits while it is there
    script.write_text(script.read_text().replace(
        "    def initialize(self, args):\n",
        "    def initialize(self, args):\n        import os, time\n"
        f"        while os.path.exists({str(hold)!r}):\n            time.sleep(0.05)\n"))
    hold.touch()
    with httpx.Client(timeout=60) as client:
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(client.post, f"{server.url}/models", json={"model_name": "slow", "url": str(slow)})
            while "LOADING" not in client.post(f"{server.url}/v2/repository/index").text:
                assert not load.done(), load.result().text
            pinged = client.get(f"{server.url}/ping").status_code
            deadline = time.monotonic() + 10  # the index said LOADING; the gateway's view may show it later
            while mode == "ready" and pinged == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
                pinged = client.get(f"{server.url}/ping").status_code
            hold.unlink()
            assert load.result().status_code == 200, load.result().text
    assert pinged == (400 if mode == "ready" else 200)
    assert httpx.get(f"{server.url}/ping").status_code == 200


@pytest.mark.parametrize("case", ["failed", "serving"])
def test_ping_fails_on_a_single_model_endpoint_without_a_model_to_invoke(
        serve, example_repository: Path, tmp_path: Path, case: str) -> None:
    # Triton's image does not start without the endpoint's model; a /ping of 200 had SageMaker take the
    # endpoint for healthy and send every invocation to a 4xx or 503 (a default model with no folder at all
    # stops the start: test_a_default_model_the_repository_has_no_folder_for_is_refused_at_start; several
    # and none named too; one gained later: test_invocations_needs_a_default_model_when_the_repository_...)
    repo = one_model_repo(example_repository, tmp_path / "model")
    extra: tuple[str, ...] = ()
    if case == "serving":
        shutil.copytree(example_repository / "add_sub", repo / "add_sub_too")
        extra = ("--sagemaker-model", "add_sub_too")
    if case == "failed":
        for onnx in repo.rglob("*.onnx"):
            onnx.write_bytes(b"not a model")
    server = serve(repo, "--sagemaker", "--host", "127.0.0.1", *extra,
                   wait_models=("add_sub_too",) if case == "serving" else ())
    invoked = httpx.post(f"{server.url}/invocations", json=v2_body()).status_code
    assert (invoked, httpx.get(f"{server.url}/ping").status_code) == {
        "failed": (503, 400), "serving": (200, 200)}[case]
