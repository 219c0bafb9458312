"""The leader's lease under a hand-over: a control plane that stalled past its lease (a paused VM, SIGSTOP)
while a standby took over must act no more when it wakes, and the commands Redis handed it meanwhile are
answered by the new leader."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast
from urllib.parse import urlparse

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from despina.contract.catalog import CatalogEntry
from despina.contract.commands import INDEX, Answer, Command
from despina.contract.keys import CONTROL_GROUP, FIELD, GROUP, Keys
from despina.control.lease import Lease, LeaseLost
from despina.control.plane import ControlPlane
from despina.control.state import Catalog
from despina.embedded import die_with_parent, free_port
from despina.redis_client import connect
from despina.settings import Settings
from despina.workers.worker import Worker

from .conftest import Server, delete_prefix
from .control_support import infer, mlp_folder, wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def planes(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two `despina control` processes on one repository, started one after the other (the first leads);
    their metrics ports in tmp_path/<a|b>.port."""
    mlp_folder(tmp_path / "repo")
    started: list[subprocess.Popen[bytes]] = []
    environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DESPINA_REDIS_URL")}
    for name in ("a", "b"):
        port = free_port()
        (tmp_path / f"{name}.port").write_text(str(port))
        with (tmp_path / f"{name}.log").open("wb") as out:
            started.append(subprocess.Popen(
                [sys.executable, "-m", "despina", "control", "--redis-url", redis_url, "--key-prefix", key_prefix,
                 "--model-repository", str(tmp_path / "repo"), "--model-control-mode", "explicit",
                 "--metrics-port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=ROOT,
                preexec_fn=die_with_parent))
        if name == "a":
            wait_until(lambda: b"leads (" in (tmp_path / "a.log").read_bytes(), 30, what="the first to lead")
    yield started
    for process in started:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(10)


def test_commands_a_stalled_leader_was_handed_are_answered_by_the_new_one(
        planes: list[subprocess.Popen[bytes]], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The leader's read of the command stream was still waiting when it stalled, so Redis handed it the
    commands sent after the standby took over: nobody answered them while it stalled (a gateway's load
    waited out DESPINA_LOAD_TIMEOUT_S, 300 s), and when it woke it lost its lease and never did."""
    leader, standby = planes
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    log_b = tmp_path / "b.log"
    try:
        wait_until(lambda: b"standing by" in log_b.read_bytes(), 30, what="the standby")
        leader.send_signal(signal.SIGSTOP)
        wait_until(lambda: b"leads (" in log_b.read_bytes(), 20, what="the standby to take over")
        answers = keys.control_answers("test")
        command = Command(uuid.uuid4().hex, INDEX, deadline=time.time() + 30, reply=answers)
        client.xadd(keys.control_commands, {FIELD: command.dumps()})
        got = cast(list[bytes] | None, client.blpop([answers], 8))  # (the fix answers within ~3 s)
        assert got is not None, f"unanswered while the old leader stalls: {client.xpending(keys.control_commands, CONTROL_GROUP)}"
        assert Answer.loads(got[1]).id == command.id and Answer.loads(got[1]).result() == [{"name": "mlp"}]
        leader.send_signal(signal.SIGCONT)
        assert leader.wait(15) == 0  # it saw it lost the lease, and stopped
        assert "lost its lease to another" in (tmp_path / "a.log").read_text()
        assert standby.poll() is None and client.get(keys.control_leader) is not None
        assert client.llen(answers) == 0  # answered once
    finally:
        client.close()


async def test_a_stale_leader_s_catalog_write_is_refused(redis_url: str, key_prefix: str) -> None:
    """A catalog flush in flight as the lease passed to another wrote the old leader's catalog over the new
    one's: the workers followed it, and the new leader, whose entries were not dirty, never wrote them again."""
    keys = Keys(key_prefix)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set(keys.control_leader, "new")
        await client.hset(keys.catalog, "m", CatalogEntry("m", "/repo/m", {}, (2,)).dumps())
        stale = Catalog(client, keys, "old")
        stale.put(CatalogEntry("m", "/repo/m", {}, (1,)))
        with pytest.raises(LeaseLost):
            await stale.flush()
        assert CatalogEntry.loads(await client.hget(keys.catalog, "m")).versions == (2,)
        leader = Catalog(client, keys, "new")  # the leader writes; so does one after Redis lost the lease
        leader.put(CatalogEntry("m", "/repo/m", {}, (3,)))
        leader.put(CatalogEntry("n", "/repo/n", {}, (1,)))
        await leader.flush()
        await client.delete(keys.control_leader)
        leader.remove("n")
        await leader.flush()
        assert sorted(await client.hkeys(keys.catalog)) == [b"m"]
        assert CatalogEntry.loads(await client.hget(keys.catalog, "m")).versions == (3,)
    finally:
        await client.aclose()


async def test_a_stale_leader_neither_requeues_nor_answers(tmp_path: Path, redis_url: str,
                                                           key_prefix: str) -> None:
    """Woken from a stall, the old leader ticked (its check was that *a* lease existed, not that it was its
    own): it requeued a dead worker's requests the new leader was requeueing too (each ran twice), and it
    answered the commands Redis had handed it from its stale catalog."""
    keys = Keys(key_prefix)
    client = connect(redis_url)
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), client)
    stream = keys.request_stream("m", 1)
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        await client.xadd(stream, {FIELD: b"request"})
        await client.xreadgroup(GROUP, "dead-worker", {stream: ">"})
        await client.sadd(keys.workers, "dead-worker")  # no heartbeat hash: dead
        plane.catalog.put(CatalogEntry("m", "/repo/m", {}, (1,)))
        assert await plane.lease.take()
        await client.set(keys.control_leader, "the-new-leader")  # it stalled; another took over
        plane.lease.lapse()  # (as the local clock says after a stall past the lease)
        ticking = asyncio.create_task(plane._ticks())
        deadline = time.monotonic() + 5
        while not plane.stopping and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stopped, _ = plane.stopping, plane.stop()
        await ticking
        assert (await client.xpending(stream, GROUP))["consumers"] == [{"name": b"dead-worker", "pending": 1}]
        assert stopped, "it went on ticking"
        assert not await client.exists(keys.catalog)

        answers = keys.control_answers("test")
        await client.xgroup_create(keys.control_commands, CONTROL_GROUP, id="0", mkstream=True)
        command = Command(uuid.uuid4().hex, INDEX, deadline=time.time() + 30, reply=answers)
        await client.xadd(keys.control_commands, {FIELD: command.dumps()})
        [[_, [(entry_id, fields)]]] = await client.xreadgroup(CONTROL_GROUP, plane.id,
                                                               {keys.control_commands: ">"})
        await plane._run(entry_id, fields[FIELD])
        assert not await client.exists(answers)
        assert (await client.xpending(keys.control_commands, CONTROL_GROUP))["pending"] == 1  # left to claim
    finally:
        await client.aclose(close_connection_pool=True)


def test_a_standby_serves_no_figures_and_takes_over_at_once_from_a_leader_stopped_with_sigterm(
        planes: list[subprocess.Popen[bytes]], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """A standby served the whole deployment's figures too (read from Redis): Prometheus, which scrapes both
    pods while a rolling update overlaps them, counted each twice. It still answers /metrics (the update
    waits for the new pod's readiness), with despina_control_leader 0 and nothing else."""
    leader, standby = planes
    keys = Keys(key_prefix)
    log_b = tmp_path / "b.log"
    ports = {name: (tmp_path / f"{name}.port").read_text() for name in ("a", "b")}

    def metrics(name: str) -> str:
        r = httpx.get(f"http://127.0.0.1:{ports[name]}/metrics", timeout=10)
        assert r.status_code == 200, r.text
        return r.text

    def leading(name: str) -> str:
        text = metrics(name)
        return text if "despina_control_leader 1" in text else ""

    wait_until(lambda: b"standing by" in log_b.read_bytes(), 30, what="the standby")
    led = wait_until(lambda: leading("a"), 10, what="a's metrics")
    assert "# TYPE nv_" in led
    stood_by = metrics("b")
    assert "despina_control_leader 0" in stood_by and "nv_" not in stood_by, stood_by
    # a rolling update's stop: the standby leads within its next look (2 s), a command sent meanwhile answered
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    try:
        leader.send_signal(signal.SIGTERM)
        answers = keys.control_answers("test")
        command = Command(uuid.uuid4().hex, INDEX, deadline=time.time() + 30, reply=answers)
        client.xadd(keys.control_commands, {FIELD: command.dumps()})
        stopped = time.monotonic()
        got = cast(list[bytes] | None, client.blpop([answers], 10))
        assert got is not None and Answer.loads(got[1]).id == command.id
        assert time.monotonic() - stopped < 5
        assert leader.wait(10) == 0 and standby.poll() is None
    finally:
        client.close()
    assert "# TYPE nv_" in wait_until(lambda: leading("b"), 10, what="b's metrics as the leader")


def test_a_standby_s_status_says_it_stands_by_and_who_leads(
        planes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """A standby's status page showed the deployment's models and workers as the leader's does, with nothing
    to tell that it acts on none of them: whoever opened it could not tell which control plane acts."""
    ports = {name: (tmp_path / f"{name}.port").read_text() for name in ("a", "b")}
    wait_until(lambda: b"standing by" in (tmp_path / "b.log").read_bytes(), 30, what="the standby")
    led = re.search(r"control plane (\S+) leads \(", (tmp_path / "a.log").read_text())
    assert led is not None
    status = {name: httpx.get(f"http://127.0.0.1:{port}/status.json", timeout=10).json()
              for name, port in ports.items()}
    assert status["a"]["control"] == {"leads": True, "leader": led[1]}, status["a"]
    assert status["b"]["control"] == {"leads": False, "leader": led[1]}, status["b"]
    assert [m["name"] for m in status["b"]["models"]] == [m["name"] for m in status["a"]["models"]]
    page = httpx.get(f"http://127.0.0.1:{ports['b']}/status", timeout=10).text
    assert "this control plane stands by" in page and "control.leader" in page


async def test_a_restart_takes_only_its_exited_predecessor_s_lease(redis_url: str, key_prefix: str) -> None:
    """serve's restart of a control plane it reaped takes the dead one's lease at once; a lease that another
    control plane took meanwhile (a standby elsewhere on the same Redis) stays that one's."""
    key = Keys(key_prefix).control_leader
    redis_ = connect(redis_url)
    try:
        await redis_.set(key, "elsewhere", px=10_000)
        new = Lease(redis_, key, "new", 10_000)
        assert not await new.take_over("dead") and not new.held
        assert await redis_.get(key) == b"elsewhere"
        await redis_.set(key, "dead", px=10_000)
        assert await new.take_over("dead") and new.held
        assert await redis_.get(key) == b"new" and await redis_.pttl(key) > 9_000
    finally:
        await redis_.delete(key)
        await redis_.aclose()


async def test_a_worker_whose_heartbeat_went_with_the_lease_is_not_taken_for_dead(
        tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Redis lost its data between a tick's read of the lease and its read of the workers' heartbeats (a
    loaded machine, once): the tick took the worker for dead and placed its models on no worker before the
    next tick saw the lease gone and held placement; the worker unloaded them, and a wake waited out the
    whole hold (DESPINA_WORKER_TTL_S). A heartbeat gone with the lease is Redis's loss, not the worker's."""
    mlp_folder(tmp_path / "repo")
    settings = Settings(model_repository=str(tmp_path / "repo"), key_prefix=key_prefix, worker_ttl_s=60)
    client = connect(redis_url)
    plane, worker = ControlPlane(settings, client), Worker(settings, client)
    tick, lost = plane.lifecycle.tick, asyncio.Event()

    async def tick_as_redis_loses_its_data(members: set[bytes] | None = None) -> None:
        if members is not None and not lost.is_set():  # the lease and the workers' set read, then lost
            delete_prefix(redis_url, key_prefix)
            lost.set()
        await tick(members)

    roles = [asyncio.create_task(plane.run()), asyncio.create_task(worker.run())]
    try:
        while plane.catalog.get("mlp") is None:  # registered
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(plane.commands.wake("mlp", None, 60), 60) == 1
        monkeypatch.setattr(plane.lifecycle, "tick", tick_as_redis_loses_its_data)
        await asyncio.wait_for(lost.wait(), 30)
        assert await asyncio.wait_for(plane.commands.wake("mlp", None, 30), 30) == 1
    finally:
        worker.stop()
        plane.stop()
        await asyncio.gather(*roles, return_exceptions=True)
        await client.aclose(close_connection_pool=True)
    assert "stopped sending heartbeats" not in caplog.text


class DroppingProxy:
    """A TCP proxy to Redis that drops the connection of the first `drops` commands holding `word`: Redis
    gone for a moment at that command, then back. Either side's end (an EOF, a drop, a reset) ends the
    relay's two connections, and `close` ends the relays still open: a relay left to the event loop's end
    was cancelled with its connection to Redis open, and the collector reported its socket, transport and
    StreamWriter ("loop is closed") in whichever later test of the process it happened to run."""

    def __init__(self, redis_url: str, word: bytes, drops: int) -> None:
        self.target = urlparse(redis_url)
        self.word, self.drops = word, drops
        self.server: asyncio.Server | None = None
        self.relays: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """The proxy's URL: the Redis URL with a port of the system's choosing."""
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return self.target._replace(netloc=f"127.0.0.1:{port}").geturl()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for relay in self.relays:
            relay.cancel()
        await asyncio.gather(*self.relays, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relay = cast("asyncio.Task[None]", asyncio.current_task())
        self.relays.add(relay)
        up_writer: asyncio.StreamWriter | None = None

        def end() -> None:
            writer.close()
            if up_writer is not None:
                up_writer.close()

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, watch: bool) -> None:
            try:
                while chunk := await source.read(65536):
                    if watch and self.drops and self.word in chunk.upper():
                        self.drops -= 1
                        break
                    sink.write(chunk)
                    await sink.drain()
            finally:  # a client that reset its connection (closed it with a reply unread) raised here
                end()

        try:
            up_reader, up_writer = await asyncio.open_connection(self.target.hostname, self.target.port or 6379)
            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False),
                                 return_exceptions=True)
        finally:
            end()
            self.relays.discard(relay)


async def test_redis_lost_between_taking_the_lead_and_reading_the_catalog_is_retried(
        tmp_path: Path, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A connection error just after the lease was taken, as the catalog was read, ended the control plane
    with a traceback (under serve, at its first start, everything stopped: the role had not said it was up).
    It is retried as every other Redis outage is, and the plane starts with the catalog that was there."""
    keys = Keys(key_prefix)
    check = connect(redis_url)
    await check.hset(keys.catalog, "m", CatalogEntry("m", "/repo/m", {}, (1,)).dumps())
    proxy = DroppingProxy(redis_url, b"HGETALL", drops=2)  # (redis-py retries a dropped connection once)
    client = connect(await proxy.start())
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), client)
    seen: list[CatalogEntry | None] = []
    plane.on_start = lambda: seen.append(plane.catalog.get("m"))
    running = asyncio.create_task(plane.run())
    try:
        deadline = time.monotonic() + 15
        while not seen and not running.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not running.done() or running.exception() is None, running.exception()
        assert seen and seen[0] is not None and seen[0].name == "m" and plane.start_failure is None
        assert "control: reading the catalog failed: Redis unreachable" in caplog.text
    finally:
        plane.stop()
        await asyncio.gather(running, return_exceptions=True)
        await client.aclose()
        await check.aclose()
        await proxy.close()


async def test_a_malformed_catalog_entry_at_the_start_is_named_skipped_and_removed(
        tmp_path: Path, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """An entry of the catalog this control plane cannot read (written by hand, or by another version) ended
    its start with a traceback, for good: every restart met it again. It is named in one error line and
    skipped, the others adopted, and the next write of the catalog takes it out (the workers and gateways
    could not read it either); the repository brings the model back."""
    keys = Keys(key_prefix)
    check = connect(redis_url)
    await check.hset(keys.catalog, mapping={"m": CatalogEntry("m", "/repo/m", {}, (1,)).dumps(),
                                            "bad": b"{not json", "half": b'{"name": "half"}'})
    mlp_folder(tmp_path, "bad")
    plane = ControlPlane(Settings(model_repository=str(tmp_path), key_prefix=key_prefix), check)
    seen: list[dict[str, CatalogEntry]] = []
    plane.on_start = lambda: seen.append(dict(plane.catalog.entries))
    running = asyncio.create_task(plane.run())
    try:
        wait = time.monotonic() + 15
        while not (seen and await check.hget(keys.catalog, "half") is None and await check.hget(
                keys.catalog, "bad") not in (None, b"{not json")) and not running.done() \
                and time.monotonic() < wait:
            await asyncio.sleep(0.05)
        assert not running.done(), running.exception()
        assert seen and sorted(seen[0]) == ["m"] and plane.start_failure is None
        for name in ("bad", "half"):
            said = [r.getMessage() for r in caplog.records if f"'{name}'" in r.getMessage()]
            assert len(said) == 1 and said[0].startswith(f"catalog entry '{name}' ({keys.catalog}) cannot be "
                                                         "read"), said
        assert "Traceback" not in caplog.text
        assert await check.hget(keys.catalog, "half") is None
        bad = await check.hget(keys.catalog, "bad")  # read again from the repository
        assert bad is not None and CatalogEntry.loads(bad).state == "READY"
    finally:
        plane.stop()
        await asyncio.gather(running, return_exceptions=True)
        await check.aclose()


def test_a_worker_skips_a_catalog_entry_it_cannot_read_and_serves_on(
        serve: Callable[..., Server], tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """An entry written into the running catalog that cannot be read ended the worker's loop with a traceback
    (serve then stopped everything). The worker names it in one error line, skips it, and serves on."""
    mlp_folder(tmp_path / "repo")
    server = serve(tmp_path / "repo", wait_models=("mlp",))
    keys = Keys(key_prefix)
    with redis.Redis.from_url(redis_url) as client:
        client.hset(keys.catalog, "junk", b"{not json")
        client.incr(keys.catalog_generation)  # the catalog moved: the worker reads it again
        client.publish(keys.events, "catalog")
    wait_until(lambda: "catalog entry 'junk' cannot be read (JSONDecodeError" in server.logs(), 30,
               what="the worker's error line")
    wait_until(lambda: "gateway: catalog entry 'junk' cannot be read (JSONDecodeError" in server.logs(), 30,
               what="the gateway's error line")  # (its view follows the catalog on: it used to stop)
    time.sleep(1)
    assert infer(server.url).status_code == 200, server.logs()[-3000:]
    assert server.logs().count("gateway: catalog entry 'junk'") == 1
    assert "Traceback" not in server.logs() and server.process.poll() is None
