"""Fixtures: real servers only. A Redis (REDIS_URL, default the machine's 127.0.0.1:6379) with a key
prefix per test that is deleted afterwards, and `despina serve` started as a real process tree."""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from despina.counters import DEFER_S
from despina.embedded import EmbeddedValkey, die_with_parent, free_port
from despina.examples import build_repository

from . import leftovers
from .seaweed import s3_env, s3_store  # noqa: F401  (SeaweedFS fixtures for the S3 tests)

ROOT = Path(__file__).resolve().parents[1]
# how long after the last cleanup the session's end looks for leftovers: a control plane that outlived its test
# writes the catalog again within a tick (a second) of seeing its keys gone
LATE_WRITE_S = 1.5
ROLES_GONE_S = 5.0  # how long a stopped serve's roles get to end on their own (serve sends them SIGTERM)


EMBEDDED = os.environ.get("DESPINA_TEST_REDIS") == "embedded"
# Triton's batching rule to the letter: a batch waits out max_queue_delay even when no other request can
# join it. For tests that hold requests in a queue with a long delay, or that count on requests sent
# together sharing a batch however they trickle in (Despina's default sends a batch at once when every
# request in flight is in it: README, "Batching").
FULL_QUEUE_DELAY = {"DESPINA_FULL_QUEUE_DELAY": "true"}


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL (default the machine's 127.0.0.1:6379); with DESPINA_TEST_REDIS=embedded, or when
    that server does not answer, an embedded Valkey started for this session."""
    url = os.environ.get("DESPINA_TEST_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    if not EMBEDDED:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        except redis.ConnectionError:
            pass
        else:
            yield url
            check_leftovers(url)
            return
    server = EmbeddedValkey()
    server.start()
    try:
        yield server.url
        check_leftovers(server.url)
    finally:
        server.stop()


@pytest.fixture(autouse=True, scope="module")
def unclosed_in_this_module() -> Iterator[None]:
    """What a test's collection froze while something still held it (a cancelled task's frame holding its
    connections, say), looked at again once the module is done: its warnings fail the module's last test."""
    yield
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def unclosed_is_this_tests(unclosed_in_this_module: None) -> Iterator[None]:
    """Free what a test left unclosed (a Redis connection, a transport of a closed event loop) at its end, so
    that pytest's collection of unraisable warnings, which runs next, fails this test: left to the
    collector's own time, the warnings failed whichever later test of the process it happened to run in.
    What survives is frozen (not scanned again until its module ends), so that each test's collection
    looks only at what was made since the last one's: a full collection of a process that has imported torch
    and TensorFlow (~460k objects) took 1.9-2.8 s on a loaded 2-core machine."""
    yield
    gc.collect()
    gc.freeze()


def check_leftovers(redis_url: str) -> None:
    """At the session's end, when every test that used the Redis has cleaned up: fail on a key under a
    deleted test prefix (a process that outlived its test, or one that wrote to another database) and on
    a Despina process still running (tests/leftovers.py)."""
    roles = leftovers.stop_roles(descendants(os.getpid()))  # first: a live one would write on meanwhile
    if leftovers.DELETED:
        time.sleep(LATE_WRITE_S)
    keys = leftovers.left_keys(redis_url)
    assert not keys and not roles, "left after their tests' cleanup:\n" + "\n".join(keys + roles)


def settled_stats(url: str, model: str, timeout: float = 5.0) -> dict:
    """A model's statistics (model_stats[0]) once they stop changing. After a burst, a worker's last
    counters may reach Redis up to DEFER_S after the answers (despina/counters.py): a test that
    counts a burst reads them through this."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]
        if stats == last or time.monotonic() > deadline:
            return stats
        last = stats
        time.sleep(3 * DEFER_S)


def delete_prefix(redis_url: str, prefix: str) -> None:
    """A test's keys go with it."""
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def new_prefix() -> str:
    return f"{leftovers.PATTERN}{uuid.uuid4().hex[:10]}"


@pytest.fixture
def key_prefix(redis_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    prefix = new_prefix()
    yield prefix
    delete_prefix(redis_url, prefix)
    leftovers.deleted(prefix, request.node.nodeid)


@pytest.fixture(scope="session")
def example_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of model_repository/ with its model files built."""
    root = tmp_path_factory.mktemp("repo") / "model_repository"
    shutil.copytree(ROOT / "model_repository", root, ignore=shutil.ignore_patterns("*.onnx"))
    build_repository(root)
    return root


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    metrics_url: str = ""
    prefix: str = ""       # its Redis key prefix (module_server's)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


class PortTaken(Exception):
    """The free port we picked was taken before serve bound it (another process's connection got it)."""


def start_server(repo: Path, log_dir: Path, redis_url: str | None, key_prefix: str, *extra: str,
                 env: dict[str, str] | None = None, wait_models: tuple[str, ...] = (),
                 health: str = "ready") -> Server:
    for _ in range(3):
        try:
            return _start_server(repo, log_dir, redis_url, key_prefix, *extra, env=env,
                                 wait_models=wait_models, health=health)
        except PortTaken:
            continue
    raise RuntimeError("three free ports in a row were taken before despina serve could bind them")


def _start_server(repo: Path, log_dir: Path, redis_url: str | None, key_prefix: str, *extra: str,
                  env: dict[str, str] | None, wait_models: tuple[str, ...], health: str) -> Server:
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "despina", "serve", "--model-repository", str(repo),
           "--http-port", str(port), "--metrics-port", str(metrics_port), "--key-prefix", key_prefix, *extra]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
    if health == "ready":  # waited for as these tests were written: every model loaded or failed to load
        environ.setdefault("DESPINA_STRICT_READINESS", "false")  # (test_strict_readiness.py: Triton's default)
    environ.update(env or {})
    log = log_dir / f"serve-{port}.log"
    with log.open("wb") as out:
        # dies with pytest, even a pytest killed before its fixtures could stop it (a timeout's SIGTERM)
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ,
                                   start_new_session=True, preexec_fn=die_with_parent)
    server = Server(f"http://127.0.0.1:{port}", process, log, f"http://127.0.0.1:{metrics_port}/metrics")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            if "address already in use" in server.logs():
                raise PortTaken(server.logs())
            raise RuntimeError(f"despina serve exited with {process.returncode}:\n{server.logs()}")
        try:
            ok = httpx.get(f"{server.url}/v2/health/{health}", timeout=1).status_code == 200
            if ok and all(httpx.get(f"{server.url}/v2/models/{m}/ready", timeout=1).status_code == 200
                          for m in wait_models):
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    dump_stacks(server.process.pid)
    url = redis_url or (extra[extra.index("--redis-url") + 1] if "--redis-url" in extra else None)
    state = cluster_state(url, key_prefix) if url else ""
    stop_server(server)
    raise RuntimeError(f"despina serve did not get ready:\n{server.logs()}{state}")


def descendants(pid: int) -> set[int]:
    """Every process below `pid`."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def dump_stacks(pid: int) -> None:
    """Every Despina process under `pid` writes its threads' stacks into the log (SIGUSR1), and each
    role (gateway, worker, control: they handle it) its asyncio tasks' (SIGUSR2)."""
    for child in [pid, *sorted(descendants(pid))]:
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"despina" not in b" ".join(args):  # the roles, and model stubs
                continue
            os.kill(child, signal.SIGUSR1)
            time.sleep(0.3)  # one at a time: the dumps share the log
            if args[1:3] == [b"-m", b"despina"] and args[3:4] in ([b"gateway"], [b"worker"], [b"control"]):
                os.kill(child, signal.SIGUSR2)
                time.sleep(0.3)
        except OSError:
            pass


def cluster_state(redis_url: str, key_prefix: str) -> str:
    """What the processes told each other through Redis: the catalog and every worker's heartbeat."""
    from despina.contract.catalog import CatalogEntry
    from despina.contract.keys import Keys

    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        lines = [f"leader: {client.get(keys.control_leader)!r}",
                 f"workers: {sorted(m.decode() for m in client.smembers(keys.workers))}"]
        for blob in client.hgetall(keys.catalog).values():
            e = CatalogEntry.loads(blob)
            lines.append(f"catalog {e.name}: state={e.state} target={e.target} versions={e.versions} "
                         f"revisions={e.revisions} workers={e.workers} failed={e.failed} {e.reason}")
        for key in client.scan_iter(keys.worker("*")):
            h = client.hgetall(key)
            lines.append(f"{key.decode()}: ttl={client.pttl(key)} ms seen={h.get(b'seen')!r} "
                         f"detail={h.get(b'detail')!r}")
    except redis.RedisError as exc:
        lines = [f"Redis unreadable: {exc}"]
    finally:
        client.close()
    return "\n-- cluster state in Redis --\n" + "\n".join(lines)


def stop_server(server: Server, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Stop serve and every process under it, so that a cleanup after it (delete_prefix) is final. Its
    roles each run in a process group of their own: a serve killed at `timeout` (a drain may take
    DESPINA_DRAIN_TIMEOUT_S, 30 s, and more) left them running, its control plane writing the catalog again
    after the test's keys were deleted."""
    below = {pid: at for pid in descendants(server.process.pid) if (at := started(pid))}  # (not once it is gone)
    if server.process.poll() is None:
        server.process.send_signal(sig)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
    deadline = time.monotonic() + ROLES_GONE_S  # (serve waits for its roles: they are gone, or dying)
    while (left := [pid for pid, at in below.items() if started(pid) == at]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return server.process.returncode


def started(pid: int) -> str | None:
    """When `pid` started (its start time, in clock ticks after boot); None once it ended (a zombie too):
    a pid taken again by another process does not pass for the one that had it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


@pytest.fixture
def serve(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[Callable[..., Server]]:
    """Start `despina serve` on a repository (against the test Redis unless redis_url=None)."""
    started: list[Server] = []

    def start(repo: Path, *extra: str, use_redis: bool = True, **kw: object) -> Server:
        server = start_server(repo, tmp_path, redis_url if use_redis else None, key_prefix, *extra, **kw)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        stop_server(server)


@pytest.fixture(scope="module")
def example_server(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
                   example_repository: Path) -> Iterator[Server]:
    """One `despina serve` of the example repository, shared by a module's tests."""
    # DESPINA_TEST_REDIS=embedded: despina serve starts its own Valkey, as it does for a user
    yield from module_server(example_repository, tmp_path_factory, redis_url, ("mlp", "add_sub"),
                             use_redis=not EMBEDDED)


def module_server(repo: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str,
                  wait_models: tuple[str, ...], env: dict[str, str] | None = None,
                  use_redis: bool = True) -> Iterator[Server]:
    """Body of a module-scoped fixture: one `despina serve` of `repo` under a fresh key prefix
    (against the test Redis, or with use_redis=False its own embedded Valkey)."""
    prefix = new_prefix()
    try:  # a server that does not get ready leaves its keys too
        server = start_server(repo, tmp_path_factory.mktemp("logs"), redis_url if use_redis else None, prefix,
                              env=env, wait_models=wait_models)
        server.prefix = prefix
        yield server
        stop_server(server)
    finally:
        delete_prefix(redis_url, prefix)
        leftovers.deleted(prefix, f"the module server of {repo}")



def ipv6_loopback() -> bool:
    """Whether this machine has IPv6's loopback (::1): the IPv6 tests skip where it has not."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True
