"""Triton's logging extension on a real `despina serve`: GET /v2/logging answers the settings, POST changes
those it names, and every process follows them (the worker's verbose lines appear, in ISO8601 time);
bad settings are 400s. And the settings' pieces alone (logs.merged, logs.apply)."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from despina import logs
from despina.contract.errors import InvalidArgument

from .conftest import Server, module_server

ROW = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]}
DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": 0, "log_format": "default"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, example_repository: Path
           ) -> Iterator[Server]:
    yield from module_server(example_repository, tmp_path_factory, redis_url, ("mlp",))


def wait_for_line(server: Server, pattern: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert httpx.post(f"{server.url}/v2/models/mlp/infer", json=ROW, timeout=30).status_code == 200
        found = re.search(pattern, server.logs())
        if found:
            return found.group(0)
        time.sleep(0.2)
    raise AssertionError(f"no line like {pattern!r} in the logs")


def test_verbose_logging_is_switched_on_in_every_process_and_off_again(server: Server) -> None:
    assert "logging" in httpx.get(f"{server.url}/v2", timeout=10).json()["extensions"]
    assert httpx.get(f"{server.url}/v2/logging", timeout=10).json() == DEFAULTS
    assert httpx.post(f"{server.url}/v2/models/mlp/infer", json=ROW, timeout=30).status_code == 200
    assert "batch formed" not in server.logs()  # the worker's debug line: not without verbose
    r = httpx.post(f"{server.url}/v2/logging", json={"log_verbose_level": 1, "log_format": "ISO8601"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {**DEFAULTS, "log_verbose_level": 1, "log_format": "ISO8601"}  # all of them, as Triton
    assert httpx.get(f"{server.url}/v2/logging", timeout=10).json() == r.json()
    # the worker (another process) follows: its batch lines, timestamped in UTC
    wait_for_line(server, r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z worker\[\d+\] DEBUG batch formed")
    r = httpx.post(f"{server.url}/v2/logging", json={"log_verbose_level": 0, "log_format": "default"}, timeout=10)
    assert r.json() == DEFAULTS
    time.sleep(1.0)  # the event reaches the worker
    before = server.logs().count("batch formed")
    for _ in range(3):
        assert httpx.post(f"{server.url}/v2/models/mlp/infer", json=ROW, timeout=30).status_code == 200
    time.sleep(0.5)
    assert server.logs().count("batch formed") == before


def test_tritonclient_reads_and_changes_the_settings(server: Server) -> None:
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        assert client.update_log_settings({"log_info": False})["log_info"] is False
        assert client.get_log_settings() == {**DEFAULTS, "log_info": False}
        with pytest.raises(InferenceServerException, match="must be a boolean"):
            client.update_log_settings({"log_warning": "no"})
        assert client.update_log_settings({"log_info": True}) == DEFAULTS
    finally:
        client.close()


def test_the_level_switches_have_tritons_names(server: Server) -> None:
    """Triton's server answers and takes log_warning and log_error (its protocol document spells them with
    an s; those spellings are taken too), as Triton's own logging_endpoint_test sends them."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        settings = client.update_log_settings({"log_info": True, "log_warning": False, "log_error": True,
                                               "log_verbose_level": 0, "log_format": "default"})
        assert settings == {**DEFAULTS, "log_warning": False}
        assert client.update_log_settings({"log_errors": False}) == {**DEFAULTS, "log_warning": False,
                                                                     "log_error": False}
        assert client.update_log_settings({"log_warning": True, "log_error": True}) == DEFAULTS
    finally:
        client.close()


def test_a_null_setting_is_left_as_it_is(server: Server) -> None:
    """Triton's logging endpoint skips a setting given as null: a client that sends every setting, those it
    leaves alone as None, changes only the others."""
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        nulls = dict.fromkeys(DEFAULTS)
        assert client.update_log_settings(nulls) == DEFAULTS
        assert client.update_log_settings({**nulls, "log_info": False}) == {**DEFAULTS, "log_info": False}
        assert client.update_log_settings({**nulls, "log_info": True}) == DEFAULTS
    finally:
        client.close()


@pytest.mark.parametrize(("body", "message"), [
    ({"log_info": "yes"}, "log setting 'log_info' must be a boolean"),
    ({"log_verbose_level": -1}, "'log_verbose_level' must be an unsigned integer"),
    ({"log_verbose_level": True}, "'log_verbose_level' must be an unsigned integer"),
    ({"log_format": "xml"}, "'log_format' must be one of default, ISO8601"),
    ({"log_everything": True}, "unknown log setting 'log_everything'"),
    ([1, 2], "must be a JSON object"),
])
def test_a_bad_setting_is_a_400_and_changes_nothing(server: Server, body: object, message: str) -> None:
    before = httpx.get(f"{server.url}/v2/logging", timeout=10).json()
    r = httpx.post(f"{server.url}/v2/logging", json=body, timeout=10)
    assert r.status_code == 400 and message in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/v2/logging", timeout=10).json() == before


def test_a_log_file_is_refused_as_triton_refuses_it(server: Server) -> None:
    # Triton 2.51 answers 501 (UNSUPPORTED) with these words, as seen; it was a 400. An empty name, no
    # file, is today's setting and changes nothing
    before = httpx.get(f"{server.url}/v2/logging", timeout=10).json()
    r = httpx.post(f"{server.url}/v2/logging", json={"log_file": "/tmp/triton.log"}, timeout=10)
    assert r.status_code == 501, r.text
    assert "log file location can not be updated through network protocol" in r.json()["error"]
    assert "a log file is not supported" in r.json()["error"]
    assert httpx.post(f"{server.url}/v2/logging", json={"log_file": ""}, timeout=10).json() == before
    assert httpx.get(f"{server.url}/v2/logging", timeout=10).json() == before


async def test_concurrent_changes_of_different_settings_are_all_kept(server: Server) -> None:
    """A POST read the settings, changed what it names and wrote them all back: two at once (through one
    gateway or two) each wrote the settings it had read, and the one written first was lost."""
    changes = [("log_info", lambda i: i % 2 == 0), ("log_warning", lambda i: i % 2 == 1),
               ("log_verbose_level", lambda i: i % 3), ("log_format", lambda i: ("default", "ISO8601")[i % 2])]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        try:
            for i in range(20):
                answers = await asyncio.gather(*(http.post("/v2/logging", json={name: value(i)})
                                                 for name, value in changes))
                assert [a.status_code for a in answers] == [200] * len(changes), [a.text for a in answers]
                kept = (await http.get("/v2/logging")).json()
                assert {name: kept[name] for name, _ in changes} == {name: value(i) for name, value in changes}, \
                    f"round {i}"
        finally:
            await http.post("/v2/logging", json={k: v for k, v in DEFAULTS.items() if k != "log_file"})


def test_the_switches_are_one_per_level() -> None:
    """Triton's switches are independent: errors on and warnings off is a filter, not a threshold."""
    settings = logs.merged(logs.defaults("info"), {"log_warning": False})
    assert settings == {**DEFAULTS, "log_warning": False}
    with pytest.raises(InvalidArgument):
        logs.merged(settings, {"log_error": 1})
    root, despina = logging.getLogger(), logging.getLogger("despina")
    saved = root.handlers[:], root.level, despina.level
    handler = logging.StreamHandler()
    root.handlers[:] = [handler]  # this process's own handlers (pytest's) stay out of it
    try:
        logs.apply(settings)
        passing = [level for level in (logging.INFO, logging.WARNING, logging.ERROR)
                   if all(f.filter(logging.LogRecord("despina", level, "", 0, "m", (), None)) for f in handler.filters)]
        assert passing == [logging.INFO, logging.ERROR]
        logs.apply({**settings, "log_verbose_level": 1})
        assert despina.getEffectiveLevel() == logging.DEBUG and root.level > logging.DEBUG  # Despina's own
        logs.apply({**settings, "log_verbose_level": 2})
        assert root.level == logging.DEBUG  # every library's too
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        despina.setLevel(saved[2])
