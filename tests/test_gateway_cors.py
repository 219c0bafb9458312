"""CORS: the settings, then a real `despina serve` with allowed origins, API keys and a Triton restricted API,
called as a browser calls it (a preflight, then the request with its Origin), and one with CORS off."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from despina.cli import parser, settings_of
from despina.settings import BadSetting, Settings

from .conftest import Server, module_server

KEY = "cors-key-0123456789abcdef0123456789abcdef"
PAGE = "https://demo.example.com"
OTHER = "https://evil.example.net"
FN_BODY = {"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]}


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


def preflight(url: str, path: str, origin: str = PAGE, asked: str = "content-type, authorization"
              ) -> httpx.Response:
    return httpx.options(url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": asked})


# ---- settings -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("origins,words", [
    ("https://demo.example.com/", "is not an origin"),
    ("demo.example.com", "is not an origin"),
    ("https://demo.example.com/app", "is not an origin"),
    ("*, https://demo.example.com", "must be alone"),
])
def test_bad_origins_are_refused_at_start(origins: str, words: str) -> None:
    with pytest.raises(BadSetting, match=words):
        Settings.from_sources({}, {"DESPINA_CORS_ORIGINS": origins})


def test_bad_header_names_are_refused_at_start() -> None:
    with pytest.raises(BadSetting, match="DESPINA_CORS_ALLOW_HEADERS.*not a header name"):
        Settings(cors_origins="*", cors_allow_headers="x-ok, bad header")


def test_the_command_line_sets_cors() -> None:
    args = parser().parse_args(["gateway", "--cors-origins", f"{PAGE},http://localhost:3000",
                                "--cors-allow-headers", "x-demo", "--cors-max-age", "60"])
    s = settings_of(args, {})
    assert (s.cors_origins, s.cors_allow_headers, s.cors_max_age_s) == (f"{PAGE},http://localhost:3000",
                                                                         "x-demo", 60)
    assert settings_of(parser().parse_args(["serve", "--cors-origins", "*"]), {}).cors_origins == "*"
    assert Settings.from_sources({}, {}).cors_origins == ""  # off unless asked for


def test_any_origin_with_a_star() -> None:
    from despina.gateway.auth import AuthPolicy
    from despina.gateway.cors import CorsPolicy

    settings = Settings(cors_origins="*")
    cors = CorsPolicy.from_settings(settings, AuthPolicy.from_settings(settings))
    assert cors is not None
    page = [(b"origin", OTHER.encode()), (b"access-control-request-headers", b"content-type")]
    assert dict(cors.headers(page))[b"access-control-allow-origin"] == b"*"
    assert dict(cors.preflight(page))[b"access-control-allow-origin"] == b"*"
    assert cors.headers([]) == [(b"vary", b"Origin")]  # no Origin: not a browser's cross-origin request
    assert CorsPolicy.from_settings(Settings(), AuthPolicy.from_settings(Settings())) is None


# ---- a real server with CORS, keys for inference and a restricted API ----------------------------------

@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, example_repository: Path) -> Path:
    repo = tmp_path_factory.mktemp("cors") / "repo"
    shutil.copytree(example_repository / "add_sub", repo / "add_sub")
    return repo


@pytest.fixture(scope="module")
def cors(tmp_path_factory: pytest.TempPathFactory, redis_url: str, repo: Path) -> Iterator[Server]:
    env = {"DESPINA_CORS_ORIGINS": " HTTPS://Demo.Example.com , http://localhost:3000",
           "DESPINA_CORS_ALLOW_HEADERS": "X-Demo", "DESPINA_CORS_MAX_AGE_S": "120",
           "DESPINA_API_KEYS": KEY, "DESPINA_AUTH_INFERENCE": "true",
           "DESPINA_HTTP_RESTRICTED_API": "logging:Admin-Key=secret-value", "DESPINA_METRICS_PORT": "0"}
    yield from module_server(repo, tmp_path_factory, redis_url, ("add_sub",), env=env)


@pytest.mark.parametrize("path", ["/fn/add_sub", "/v2/models/add_sub/infer",
                                  "/v2/models/add_sub/versions/1/infer", "/v2/repository/index", "/v2/logging"])
def test_a_preflight_is_answered_before_auth(cors: Server, path: str) -> None:
    r = preflight(cors.url, path, asked="Content-Type, Authorization, X-Request-Id, "
                  "Inference-Header-Content-Length, admin-key, x-demo, x-not-allowed")
    assert r.status_code == 204 and r.content == b""
    assert r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["access-control-allow-methods"] == "GET, POST"
    assert r.headers["access-control-allow-headers"] == ("content-type, authorization, x-request-id, "
                                                         "inference-header-content-length, admin-key, x-demo")
    assert r.headers["access-control-max-age"] == "120"
    assert r.headers["vary"] == "Origin"
    assert "access-control-allow-credentials" not in r.headers


def test_a_preflight_from_an_origin_not_allowed_gets_no_cors_headers(cors: Server) -> None:
    for origin in (OTHER, "null", PAGE + ":8443"):
        r = preflight(cors.url, "/fn/add_sub", origin)
        assert r.status_code == 204 and cors_headers(r) == {} and r.headers["vary"] == "Origin"


def test_an_allowed_origin_reads_the_answers(cors: Server) -> None:
    auth = {"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}", "X-Request-Id": "r-1"}
    r = httpx.post(f"{cors.url}/fn/add_sub", json=FN_BODY, headers=auth)
    assert r.status_code == 200 and r.json()["sum"] == [2.0, 3.0, 4.0, 5.0]
    assert cors_headers(r) == {"access-control-allow-origin": "http://localhost:3000",
                               "access-control-expose-headers":
                                   "inference-header-content-length, x-request-id, retry-after"}
    assert r.headers["vary"] == "Origin" and r.headers["x-request-id"] == "r-1"
    # a binary answer: the page needs Inference-Header-Content-Length to split it
    client = httpclient.InferenceServerClient(cors.url.removeprefix("http://"))
    inputs = []
    for name in ("a", "b"):
        t = httpclient.InferInput(name, [1, 4], "FP32")
        t.set_data_from_numpy(np.ones((1, 4), np.float32), binary_data=True)
        inputs.append(t)
    body, length = client.generate_request_body(inputs, [httpclient.InferRequestedOutput("sum", True)])
    client.close()
    r = httpx.post(f"{cors.url}/v2/models/add_sub/infer", content=body,
                   headers={**auth, "Inference-Header-Content-Length": str(length)})
    assert r.status_code == 200 and "inference-header-content-length" in r.headers
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    # routes served through ASGI: model metadata, and a function URL whose path is escaped
    for r in (httpx.get(f"{cors.url}/v2/models/add_sub", headers=auth),
              httpx.post(f"{cors.url}/fn/add%5Fsub", json=FN_BODY, headers=auth)):
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert r.headers["vary"] == "Origin"


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/fn/add_sub", b"{}", 401),                           # answered from the parser, before its body
    ("POST", "/v2/models/add_sub/infer", b"{}", 401),
    ("GET", "/v2/repository/index", b"", 401),                     # the auth middleware's refusal (ASGI)
    ("POST", "/fn/no_such_model", b"{}", 401),
])
def test_errors_carry_cors_headers_so_the_page_can_read_them(cors: Server, method: str, path: str,
                                                             body: bytes, status: int) -> None:
    r = httpx.request(method, cors.url + path, content=body, headers={"Origin": PAGE})
    assert r.status_code == status and "error" in r.json()
    assert r.headers["access-control-allow-origin"] == PAGE and r.headers["vary"] == "Origin"


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/fn/add_sub", b"not json", 400),
    ("POST", "/v2/models/add_sub/infer", b'{"inputs": 3}', 400),
    ("POST", "/fn/no_such_model", b"{}", 404),
    ("GET", "/no/such/path", b"", 404),
    ("DELETE", "/v2/models/add_sub", b"", 405),
])
def test_errors_with_a_key_carry_cors_headers(cors: Server, method: str, path: str, body: bytes,
                                              status: int) -> None:
    r = httpx.request(method, cors.url + path, content=body,
                      headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == status and "error" in r.json()
    assert r.headers["access-control-allow-origin"] == PAGE


def test_other_origins_and_plain_clients_get_no_allow_origin(cors: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for extra in ({"Origin": OTHER}, {}):
        r = httpx.post(f"{cors.url}/fn/add_sub", json=FN_BODY, headers={**auth, **extra})
        assert r.status_code == 200 and cors_headers(r) == {}
        assert r.headers["vary"] == "Origin"  # a cache must not hand this answer to an allowed page
    # an OPTIONS that is not a preflight is not answered as one
    r = httpx.options(f"{cors.url}/fn/add_sub", headers={"Origin": PAGE, **auth})
    assert r.status_code == 405 and r.headers["access-control-allow-origin"] == PAGE


# ---- CORS off ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, redis_url: str, repo: Path) -> Iterator[Server]:
    yield from module_server(repo, tmp_path_factory, redis_url, ("add_sub",), env={"DESPINA_METRICS_PORT": "0"})


def test_cors_off_sends_no_cors_header(plain: Server) -> None:
    page = {"Origin": PAGE}
    answers = [httpx.post(f"{plain.url}/fn/add_sub", json=FN_BODY, headers=page),
               httpx.post(f"{plain.url}/fn/add_sub", content=b"not json", headers=page),
               httpx.post(f"{plain.url}/v2/models/add_sub/infer", content=b"{}", headers=page),
               httpx.get(f"{plain.url}/v2/models/add_sub", headers=page),
               preflight(plain.url, "/fn/add_sub")]
    assert [r.status_code for r in answers] == [200, 400, 400, 200, 405]
    for r in answers:
        assert not any(k.startswith("access-control-") or k == "vary" for k in r.headers), r.headers
