"""API keys, Triton's restricted-API headers, model-name checks and limits: the policy alone, the
middleware around a bare app, then a real `despina serve` with keys configured, called with curl-style
requests and with tritonclient's `headers` argument."""
from __future__ import annotations

import base64
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina.contract.errors import ConfigError, InvalidArgument, NotFound
from despina.gateway import http
from despina.gateway.auth import (
    AuthPolicy,
    Guard,
    Target,
    check_target,
    classify,
    parse_keys,
    parse_restricted_api,
)
from despina.settings import Settings

from .conftest import Server, module_server

ADMIN = "admin-0123456789abcdef0123456789abcdef"
SCOPED = "scoped-fedcba9876543210fedcba9876543210"   # add_sub only
TRITON_HEADER, TRITON_VALUE = "admin-key", "triton-admin-value-42"


def bearer(key: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}  # a fresh dict: tritonclient adds its own headers to it


ROW = [0.5] * 256


def policy(**settings: object) -> AuthPolicy:
    return AuthPolicy.from_settings(Settings(**settings))  # type: ignore[arg-type]


# ---- parsing keys and restrictions -----------------------------------------------------------------

def test_key_entries_from_text() -> None:
    keys = parse_keys(f"# operators\n{ADMIN}\n{SCOPED}: add_sub, mlp ; other-key-0123456789:x", "test")
    assert [k.models for k in keys] == [None, frozenset({"add_sub", "mlp"}), frozenset({"x"})]
    assert all(len(k.digest) == 32 for k in keys)  # only digests are kept


@pytest.mark.parametrize("text,words", [
    ("has space inside-0123456789", "may hold only"),
    ("key-0123456789abcdef:", "no model names"),
    ("key-0123456789abcdef: ../etc", "invalid model name"),
    (f"{ADMIN}\n{ADMIN}: mlp", "appears twice"),
])
def test_bad_key_entries_are_refused_without_echoing_the_key(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        parse_keys(text, "DESPINA_API_KEYS")
    assert "0123456789abcdef" not in str(info.value) and "inside" not in str(info.value)


def test_keys_file_is_merged_with_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{SCOPED}: add_sub\n")
    p = policy(api_keys=ADMIN, api_keys_file=str(path))
    assert len(p.keys) == 2
    with pytest.raises(ConfigError, match="cannot read the API keys file"):
        policy(api_keys_file=str(tmp_path / "missing"))


def test_triton_restricted_api_syntax() -> None:
    (r,) = parse_restricted_api("model-repository,statistics:Admin-Key=secret")
    assert r.apis == {"model-repository", "statistics"} and r.header == b"admin-key"
    assert r.digest == hashlib.sha256(b"secret").digest()
    for bad, words in [("inference", "expected"), ("inference:k=", "expected"), ("nope:k=v", "unknown API"),
                       ("inference:k=v;inference,health:k2=v", "already in a group")]:
        with pytest.raises(ConfigError, match=words):
            parse_restricted_api(bad)


def test_a_restricted_api_value_is_taken_whole() -> None:
    """As tritonserver takes it: a '#' in the value is part of it, not a comment that would cut the
    secret down to its prefix."""
    (r,) = parse_restricted_api("model-repository:admin-key=s3cr#t-value")
    assert r.digest == hashlib.sha256(b"s3cr#t-value").digest()
    p = policy(http_restricted_api="model-repository:admin-key=s3cr#t-value")
    p.check(classify("/v2/repository/index"), h(admin_key="s3cr#t-value"))
    with pytest.raises(Exception, match="restricted"):
        p.check(classify("/v2/repository/index"), h(admin_key="s3cr"))


def test_settings_hide_secrets_and_read_booleans() -> None:
    s = Settings.from_sources(environ={"DESPINA_API_KEYS": ADMIN, "DESPINA_AUTH_INFERENCE": "True",
                                       "DESPINA_HTTP_RESTRICTED_API": f"statistics:k={TRITON_VALUE}",
                                       "DESPINA_MAX_TENSOR_ELEMENTS": "1000"})
    assert s.auth_inference is True and s.max_tensor_elements == 1000
    assert ADMIN not in repr(s) and TRITON_VALUE not in repr(s)
    with pytest.raises(ValueError, match="true or false"):
        Settings.from_sources(environ={"DESPINA_AUTH_INFERENCE": "maybe"})


# ---- paths: API groups, model names, versions ------------------------------------------------------

@pytest.mark.parametrize("path,target", [
    ("/v2/health/ready", Target("health")),
    ("/v2", Target("metadata")),
    ("/openapi.json", Target("open")),
    ("/v2/models/stats", Target("statistics")),
    ("/v2/models/mlp", Target("metadata", "mlp")),
    ("/v2/models/mlp/versions/2/ready", Target("health", "mlp", "2")),
    ("/v2/models/mlp/config", Target("model-config", "mlp")),
    ("/v2/models/mlp/versions/1/stats", Target("statistics", "mlp", "1")),
    ("/v2/models/mlp/infer", Target("inference", "mlp")),
    ("/fn/add_sub", Target("inference", "add_sub")),
    ("/fn/add_sub/versions/1", Target("inference", "add_sub", "1")),
    ("/v2/repository/index", Target("model-repository")),
    ("/v2/repository/models/mlp/unload", Target("model-repository", "mlp")),
    ("/v2/logging", Target("logging")),
    ("/v2/models/../../etc/infer", Target("unlisted")),
    ("/admin", Target("unlisted")),
])
def test_paths_name_their_api_group(path: str, target: Target) -> None:
    assert classify(path) == target


@pytest.mark.parametrize("model,version", [("..", None), ("a..b", None), ("/etc", None), ("a\0b", None),
                                           ("x" * 129, None), ("mlp", "²"), ("mlp", "1" * 19),
                                           ("mlp", "-1"), ("mlp", "1e3"), (".hidden", None)])
def test_bad_model_names_and_versions_are_refused(model: str, version: str | None) -> None:
    # a bad name is the client's error (400); a version that is not one is no route of Triton's (404)
    with pytest.raises(InvalidArgument if version is None else NotFound):
        check_target(Target("inference", model, version))


# ---- the policy ------------------------------------------------------------------------------------

def h(**headers: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]


ADMIN_H = h(authorization=f"Bearer {ADMIN}")
SCOPED_H = h(authorization=f"bearer {SCOPED}")
KEYS = {"api_keys": f"{ADMIN}; {SCOPED}: add_sub"}
TRITON = {"http_restricted_api": f"model-repository,statistics:{TRITON_HEADER}={TRITON_VALUE}"}
OK, DENIED, FORBIDDEN = None, "Unauthenticated", "PermissionDenied"

MATRIX = [
    # (settings, path, headers, outcome)
    ({}, "/v2/repository/index", [], OK),                                   # nothing configured: open
    (KEYS, "/v2/health/live", [], OK),
    (KEYS, "/v2/models/mlp/ready", [], OK),
    (KEYS, "/openapi.json", [], OK),
    (KEYS, "/v2/models/mlp/infer", [], OK),                                 # inference open by default
    (KEYS, "/v2/models/mlp", [], OK),
    (KEYS, "/v2/repository/index", [], DENIED),
    (KEYS, "/v2/models/mlp/config", [], DENIED),
    (KEYS, "/v2/models/stats", [], DENIED),
    (KEYS, "/somewhere/new", [], DENIED),                                   # unlisted: deny by default
    (KEYS, "/v2/repository/index", ADMIN_H, OK),
    (KEYS, "/v2/repository/index", h(authorization="Bearer wrong-key-0123456789"), DENIED),
    (KEYS, "/v2/repository/index", h(authorization=f"Basic {ADMIN}"), DENIED),
    (KEYS, "/v2/repository/index", SCOPED_H, FORBIDDEN),                    # server-wide: all models only
    (KEYS, "/v2/models/stats", SCOPED_H, FORBIDDEN),
    (KEYS, "/v2/models/add_sub/stats", SCOPED_H, OK),
    (KEYS, "/v2/models/mlp/stats", SCOPED_H, FORBIDDEN),
    (KEYS, "/v2/repository/models/mlp/load", SCOPED_H, FORBIDDEN),
    (KEYS, "/v2/repository/models/add_sub/load", SCOPED_H, OK),
    ({**KEYS, "auth_inference": True}, "/v2/models/mlp/infer", [], DENIED),
    ({**KEYS, "auth_inference": True}, "/fn/mlp", ADMIN_H, OK),
    ({**KEYS, "auth_inference": True}, "/fn/mlp", SCOPED_H, FORBIDDEN),
    ({**KEYS, "auth_inference": True}, "/v2/models/add_sub/versions/1/infer", SCOPED_H, OK),
    ({**KEYS, "auth_inference": True}, "/v2", SCOPED_H, OK),
    ({**KEYS, "auth_inference": True}, "/v2/health/ready", [], OK),
    (TRITON, "/v2/models/stats", [], FORBIDDEN),                            # 403, as Triton answers
    (TRITON, "/v2/models/stats", h(admin_key=TRITON_VALUE), OK),
    (TRITON, "/v2/models/stats", h(admin_key=TRITON_VALUE + "x"), FORBIDDEN),
    (TRITON, "/v2/models/mlp/config", [], OK),                              # not in the Triton group
    (TRITON, "/v2/models/stats", ADMIN_H, FORBIDDEN),                       # no keys configured
    ({**KEYS, **TRITON}, "/v2/models/stats", h(admin_key=TRITON_VALUE), OK),
    ({**KEYS, **TRITON}, "/v2/models/stats", ADMIN_H, OK),                  # a key opens it too
    ({**KEYS, **TRITON}, "/v2/models/mlp/config", h(admin_key=TRITON_VALUE), DENIED),
    ({"http_restricted_api": "health:k=v"}, "/v2/health/live", [], FORBIDDEN),  # as Triton allows
    (KEYS, "/v2/logging", [], DENIED),                                      # every process's log settings
    (KEYS, "/v2/logging", ADMIN_H, OK),
    (KEYS, "/v2/logging", SCOPED_H, FORBIDDEN),                             # server-wide
    ({"http_restricted_api": f"logging:{TRITON_HEADER}={TRITON_VALUE}"}, "/v2/logging", [], FORBIDDEN),
    ({"http_restricted_api": f"logging:{TRITON_HEADER}={TRITON_VALUE}"}, "/v2/logging",
     h(admin_key=TRITON_VALUE), OK),
]


@pytest.mark.parametrize("settings,path,headers,outcome", MATRIX)
def test_policy(settings: dict[str, object], path: str, headers: list[tuple[bytes, bytes]],
                outcome: str | None) -> None:
    p = policy(**settings)
    if outcome is None:
        p.check(classify(path), headers)
    else:
        with pytest.raises(Exception) as info:
            p.check(classify(path), headers)
        assert type(info.value).__name__ == outcome


# ---- the middleware around a bare app --------------------------------------------------------------

async def _ok(scope: dict, receive: object, send: http.Send) -> None:
    await http.send(send, 200, b'{"ok": true}')


async def guarded(p: AuthPolicy, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=Guard(_ok, p))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path, headers=headers)


async def test_guard_answers_401_403_and_400_with_json_errors() -> None:
    p = policy(**KEYS, auth_inference=True)
    r = await guarded(p, "/v2/models/mlp/infer")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer <key>" in r.json()["error"]
    r = await guarded(p, "/v2/models/mlp/infer", bearer(SCOPED))
    assert r.status_code == 403 and "may not use model 'mlp'" in r.json()["error"]
    r = await guarded(p, "/v2/models/a..b/infer", bearer())
    assert r.status_code == 400 and "invalid model name" in r.json()["error"]
    assert (await guarded(p, "/v2/models/mlp/infer", bearer())).status_code == 200
    r = await guarded(policy(**TRITON), "/v2/models/stats")  # Triton's answer: 403, and no challenge
    assert r.status_code == 403 and "www-authenticate" not in r.headers
    assert r.json() == {"error": "This API is restricted, expecting header 'admin-key'"}
    r = await guarded(policy(**KEYS, **TRITON), "/v2/models/stats")  # a key would open it: 401
    assert r.status_code == 401 and "expecting header 'admin-key'" in r.json()["error"]


# ---- a real server with keys -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
            example_repository: Path) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("secured")
    repo = root / "repo"
    for model in ("mlp", "add_sub"):
        shutil.copytree(example_repository / model, repo / model)
    keys_file = root / "keys"
    keys_file.write_text(f"# limited to one model\n{SCOPED}: add_sub\n")
    env = {"DESPINA_API_KEYS": ADMIN, "DESPINA_API_KEYS_FILE": str(keys_file),
           "DESPINA_AUTH_INFERENCE": "true",
           "DESPINA_HTTP_RESTRICTED_API": f"model-repository,statistics:{TRITON_HEADER}={TRITON_VALUE}",
           "DESPINA_MAX_BODY_BYTES": "1000000", "DESPINA_MAX_TENSOR_ELEMENTS": "1024",
           "DESPINA_METRICS_PORT": "0"}
    yield from module_server(repo, tmp_path_factory, redis_url, ("mlp", "add_sub"), env=env)


@pytest.fixture(scope="module")
def triton(secured: Server) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(secured.url.removeprefix("http://"))
    yield client
    client.close()


def mlp_input() -> httpclient.InferInput:
    x = httpclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.full((1, 256), 0.5, np.float32), binary_data=True)
    return x


def add_sub_inputs() -> list[httpclient.InferInput]:
    out = []
    for name in ("a", "b"):
        t = httpclient.InferInput(name, [1, 4], "FP32")
        t.set_data_from_numpy(np.ones((1, 4), np.float32))
        out.append(t)
    return out


def status_of(call: object) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()  # type: ignore[operator]
    return str(info.value.status())


def test_tritonclient_passes_keys_in_headers(triton: httpclient.InferenceServerClient) -> None:
    assert triton.is_server_live() and triton.is_server_ready()  # no key needed
    assert status_of(lambda: triton.infer("mlp", [mlp_input()])) == "401"
    y = triton.infer("mlp", [mlp_input()], headers=bearer()).as_numpy("y")
    assert y.shape == (1, 10)
    assert triton.get_model_config("mlp", headers=bearer())["max_batch_size"] > 0
    assert status_of(lambda: triton.get_model_config("mlp")) == "401"
    assert triton.get_inference_statistics(headers={TRITON_HEADER: TRITON_VALUE})["model_stats"] is not None
    assert status_of(lambda: triton.get_inference_statistics(headers={TRITON_HEADER: "nope"})) == "401"


def test_a_key_limited_to_a_model(triton: httpclient.InferenceServerClient) -> None:
    out = triton.infer("add_sub", add_sub_inputs(), headers=bearer(SCOPED))
    np.testing.assert_array_equal(out.as_numpy("sum"), np.full((1, 4), 2, np.float32))
    assert status_of(lambda: triton.infer("mlp", [mlp_input()], headers=bearer(SCOPED))) == "403"
    assert status_of(lambda: triton.get_inference_statistics(headers=bearer(SCOPED))) == "403"
    stats = triton.get_inference_statistics("add_sub", headers=bearer(SCOPED))
    assert stats["model_stats"][0]["name"] == "add_sub"


def test_curl_style_calls(secured: Server) -> None:
    url = secured.url
    r = httpx.post(f"{url}/fn/mlp", content=orjson.dumps(ROW))
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.post(f"{url}/fn/mlp", content=orjson.dumps(ROW), headers=bearer("wrong-0123456789"))
    assert r.status_code == 401 and r.json() == {"error": "the API key is not valid"}
    r = httpx.post(f"{url}/fn/mlp", content=orjson.dumps(ROW), headers=bearer())
    assert r.status_code == 200 and len(r.json()["y"]) == 10
    assert httpx.get(f"{url}/openapi.json").json()["openapi"].startswith("3.")
    assert httpx.get(f"{url}/v2/models/mlp/ready").status_code == 200
    for path in ("/v2/repository/index", "/v2/repository/models/mlp/unload"):
        assert httpx.post(url + path).status_code == 401
        assert httpx.post(url + path, headers=bearer(SCOPED)).status_code == 403


@pytest.mark.parametrize("path", [
    "/v2/models/..%2F..%2Fetc%2Fpasswd/infer", "/v2/models/../infer", "/v2/models/a..b/config",
    "/v2/models/%2Fetc/stats", "/fn/%00", "/fn/..", "/v2/models/mlp%00/infer",
    "/v2/models/mlp/versions/%C2%B2/infer", "/v2/models/mlp/versions/99999999999999999999999/config",
    "/v2/repository/models/..%2F..%2Ftmp/load", "/v2/repository/models/.hidden/unload",
])
def test_model_names_from_clients_are_checked(secured: Server, path: str) -> None:
    method = "GET" if path.endswith(("/config", "/stats")) else "POST"
    r = httpx.request(method, secured.url + path, headers=bearer(), content=b"{}")
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]


def test_body_and_element_limits(secured: Server) -> None:
    big = b"[" + b"0.5," * 300_000 + b"0.5]"
    r = httpx.post(f"{secured.url}/fn/mlp", content=big, headers=bearer())
    assert r.status_code == 413 and "over the limit" in r.json()["error"]
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [8, 256], "datatype": "FP32", "data": ROW * 8}]})
    r = httpx.post(f"{secured.url}/v2/models/mlp/infer", content=body, headers=bearer())
    assert r.status_code == 400 and "more than the limit of 1024" in r.json()["error"]


def test_keys_never_reach_the_logs(secured: Server, triton: httpclient.InferenceServerClient) -> None:
    httpx.post(f"{secured.url}/fn/mlp", content=b"[", headers=bearer(ADMIN + "x"))
    logs = secured.logs()
    assert "API key(s)" in logs  # the gateway says keys are on, and how many
    for secret in (ADMIN, SCOPED, TRITON_VALUE):
        assert secret not in logs


# ---- a real server with Triton's restricted APIs alone ---------------------------------------------

@pytest.fixture(scope="module")
def header_only(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
                example_repository: Path) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("header-only") / "repo"
    shutil.copytree(example_repository / "add_sub", repo / "add_sub")
    env = {"DESPINA_HTTP_RESTRICTED_API": f"model-repository,statistics,logging:{TRITON_HEADER}={TRITON_VALUE}",
           "DESPINA_METRICS_PORT": "0"}
    yield from module_server(repo, tmp_path_factory, redis_url, ("add_sub",), env=env)


@pytest.mark.parametrize("method,path", [("POST", "/v2/repository/index"), ("GET", "/v2/models/add_sub/stats"),
                                         ("GET", "/v2/logging")])
def test_a_final_newline_does_not_slip_past_a_restriction(header_only: Server, method: str, path: str) -> None:
    """The router's patterns end in '$', which matches before a final newline too: '<path>%0A' reached
    the restricted route as a path no API group names, so without the header."""
    assert httpx.request(method, header_only.url + path).status_code == 403
    r = httpx.request(method, header_only.url + path + "%0A")
    assert r.status_code == 404, r.text
    assert httpx.request(method, header_only.url + path, headers={TRITON_HEADER: TRITON_VALUE}).status_code == 200


# ---- a real server whose repository API loads and unloads ------------------------------------------

@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
             example_repository: Path) -> Iterator[tuple[Server, Path]]:
    repo = tmp_path_factory.mktemp("explicit") / "repo"
    for model in ("mlp", "add_sub"):
        shutil.copytree(example_repository / model, repo / model)
    env = {"DESPINA_API_KEYS": f"{ADMIN}; {SCOPED}: add_sub", "DESPINA_MODEL_CONTROL_MODE": "explicit",
           "DESPINA_LOAD_MODEL": "*", "DESPINA_METRICS_PORT": "0"}
    for server in module_server(repo, tmp_path_factory, redis_url, ("mlp", "add_sub"), env=env):
        yield server, repo


def test_a_key_limited_to_a_model_loads_it_only_as_the_repository_holds_it(explicit: tuple[Server, Path]
                                                                           ) -> None:
    """The load API's config and file: parameters replace the model (and a Python model's files are code
    the server runs, that may call any model): a key for some models would reach them all."""
    server, repo = explicit
    url = f"{server.url}/v2/repository/models/add_sub/load"
    config = httpx.get(f"{server.url}/v2/models/add_sub/config", headers=bearer()).json()
    rewrite = {"parameters": {"config": orjson.dumps(config).decode(),
                              "file:1/model.onnx": base64.b64encode(
                                  (repo / "add_sub" / "1" / "model.onnx").read_bytes()).decode(),
                              "file:1/extra.txt": base64.b64encode(b"written by a limited key").decode()}}
    r = httpx.post(url, json=rewrite, headers=bearer(SCOPED), timeout=60)
    assert r.status_code == 403 and "a key for every model" in r.json()["error"], r.text
    assert not (repo / "add_sub" / "1" / "extra.txt").exists()
    r = httpx.post(url, json={"parameters": {"config": orjson.dumps(config).decode()}}, headers=bearer(SCOPED))
    assert r.status_code == 403
    assert httpx.post(url, headers=bearer(SCOPED), timeout=60).status_code == 200  # as the repository holds it
    assert httpx.post(url, json=rewrite, headers=bearer(), timeout=60).status_code == 200
    assert not (repo / "add_sub" / "1" / "extra.txt").exists()  # the files given are loaded, never written
    assert httpx.post(url, headers=bearer(), timeout=60).status_code == 200  # the repository's again
