"""`despina serve` as a user runs it: embedded Valkey, signals, draining, limits, broken configs."""
from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from despina.contract.keys import Keys
from despina.embedded import START_FAILED, bound_socket, free_port
from despina.roles import STOP_MARGIN_S

from .conftest import FULL_QUEUE_DELAY, Server, descendants, dump_stacks, stop_server
from .control_support import catalog_entry, infer, mlp_folder
from .reliability_support import own_redis, role_pids
from .test_metrics import scrape
from .test_serve_lifecycle import ended, launch
from .test_serve_lifecycle import running as alive

PENDING = 'nv_inference_pending_request_count{model="mlp",version="1"}'

ROW = orjson.dumps([0.25] * 256)



def settle(server: Server, pid: int, timeout: float = 30) -> None:
    """Wait until serve heard the role `pid` say it is up (despina/started.py): its death is then a crash to
    restart, not a failed start that stops serve."""
    deadline = time.monotonic() + timeout
    while f"is up (pid {pid})" not in server.logs():
        assert time.monotonic() < deadline and server.process.poll() is None, server.logs()[-3000:]
        time.sleep(0.05)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_embedded_valkey_serves_and_sigkill_leaves_nothing_behind(
        serve: Callable[..., Server], example_repository: Path) -> None:
    server = serve(example_repository, use_redis=False, wait_models=("mlp",))
    r = httpx.post(f"{server.url}/fn/mlp", content=ROW)
    assert r.status_code == 200 and len(r.json()["y"]) == 10
    family = descendants(server.process.pid)
    names = " ".join(cmdline(p) for p in family)
    assert "valkey" in names and "despina worker" in names and "despina gateway" in names
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    deadline = time.monotonic() + 15
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(family), [cmdline(p) for p in alive(family)]


def test_roles_left_by_a_killed_serve_exit_even_while_redis_hangs(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path) -> None:
    """serve SIGKILLed: the kernel sends its children SIGTERM and they drain, but their stop waits on
    Redis in places. With Redis frozen, gateway, worker and control plane all stayed (a minute and more,
    the worker even after Redis came back), and no supervisor was left to kill them. Each exits at the
    latest 2 x DESPINA_DRAIN_TIMEOUT_S + roles.STOP_MARGIN_S after its stop signal now."""
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "mlp", repo / "mlp")
    with own_redis(tmp_path) as redis_server:
        server = serve(repo, "--redis-url", redis_server.url, use_redis=False, wait_models=("mlp",),
                       env={"DESPINA_DRAIN_TIMEOUT_S": "1"})
        assert httpx.post(f"{server.url}/fn/mlp", content=ROW).status_code == 200
        roles = {pid for role in ("gateway", "worker", "control") for pid in role_pids(server, role)}
        assert len(roles) == 3
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
            deadline = time.monotonic() + 2 * 1 + STOP_MARGIN_S + 20
            while alive(roles) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not alive(roles), [cmdline(p) for p in alive(roles)]
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
    assert server.logs().count("after being told to stop") >= 1


def slow_repository(example_repository: Path, repo: Path, *more: str) -> Path:
    """The example mlp (and `more` of the examples) in `repo`, mlp's batches waiting 2 s to fill."""
    for name in ("mlp", *more):
        shutil.copytree(example_repository / name, repo / name)
    config = (repo / "mlp" / "config.pbtxt").read_text()
    (repo / "mlp" / "config.pbtxt").write_text(
        config.replace("max_queue_delay_microseconds: 500", "max_queue_delay_microseconds: 2000000"))
    return repo


def sigterm_answers_twenty_in_flight(server: Server, stop: Callable[[], None] | None = None) -> None:
    """20 requests wait in mlp's batcher when serve gets SIGTERM (or `stop` is called): all answered,
    exit 0, nothing left."""
    family = descendants(server.process.pid)

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            calls = [asyncio.create_task(client.post(f"{server.url}/fn/mlp", content=ROW)) for _ in range(20)]
            # SIGTERM once all 20 are queued (not after a fixed sleep: on a loaded machine a request could
            # still be on its way, and a connection with no request read yet is closed at shutdown)
            deadline = time.monotonic() + 10
            while scrape(server).get(PENDING) != 20:
                assert time.monotonic() < deadline, (scrape(server).get(PENDING), server.logs()[-2000:])
                await asyncio.sleep(0.02)
            (stop or (lambda: server.process.send_signal(signal.SIGTERM)))()
            return [r.status_code for r in await asyncio.gather(*calls)]

    assert asyncio.run(scenario()) == [200] * 20
    assert server.process.wait(30) == 0
    deadline = time.monotonic() + 10
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(family), [cmdline(p) for p in alive(family)]


def test_sigterm_drains_requests_in_flight(serve: Callable[..., Server], example_repository: Path,
                                           tmp_path: Path) -> None:
    server = serve(slow_repository(example_repository, tmp_path / "slow"), wait_models=("mlp",),
                   env=FULL_QUEUE_DELAY)
    sigterm_answers_twenty_in_flight(server)


def test_ctrl_c_in_a_terminal_drains_before_the_embedded_valkey_stops(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path) -> None:
    # a terminal's Ctrl-C signals serve's whole process group: the embedded Valkey used to be in it and
    # stop at once, so that the drain could answer nothing (every role logging that Redis was unreachable)
    server = serve(slow_repository(example_repository, tmp_path / "slow"), use_redis=False,
                   wait_models=("mlp",), env=FULL_QUEUE_DELAY)
    sigterm_answers_twenty_in_flight(server, lambda: os.killpg(server.process.pid, signal.SIGINT))
    assert "cannot connect to Redis" not in server.logs()


async def five_waiting_then(server: Server, stop: Callable[[], Awaitable[None]]
                            ) -> list[httpx.Response | BaseException]:
    """Five requests to mlp, its worker stopped (SIGSTOP): once all five wait, `stop()`; their answers,
    or what each call raised."""
    async with httpx.AsyncClient(timeout=30) as client:
        calls = [asyncio.create_task(client.post(f"{server.url}/fn/mlp", content=ROW)) for _ in range(5)]
        deadline = time.monotonic() + 10
        while scrape(server).get(PENDING) != 5:
            assert time.monotonic() < deadline, server.logs()[-2000:]
            await asyncio.sleep(0.02)
        await stop()
        return await asyncio.gather(*calls, return_exceptions=True)


def test_requests_still_waiting_as_the_drain_ends_are_answered_503(
        serve: Callable[..., Server], example_repository: Path) -> None:
    # the worker stopped (SIGSTOP): no answer can come within the drain's 3 s. The gateway used to be
    # killed at the end with its clients' connections cut (no status at all: curl's "empty reply")
    server = serve(example_repository, env={"DESPINA_DRAIN_TIMEOUT_S": "3"}, wait_models=("mlp",))
    (worker,) = role_pids(server, "worker")

    async def sigterm() -> None:
        server.process.send_signal(signal.SIGTERM)

    os.kill(worker, signal.SIGSTOP)
    try:
        answers = asyncio.run(five_waiting_then(server, sigterm))
    finally:
        os.kill(worker, signal.SIGCONT)
    assert all(isinstance(r, httpx.Response) for r in answers), answers
    answers = [r for r in answers if isinstance(r, httpx.Response)]
    assert [r.status_code for r in answers] == [503] * 5
    assert all("no answer came within its drain time" in r.json()["error"] for r in answers)
    assert answers[0].headers["retry-after"] == "1"
    server.process.wait(30)


def test_control_calls_still_waiting_as_the_drain_ends_are_answered_503(
        serve: Callable[..., Server], example_repository: Path, redis_url: str, key_prefix: str) -> None:
    """A repository call waiting for the control plane (a load, the index, a wake) as the drain ended was
    cut with the gateway (curl's "empty reply"): only inference requests were answered 503. Now both."""
    server = serve(example_repository, env={"DESPINA_DRAIN_TIMEOUT_S": "3"}, wait_models=("mlp",))
    (control,) = role_pids(server, "control")
    client = redis.Redis.from_url(redis_url)
    commands = Keys(key_prefix).control_commands
    before = client.xlen(commands)
    os.kill(control, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            index = pool.submit(httpx.post, f"{server.url}/v2/repository/index", timeout=60)
            deadline = time.monotonic() + 30
            while client.xlen(commands) == before and time.monotonic() < deadline:
                time.sleep(0.05)  # the call waits for its answer now
            server.process.send_signal(signal.SIGTERM)
            answer = index.result(60)
    finally:
        os.kill(control, signal.SIGCONT)
        client.close()
    assert answer.status_code == 503, answer.text
    assert "did not answer 'index' within its drain time" in answer.json()["error"]
    server.process.wait(30)


def test_a_drain_of_less_than_a_second_is_waited_out(serve: Callable[..., Server],
                                                    example_repository: Path) -> None:
    # the gateway's drain was int(DESPINA_DRAIN_TIMEOUT_S): 0.9 s was none, and what was in flight was
    # answered 503 ("no answer came within its drain time") the moment SIGTERM came, however close its answer
    server = serve(example_repository, env={"DESPINA_DRAIN_TIMEOUT_S": "0.9"}, wait_models=("mlp",))
    (worker,) = role_pids(server, "worker")
    signalled = 0.0

    async def sigterm() -> None:
        nonlocal signalled
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

    os.kill(worker, signal.SIGSTOP)
    try:
        answers = asyncio.run(five_waiting_then(server, sigterm))
    finally:
        os.kill(worker, signal.SIGCONT)
    waited = time.monotonic() - signalled
    assert [r.status_code if isinstance(r, httpx.Response) else r for r in answers] == [503] * 5
    assert waited >= 0.6  # the gateway gives up a quarter of its drain before the end: at 0.675 s
    server.process.wait(30)


def test_a_second_signal_during_the_drain_stops_everything_at_once(
        serve: Callable[..., Server], example_repository: Path) -> None:
    # it was ignored: a second Ctrl-C left serve waiting out a drain of up to DESPINA_DRAIN_TIMEOUT_S
    # (here 60 s, with the worker stopped and five requests that cannot be answered)
    server = serve(example_repository, env={"DESPINA_DRAIN_TIMEOUT_S": "60"}, wait_models=("mlp",))
    family = descendants(server.process.pid)
    (worker,) = role_pids(server, "worker")

    async def sigterm_twice() -> None:
        server.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        server.process.send_signal(signal.SIGTERM)

    os.kill(worker, signal.SIGSTOP)
    started = time.monotonic()
    try:
        asyncio.run(five_waiting_then(server, sigterm_twice))
        assert server.process.wait(15) == 0
    finally:
        if alive({worker}):
            os.kill(worker, signal.SIGCONT)
    assert time.monotonic() - started < 15
    assert "received SIGTERM again: stopping now" in server.logs()
    deadline = time.monotonic() + 10
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(family), [cmdline(p) for p in alive(family)]


def test_broken_config_is_reported_and_other_models_serve(serve: Callable[..., Server],
                                                          example_repository: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "mlp", repo / "mlp")
    shutil.copytree(example_repository / "mlp", repo / "broken")
    (repo / "broken" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 4\nbatch_size: 3\n')
    shutil.copytree(example_repository / "mlp", repo / "badtype")
    (repo / "badtype" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 4\ninput [{ name: "x", data_type: TYPE_BF16, dims: [256] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [10] }]\n')
    server = serve(repo, wait_models=("mlp",))
    assert httpx.post(f"{server.url}/fn/mlp", content=ROW).status_code == 200
    r = httpx.get(f"{server.url}/v2/models/broken")
    assert r.status_code == 503
    assert "model 'broken'" in r.json()["error"] and "batch_size" in r.json()["error"]
    r = httpx.post(f"{server.url}/v2/models/badtype/infer", content=b"{}")
    # (the model's x is FP32: the check against the model's tensors speaks first)
    assert r.status_code == 503 and "input 'x': the config says TYPE_BF16, the model TYPE_FP32" in r.json()["error"]
    assert "model 'broken': invalid config.pbtxt" in server.logs()


def test_body_limit_and_deadline(serve: Callable[..., Server], example_repository: Path) -> None:
    server = serve(example_repository, wait_models=("mlp",),
                   env={"DESPINA_MAX_BODY_BYTES": "4000", "DESPINA_REQUEST_TIMEOUT_S": "0.00001"})
    r = httpx.post(f"{server.url}/fn/mlp", content=orjson.dumps([[0.5] * 256] * 8))
    assert r.status_code == 413 and "limit" in r.json()["error"]
    r = httpx.post(f"{server.url}/fn/mlp", content=ROW)
    message = r.json()["error"]
    assert r.status_code == 504 and ("timed out" in message or "no answer" in message)


@pytest.mark.parametrize("role", ["gateway", "worker", "control"])
def test_roles_need_a_redis_url(role: str) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "despina", role], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and "--redis-url" in r.stderr


@pytest.mark.parametrize(("env", "args", "said"), [
    ({"DESPINA_CACHE_MAX_GB": "lots"}, [], "DESPINA_CACHE_MAX_GB='lots': expected a number"),
    ({"DESPINA_WORKERS": "2.5"}, [], "DESPINA_WORKERS='2.5': expected a whole number"),
    ({"DESPINA_AUTH_INFERENCE": "maybe"}, [], "DESPINA_AUTH_INFERENCE='maybe': expected true or false"),
    ({"DESPINA_WORKER_TTL_S": "nan"}, [], "DESPINA_WORKER_TTL_S (or its command-line option) must be a number of 0"),
    ({}, ["--workers", "-1"], "DESPINA_WORKERS (or its command-line option) must be a number of 0 or more, got -1"),
    ({}, ["--gateways", "0"], "DESPINA_GATEWAYS (or --gateways) must be 1 or more, got 0"),
    # 0 is not "none" for these: every request 504, or requests redelivered every millisecond
    ({}, ["--request-timeout", "0"], "DESPINA_REQUEST_TIMEOUT_S (or its command-line option) must be more than 0"),
    ({"DESPINA_VISIBILITY_TIMEOUT_S": "0"}, [], "DESPINA_VISIBILITY_TIMEOUT_S (or its command-line option) must be"),
    # ... or every request 408 (the read timeouts)
    ({}, ["--header-timeout", "0"], "DESPINA_HEADER_TIMEOUT_S (or its command-line option) must be more than 0"),
    ({"DESPINA_BODY_TIMEOUT_S": "-1"}, [], "DESPINA_BODY_TIMEOUT_S (or its command-line option) must be a number"),
    # ... or every connection closed under its next request
    ({}, ["--keep-alive-timeout", "0"], "DESPINA_KEEP_ALIVE_TIMEOUT_S (or its command-line option) must be more"),
    ({"DESPINA_WORKER_CPUS": "first"}, [], "expected a CPU list such as 0-3,8, got 'first'"),
    ({}, ["--worker-cpus", "3-1"], "the range '3-1' runs backwards"),
    ({}, ["--worker-cpus", "0,99999"], "--worker-cpus: CPU 99999 is not available here"),
    ({}, ["--worker-nice", "20"], "DESPINA_WORKER_NICE (or --worker-nice) must be 0 to 19, got 20"),
    ({}, ["--model-load-thread-count", "0"], "DESPINA_MODEL_LOAD_THREADS (or --model-load-thread-count) must be 1 or"),
    ({}, ["--load-model", "*", "--load-model", "add_sub"], "'*' loads every model and must be the only one named"),
    ({}, ["--colocate", "--worker-cpus", "0"], "(--colocate, --worker-cpus) do not go together"),
    ({"DESPINA_COLOCATE": "sometimes"}, [], "DESPINA_COLOCATE='sometimes': expected true or false"),
    ({"DESPINA_LOG_LEVEL": "loud"}, [], "DESPINA_LOG_LEVEL must be one of debug, info, warning, error, got 'loud'"),
    ({"DESPINA_LOG_FORMAT": "xml"}, [], "DESPINA_LOG_FORMAT must be one of text, json, got 'xml'"),
    ({"DESPINA_MODEL_CONTROL_MODE": "manual"}, [], "DESPINA_MODEL_CONTROL_MODE must be one of none, explicit"),
    ({"DESPINA_S3_ADDRESSING_STYLE": "dns"}, [], "DESPINA_S3_ADDRESSING_STYLE must be one of auto, path, virtual"),
    ({}, ["--http-port", "70000"], "DESPINA_HTTP_PORT (or --http-port) must be a port number, 65535 at most"),
    ({"DESPINA_METRICS_PORT": "65536"}, [], "DESPINA_METRICS_PORT (or --metrics-port) must be a port number"),
    ({}, ["--model-repository", "/nonexistent"], "--model-repository): /nonexistent is not a folder"),
    ({"REDIS_URL": "localhost:6379"}, [], "DESPINA_REDIS_URL (or REDIS_URL, --redis-url) must be a redis://"),
    # redis-py takes these and fails at the first command, each role with a traceback (or reads db 0)
    ({"REDIS_URL": "redis://127.0.0.1:abc"}, [], "--redis-url): Port could not be cast to integer value as 'abc'"),
    ({}, ["--redis-url", "redis://127.0.0.1/0?colour=blue"], "--redis-url): unknown parameter 'colour'"),
    ({"DESPINA_REDIS_URL": "unix://"}, [], "--redis-url): a unix:// URL names the socket's path"),
    ({"REDIS_URL": "redis://127.0.0.1:6379/x"}, [], "--redis-url): the database (the URL's path) must be a number"),
    ({"DESPINA_MODEL_REPOSITORY": "README.md"}, [], "DESPINA_MODEL_REPOSITORY (or --model-repository): README.md is"),
])
def test_a_bad_setting_is_named_and_nothing_starts(env: dict[str, str], args: list[str], said: str) -> None:
    r = subprocess.run([sys.executable, "-m", "despina", "serve", *args], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", **env}, timeout=60)
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(("env", "args", "said"), [
    ({}, ["--api-keys-file", "/nonexistent"], "gateway: cannot read the API keys file /nonexistent: "),
    ({"DESPINA_API_KEYS": "not a key"}, [], "gateway: DESPINA_API_KEYS, entry 1: an API key may hold only"),
    ({}, ["--http-restricted-api", "inference"], "gateway: DESPINA_HTTP_RESTRICTED_API, group 1: expected"),
])
def test_a_bad_security_setting_stops_serve_in_one_line(example_repository: Path, env: dict[str, str],
                                                         args: list[str], said: str) -> None:
    r = subprocess.run([sys.executable, "-m", "despina", "serve", "--model-repository", str(example_repository),
                        "--http-port", str(free_port()), "--metrics-port", "0", *args],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env}, timeout=60)
    assert r.returncode == START_FAILED and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_gateways_share_the_port_and_drain_together(serve: Callable[..., Server], example_repository: Path,
                                                    redis_url: str, key_prefix: str) -> None:
    server = serve(example_repository, "--gateways", "3", wait_models=("mlp",))
    gateways = [p for p in descendants(server.process.pid) if "despina gateway" in cmdline(p)]
    assert len(gateways) == 3

    async def many() -> list[int]:  # one connection per request: the kernel spreads them over the three
        async def one() -> int:
            async with httpx.AsyncClient(timeout=30) as client:
                return (await client.post(f"{server.url}/fn/mlp", content=ROW)).status_code
        return await asyncio.gather(*(one() for _ in range(60)))

    assert asyncio.run(many()) == [200] * 60
    with redis.Redis.from_url(redis_url) as client:
        replied = client.keys(f"{key_prefix}:rep:*")
    assert len(replied) >= 2, replied  # each gateway has a reply stream of its own
    assert stop_server(server) == 0
    assert not alive(set(gateways))


def test_a_crashed_gateway_is_restarted_and_the_others_serve_meanwhile(
        serve: Callable[..., Server], example_repository: Path) -> None:
    server = serve(example_repository, "--gateways", "2", wait_models=("mlp",))
    gateways = {p for p in descendants(server.process.pid) if "despina gateway" in cmdline(p)}
    victim = min(gateways)
    settle(server, victim)
    os.kill(victim, signal.SIGKILL)
    for _ in range(20):  # new connections go to the gateway still listening
        assert httpx.post(f"{server.url}/fn/mlp", content=ROW, timeout=10).status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = {p for p in descendants(server.process.pid) if "despina gateway" in cmdline(p)}
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.1)
    assert len(now) == 2 and victim not in now and server.process.poll() is None
    assert "gateway 0 exited with -9; restarting it" in server.logs() or \
        "gateway 1 exited with -9; restarting it" in server.logs()
    assert stop_server(server) == 0


def test_a_crashed_control_plane_is_restarted_and_the_models_serve_on(
        serve: Callable[..., Server], example_repository: Path) -> None:
    # it used to stop everything: every connection refused from then on, though the workers and gateways
    # serve without it and the control plane takes its state back from Redis and the repository
    server = serve(example_repository, wait_models=("mlp",))
    victim = next(p for p in descendants(server.process.pid) if "despina control" in cmdline(p))
    settle(server, victim)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert httpx.post(f"{server.url}/fn/mlp", content=ROW, timeout=10).status_code == 200
        now = [p for p in descendants(server.process.pid) if "despina control" in cmdline(p)]
        if now and victim not in now and "control exited with -9; restarting it" in server.logs():
            break
        time.sleep(0.2)
    assert now and victim not in now and server.process.poll() is None, server.logs()[-2000:]
    # the new one leads (it takes the killed one's lease at once): the repository API is answered
    assert httpx.post(f"{server.url}/v2/repository/index", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
    # and it read the repository it took over as unchanged (it said every model "changed")
    deadline = time.monotonic() + 20
    while server.logs().count("catalog: ") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.logs().count("catalog: ") == 2 and "changed in the repository" not in server.logs()
    assert stop_server(server) == 0


def test_a_control_plane_that_lost_its_lease_is_restarted_and_leads_again(
        serve: Callable[..., Server], example_repository: Path, redis_url: str, key_prefix: str) -> None:
    """A leader that finds another holding its lease (it stalled past it) stops with exit code 0: serve must
    start another (which stands by until the lease is free, then leads), not run on with no control plane."""
    server = serve(example_repository, wait_models=("mlp",))
    (victim,) = role_pids(server, "control")
    settle(server, victim)
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(Keys(key_prefix).control_leader, "another", px=3000)  # gone in 3 s, as a dead holder's
    finally:
        client.close()
    deadline = time.monotonic() + 20
    while "control exited with 0; restarting it" not in server.logs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "lost its lease to another" in server.logs(), server.logs()[-2000:]
    assert "control exited with 0; restarting it" in server.logs(), server.logs()[-2000:]
    while server.logs().count("leads (") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.logs().count("leads (") == 2 and server.process.poll() is None, server.logs()[-2000:]
    assert role_pids(server, "control") != [victim]
    assert httpx.post(f"{server.url}/v2/repository/index", timeout=30).status_code == 200
    assert stop_server(server) == 0


def test_a_cold_start_right_after_the_control_plane_is_killed_waits_for_its_restart_only(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The restarted control plane stood by until the killed one's lease ran out (up to 10 s), though serve
    knew that one dead: a request for a model scaled to zero meanwhile got 503 after its 5 s. Now serve tells
    the new one whom it replaces, and it takes that one's lease at once."""
    mlp_folder(tmp_path / "repo", extra='parameters { key: "idle_timeout_s" value: { string_value: "0.5" } }')
    server = serve(tmp_path / "repo", "--request-timeout", "5", wait_models=("mlp",))
    assert infer(server.url).status_code == 200  # (its idle clock starts once it serves)
    wait_until(lambda: getattr(catalog_entry(redis_url, key_prefix, "mlp"), "target", "") == "idle", server, 20)
    (victim,) = role_pids(server, "control")
    settle(server, victim)
    client = redis.Redis.from_url(redis_url)
    try:  # killed just after a renewal: its lease has 9 s and more to run
        wait_until(lambda: client.pttl(Keys(key_prefix).control_leader) > 9_000, server, 10)
        os.kill(victim, signal.SIGKILL)
    finally:
        client.close()
    sent = time.monotonic()
    r = infer(server.url, timeout=15)
    assert r.status_code == 200, (r.text, server.logs()[-3000:])
    assert time.monotonic() - sent < 5
    assert "control exited with -9; restarting it" in server.logs()
    assert server.logs().count("leads (") == 2 and "which exited" in server.logs(), server.logs()[-3000:]
    assert stop_server(server) == 0


def test_the_embedded_valkeys_end_stops_serve_with_its_reason(
        serve: Callable[..., Server], example_repository: Path) -> None:
    # it used to go unnoticed: serve stayed up (live, every request 503) with the roles retrying forever
    server = serve(example_repository, use_redis=False, wait_models=("mlp",))
    family = descendants(server.process.pid)
    valkey = next(p for p in family if "valkey" in cmdline(p))
    os.kill(valkey, signal.SIGKILL)
    assert server.process.wait(30) == 1
    assert "the embedded Valkey exited with -9, and the queues and the catalog with it; stopping everything" \
        in server.logs()
    deadline = time.monotonic() + 15
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(family), [cmdline(p) for p in alive(family)]


def test_a_shared_port_that_another_program_holds_is_refused_by_name() -> None:
    from despina.roles import reuse_port_socket

    with socket.socket() as holder:  # bound without SO_REUSEPORT: no gateway may join it
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot bind 127.0.0.1:{port}: address already in use"):
            reuse_port_socket("127.0.0.1", port)
    first = reuse_port_socket("127.0.0.1", 0)
    second = reuse_port_socket("127.0.0.1", first.getsockname()[1])  # two gateways, one port
    first.close(), second.close()


def test_a_second_serve_on_the_same_port_stops_in_one_line(serve: Callable[..., Server],
                                                           example_repository: Path) -> None:
    # with --gateways 2 it used to serve beside the first, SO_REUSEPORT giving each some of the connections
    server = serve(example_repository, "--gateways", "2", wait_models=("mlp",))
    port = server.url.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "despina", "serve", "--model-repository", str(example_repository),
                        "--gateways", "2", "--http-port", port, "--metrics-port", "0"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert r.returncode == 1 and f"serve: cannot bind 127.0.0.1:{port}: address already in use" in r.stderr
    assert "Traceback" not in r.stderr and "embedded Valkey" not in r.stderr, r.stderr
    assert httpx.post(f"{server.url}/fn/mlp", content=ROW).status_code == 200


def test_a_metrics_port_that_another_program_holds_stops_serve_in_one_line(example_repository: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "despina", "serve", "--model-repository", str(example_repository),
                            "--http-port", str(free_port()), "--metrics-port", str(port)],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.returncode == START_FAILED and f"control: cannot bind 127.0.0.1:{port}: address already in use" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_a_port_bound_at_start_is_held_from_then_on() -> None:
    """The control plane's metrics port is claimed at once: bound only, another program could bind it too
    (SO_REUSEADDR: uvicorn's, Valkey's) and listen first, and the metrics server, listening later in a
    task, failed unseen. Seen with test processes side by side: connection refused on a serve's metrics."""
    with bound_socket("127.0.0.1", 0, "control") as sock, socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError, match="in use"):
            other.bind(sock.getsockname())


def affinity(pid: int) -> set[frozenset[int]]:
    """The CPU sets a process's threads may run on (one set when all agree)."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def serve_processes(server: Server) -> tuple[dict[int, str], list[int], list[int]]:
    """serve's descendants by command line; its workers with their Python models' processes; the rest.
    A process started but not yet exec'd shows its parent's command line: a Python model's process
    being started by a gateway (vforked, caught once under load) counted as a third gateway. Such are
    left out."""
    family = descendants(server.process.pid)
    lines = {p: cmdline(p) for p in family | {server.process.pid}}
    roles = {p: c for p, c in lines.items() if p in family and c != lines.get(parent(p) or 0)}
    workers = [p for p, c in roles.items() if "despina worker" in c or "python_stub/stub.py" in c]
    others = [p for p, c in roles.items() if any(r in c for r in ("despina gateway", "despina control", "valkey"))]
    return roles, workers, others


def niceness(pid: int) -> set[int]:
    """The nice values of a process's threads (one when all agree)."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_workers_sharing_the_cpus_run_nicer_than_the_gateway(serve: Callable[..., Server],
                                                              example_repository: Path) -> None:
    """Every thread of a worker and of its Python models' processes, and only theirs, at DESPINA_WORKER_NICE
    above serve's own niceness."""
    server = serve(example_repository, "--worker-nice", "3", use_redis=False, wait_models=("mlp", "classify_post"))
    assert httpx.post(f"{server.url}/fn/mlp", content=ROW).status_code == 200
    base = os.getpriority(os.PRIO_PROCESS, server.process.pid)
    roles, workers, others = serve_processes(server)
    assert len([p for p in workers if "despina worker" in roles[p]]) == 1 and len(workers) > 1, roles
    assert len(others) == 3, roles
    for pid in workers:
        assert niceness(pid) == {min(base + 3, 19)}, roles[pid]
    for pid in others:
        assert niceness(pid) == {base}, roles[pid]
    assert stop_server(server) == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_worker_cpus_pin_every_worker_thread_and_the_other_processes_elsewhere(
        serve: Callable[..., Server], example_repository: Path) -> None:
    mine = os.sched_getaffinity(0)
    first = min(mine)
    server = serve(example_repository, "--worker-cpus", str(first), "--workers", "2", use_redis=False,
                   wait_models=("mlp", "classify_post"))
    assert httpx.post(f"{server.url}/fn/mlp", content=ROW).status_code == 200
    roles, workers, others = serve_processes(server)
    # a worker's Python models run in processes of their own, which it started after it pinned itself
    assert any("stub.py" in roles[p] for p in workers), roles
    assert len([p for p in workers if "despina worker" in roles[p]]) == 2 and len(others) == 3, roles
    for pid in workers:  # the backends' threads included: they started after the worker pinned itself
        assert affinity(pid) == {frozenset({first})}, roles[pid]
        assert niceness(pid) == niceness(server.process.pid)  # on CPUs of their own: no need to be nicer
    for pid in others:
        assert affinity(pid) == {frozenset(mine - {first})}, roles[pid]
    assert affinity(server.process.pid) == {frozenset(mine)}  # restarts a worker with every CPU to pick from
    assert f"workers on CPU {first}; Valkey, control plane and gateways on CPU" in server.logs()
    assert "1 CPU(s)" in server.logs()  # what a worker reports to the control plane: the CPUs it may use
    assert stop_server(server) == 0


def test_sigterm_on_an_idle_server_exits_zero(serve: Callable[..., Server], example_repository: Path) -> None:
    server = serve(example_repository)
    assert stop_server(server) == 0


HANG = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3600)

    def execute(self, requests):
        return []
"""


def test_sigterm_while_a_model_hangs_in_initialize_leaves_nothing_behind(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """The worker cannot finish that load: it exits without it, and the model's process follows. Asked
    first (SIGUSR1, SIGUSR2), the processes tell where they are stuck: the model's thread in initialize,
    the worker's task in the load."""
    (tmp_path / "repo" / "hang" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "hang" / "1" / "model.py").write_text(HANG)
    (tmp_path / "repo" / "hang" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]\n')
    server = serve(tmp_path / "repo", health="live")
    deadline = time.monotonic() + 30
    while "python_stub" not in " ".join(cmdline(p) for p in descendants(server.process.pid)):
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.1)
    for _ in range(5):  # until the model's process is past its start-up, in initialize
        dump_stacks(server.process.pid)
        logs = server.logs()
        if re.search(r'model\.py", line \d+ in initialize', logs):
            break
    assert re.search(r'model\.py", line \d+ in initialize', logs), logs
    assert re.search(r"loading\.py:\d+ in _load", logs), logs
    family = descendants(server.process.pid)
    assert stop_server(server) == 0
    deadline = time.monotonic() + 15
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(family), [cmdline(p) for p in alive(family)]
    assert "stuck in model code" in server.logs()


def test_a_gateway_is_ready_to_take_requests_while_a_model_has_no_worker(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path) -> None:
    """/readyz (a load balancer's probe) says whether this gateway can take requests; /v2/health/ready
    (Triton's) whether every model is loaded. With no worker, no model loads: every gateway would leave
    a Kubernetes Service on the second, none on the first."""
    shutil.copytree(example_repository / "add_sub", tmp_path / "repo" / "add_sub")
    server = serve(tmp_path / "repo", "--workers", "0", health="live")
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/readyz").status_code != 200:
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 400
    assert httpx.get(f"{server.url}/v2/models/add_sub/ready").status_code == 400


def test_ready_only_once_the_catalog_is_published(serve: Callable[..., Server], example_repository: Path) -> None:
    """/v2/health/ready answers 200 only when every model of the repository would be served: not in the
    moment after the gateway starts and before the control plane has read the repository. (Not strict:
    the models of the examples whose files this test run has not built fail to load, and would keep a
    strict server not ready for good.)"""
    server = serve(example_repository, "--strict-readiness=false", health="live")
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=2) as client:
        while client.get(f"{server.url}/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.005)
        index = client.post(f"{server.url}/v2/repository/index", json={}).json()
        r = client.post(f"{server.url}/fn/mlp", content=ROW)
        assert r.status_code == 200, r.text
    # every model is known, and settled: loaded, or failed with its reason (the backends this test run
    # lacks), none still on its way
    assert sorted(m["name"] for m in index) == sorted(m.name for m in example_repository.iterdir())
    assert {m["state"] for m in index} <= {"READY", "UNAVAILABLE"}, index
    assert all(m.get("reason") for m in index if m["state"] != "READY"), index


def test_a_colocated_worker_serves_from_the_gateways_process_and_drains_with_it(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path, redis_url: str,
        key_prefix: str) -> None:
    """--colocate: the worker runs in the gateway's process (no `despina worker`), still registered and
    read through the streams; its Python model's process is the gateway's child; the ensemble runs
    there too. SIGTERM answers every request in flight (20 waiting in the batcher), and nothing is left."""
    repo = slow_repository(example_repository, tmp_path / "slow", "classify_post", "mlp_classify")
    server = serve(repo, "--colocate", wait_models=("mlp", "mlp_classify"), env=FULL_QUEUE_DELAY)
    roles, _, _ = serve_processes(server)
    gateways = [p for p, c in roles.items() if "despina gateway" in c]
    assert len(gateways) == 1 and not any("despina worker" in c for c in roles.values()), roles
    stubs = [p for p, c in roles.items() if "python_stub/stub.py" in c]
    assert stubs and all(f"PPid:\t{gateways[0]}\n" in Path(f"/proc/{p}/status").read_text() for p in stubs)
    with redis.Redis.from_url(redis_url) as r:
        assert len(r.smembers(f"{key_prefix}:workers")) == 1
        assert "1 worker(s) inside gateways" in server.logs()
        ensemble = httpx.post(f"{server.url}/v2/models/mlp_classify/infer", timeout=30, json={"inputs": [
            {"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.25] * 256}]})
        assert ensemble.status_code == 200, ensemble.text
        assert {o["name"] for o in ensemble.json()["outputs"]} >= {"label"}
        sigterm_answers_twenty_in_flight(server)
        assert not r.smembers(f"{key_prefix}:workers")  # it said goodbye as a worker process does


def test_colocated_workers_beyond_the_gateways_run_as_their_own_processes(
        serve: Callable[..., Server], example_repository: Path, redis_url: str, key_prefix: str) -> None:
    """--colocate --workers 3 --gateways 2: gateway 0 and 1 each run a worker, the third runs alone, and
    a model replicated on every worker answers from all three."""
    server = serve(example_repository, "--colocate", "--workers", "3", "--gateways", "2", "--model-replicas",
                   "0", wait_models=("mlp",))
    roles, _, _ = serve_processes(server)
    assert len([p for p, c in roles.items() if "despina gateway" in c]) == 2, roles
    assert len([p for p, c in roles.items() if "despina worker" in c]) == 1, roles
    with redis.Redis.from_url(redis_url) as r:
        deadline = time.monotonic() + 60
        while True:  # every worker reports mlp READY
            states = [r.hget(f"{key_prefix}:worker:{w.decode()}", "models")
                      for w in r.smembers(f"{key_prefix}:workers")]
            if len(states) == 3 and all(s and orjson.loads(s).get("mlp", {}).get("1") == "READY" for s in states):
                break
            assert time.monotonic() < deadline, (states, server.logs())
            time.sleep(0.2)
        names = {w.decode().rsplit(".", 1)[0].rsplit("-", 1)[-1] for w in r.smembers(f"{key_prefix}:workers")}
    assert names == {"w0", "w1", "w2"}  # serve's names, the colocated ones too

    async def many() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            return [r.status_code for r in await asyncio.gather(
                *(client.post(f"{server.url}/fn/mlp", content=ROW) for _ in range(60)))]

    assert asyncio.run(many()) == [200] * 60
    assert stop_server(server) == 0


def serve_whose_workers_key_is_not_a_set(example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str,
                                         *args: str) -> tuple[int | None, str]:
    """serve against a Redis where the workers' set is a string, another program's key where Despina's
    belongs, so that a worker's first write is refused: its exit status and output once it stopped (None:
    it ran on, and was stopped with its roles after 60 s), nothing left."""
    with redis.Redis.from_url(redis_url) as r:
        r.set(f"{key_prefix}:workers", "not a set")
    shutil.copytree(example_repository / "mlp", tmp_path / "repo" / "mlp")
    code, out, family = ended(launch(tmp_path, redis_url, key_prefix, "--workers", "1", *args))
    deadline = time.monotonic() + 5  # (serve waits for its roles; stopped after 60 s, they die with it)
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(family), [cmdline(p) for p in alive(family)]
    assert "Traceback" not in out, out
    # the control plane and the gateway meet the same key: Redis answered, so not "unreachable"
    assert "Redis refused a command (WRONGTYPE" in out and "another program's key under this key prefix?" in out
    assert "Redis unreachable" not in out, out
    return code, out


def test_a_colocated_worker_that_cannot_start_stops_serve_with_its_reason(
        example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A gateway whose worker ends does not go on without it: here the worker's first write to Redis is
    refused, the gateway says why and stops with START_FAILED, and serve stops everything (START_FAILED too), the
    worker's error said once and not as a traceback. The gateway died of its own SIGTERM, and serve judged
    by the time since its start: on a loaded machine that start took over 5 s, serve restarted the
    gateway and the reason was said twice."""
    code, out = serve_whose_workers_key_is_not_a_set(example_repository, tmp_path, redis_url, key_prefix,
                                                     "--colocate")
    assert code == START_FAILED, out
    said = re.findall(r"worker \S+ ended while its gateway serves \((.*)\): stopping the process", out)
    assert said == ["ResponseError: WRONGTYPE Operation against a key holding the wrong kind of value"], out
    assert "gateway exited with 3 at its start; stopping everything" in out and "restarting" not in out, out


def test_a_worker_process_that_cannot_start_stops_serve_with_its_reason(
        example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The same refused first write in a worker of its own (no --colocate): it wrote a traceback and exited
    1, and serve restarted it every second for ever. It says why in one line and exits START_FAILED now,
    and serve stops everything, as it does for a gateway that could not start."""
    code, out = serve_whose_workers_key_is_not_a_set(example_repository, tmp_path, redis_url, key_prefix)
    assert code == START_FAILED, out
    said = re.findall(r"worker \S+: cannot start: (.*)", out)
    assert said == ["Redis refused a command (WRONGTYPE Operation against a key holding the wrong kind of value): "
                    "another program's key under this key prefix? (--key-prefix)"], out
    assert "worker 0 exited with 3 at its start; stopping everything" in out and "restarting" not in out, out


def test_the_readme_configuration_table_names_every_setting_and_flag() -> None:
    """Every setting has its row in README's Configuration table, and every flag there is one `despina`
    takes: the metrics port, the drain's time, the restricted APIs, shared memory and the worker's id had
    none, so that a reader of the table could not know them."""
    from despina.cli import parser
    from despina.settings import Settings

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("\n## Configuration\n", 1)[1].split("\n\n| flag |", 1)[1].split("\n\n", 1)[0]
    variables = set(re.findall(r"DESPINA_[A-Z0-9_]+", table.replace("[_FILE]", " DESPINA_API_KEYS_FILE")))
    undocumented = {f"DESPINA_{f.upper()}" for f in Settings.__dataclass_fields__} - variables
    assert not undocumented, undocumented
    helps = io.StringIO()
    for command in ("serve", "gateway", "worker", "control"):
        with contextlib.redirect_stdout(helps), pytest.raises(SystemExit):
            parser().parse_args([command, "-h"])
    options = set(re.findall(r"--[a-z-]+", helps.getvalue()))
    flags = {flag for row in table.splitlines() for flag in re.findall(r"`(--[a-z-]+)", row.split("|")[1])}
    assert flags and flags <= options, flags - options


def mlp_copies(example_repository: Path, repo: Path, **groups: str) -> None:
    """The example MLP under each name given, its instance_group (and parameters) replaced by the text."""
    for name, group in groups.items():
        shutil.copytree(example_repository / "mlp", repo / name)
        config = (repo / name / "config.pbtxt").read_text().replace('name: "mlp"', f'name: "{name}"')
        (repo / name / "config.pbtxt").write_text(
            config.replace("instance_group [ { count: 1, kind: KIND_CPU } ]", group))


def test_a_model_none_of_serves_workers_can_hold_fails_at_once_with_its_reason(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path) -> None:
    """serve's workers are all there will be: a model that needs a GPU none has, or more memory than any
    offers, is UNAVAILABLE with that reason once they have come, as Triton fails its load. Its requests
    and its loads waited their whole deadline (60 s, 300 s) for a worker that could never join."""
    repo = tmp_path / "repo"
    mlp_copies(example_repository, repo, mlp="instance_group [ { count: 1, kind: KIND_CPU } ]",
               on_gpu="instance_group [ { count: 1, kind: KIND_GPU } ]",
               big='parameters { key: "memory_mb" value { string_value: "100000" } }')
    # (--exit-on-error=false: else on_gpu's failed load stops the start, as Triton's does; and
    # --strict-readiness=false: else on_gpu's failure keeps /v2/health/ready 400, as Triton's does)
    server = serve(repo, "--model-control-mode", "explicit", "--exit-on-error=false", "--strict-readiness=false",
                   "--load-model", "on_gpu", "--load-model", "mlp", env={"DESPINA_WORKER_MEMORY_MB": "512"},
                   health="live")
    rows = wait_until(lambda: {r["name"]: r for r in httpx.post(f"{server.url}/v2/repository/index").json()
                               if r.get("state") not in (None, "LOADING")}.get("on_gpu"), server)
    assert rows["state"] == "UNAVAILABLE" and "KIND_GPU needs 1 GPU(s), but no GPUs are available" in \
        rows["reason"], rows
    deadline = time.monotonic() + 30  # once mlp has loaded too (on a loaded machine, after on_gpu failed)
    while httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code != 200:  # settled, as Triton's
        assert time.monotonic() < deadline, server.logs()[-3000:]
        time.sleep(0.1)
    # the server's deadline is 60 s: the client's 30 s would run out first
    r = httpx.post(f"{server.url}/fn/on_gpu", content=ROW, timeout=30)  # Triton: "no available versions"
    assert r.status_code == 404 and "no GPUs are available" in r.json()["error"], r.text
    r = httpx.post(f"{server.url}/v2/repository/models/big/load", timeout=30)
    assert r.status_code == 400 and "needs 100000 MiB of memory, but no worker has that much" in \
        r.json()["error"], r.text
    # asked to fail without room, a load still hears so (SageMaker's 507)
    r = httpx.post(f"{server.url}/v2/repository/models/big/load",
                   json={"parameters": {"fail_without_room": True}}, timeout=30)
    assert r.status_code == 503 and "does not fit on any worker" in r.json()["error"], r.text
    # a worker restarting is not a worker gone: what it can hold waits for it, and loads
    (worker,) = role_pids(server, "worker")
    os.kill(worker, signal.SIGKILL)
    shutil.copytree(repo / "mlp", repo / "later")
    (repo / "later" / "config.pbtxt").write_text(
        (repo / "mlp" / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "later"'))
    r = httpx.post(f"{server.url}/v2/repository/models/later/load", timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/fn/later", content=ROW, timeout=30).status_code == 200
    assert "restarting it" in server.logs()


@pytest.mark.parametrize("how", ["--no-fixed-workers", "--workers 0"])
def test_workers_that_may_join_later_are_waited_for(
        serve: Callable[..., Server], example_repository: Path, tmp_path: Path, redis_url: str,
        key_prefix: str, how: str) -> None:
    """With workers started besides serve's (--no-fixed-workers), or only those (--workers 0, as
    separately started roles, which KEDA may scale from zero), a worker that can take the model may
    still join: the model waits for it, and the index says why."""
    repo = tmp_path / "repo"
    mlp_copies(example_repository, repo, on_gpu="instance_group [ { count: 1, kind: KIND_GPU } ]")
    server = serve(repo, *how.split(), health="live")
    worker = None
    if how == "--workers 0":
        worker = subprocess.Popen([sys.executable, "-m", "despina", "worker", "--redis-url", redis_url,
                                   "--key-prefix", key_prefix], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    try:
        row = wait_until(lambda: [r for r in httpx.post(f"{server.url}/v2/repository/index").json()
                                  if "0 GPU(s), the model needs 1" in r.get("reason", "")], server)
        assert row[0]["state"] == "LOADING", row
        time.sleep(2)  # (ticks enough to fail it, were it judged against a fixed set)
        (row,) = httpx.post(f"{server.url}/v2/repository/index").json()
        assert row["state"] == "LOADING", row
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)


def wait_until(check: Callable[[], object], server: Server, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.1)
    return found
