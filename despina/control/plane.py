"""The control plane process: owns the catalog, serves repository commands, polls the registry.

One control plane leads at a time (a lease in Redis); others wait as standbys. It reads commands from
its stream, registers models from the registry as the model control mode says (registration.py:
none: all at start; explicit: `--load-model` and the API; poll: all, then every
`--repository-poll-secs`), and ticks the lifecycle: placement, version switches, scale-to-zero, dead
workers.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from .. import clock, logs
from ..contract.commands import Command
from ..contract.errors import ConfigError, DespinaError
from ..contract.keys import CONTROL_GROUP, FIELD, Keys
from ..redis_client import trouble
from ..registry import ArtifactCache, open_registry
from ..settings import Settings
from .commands import Commands
from .lease import Lease, LeaseLost, LeaseVanished
from .lifecycle import Lifecycle
from .registration import Registration
from .replies import Replies
from .state import GENERATION_TTL_MS, Catalog, Workers

log = logging.getLogger("despina.control")

MODES = ("none", "explicit", "poll")
LEASE_MS = 10_000
# how long the command and event reads wait on Redis before they look again; a stop cancels them
IDLE_WAIT_S = 30.0
# commands read by a control plane that has not answered them this long are taken over by the leader (one
# that stalled past its lease, or lost its lease while running them, never will); its own running ones are not
CLAIM_IDLE_MS = 1_000


class NamedLocks:
    """A lock per model name, kept only while someone holds it or waits for it: the names come from
    clients too (a load of a model that does not exist), and a lock left behind per name would pile up."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # name -> its lock, and who holds or waits

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, name: str, timeout: float | None = None, late: Exception | None = None
                   ) -> AsyncIterator[None]:
        """Hold the name's lock for the block; `late` (or TimeoutError) when it is not had in `timeout`."""
        lock, users = self._locks.get(name) or (asyncio.Lock(), 0)
        self._locks[name] = (lock, users + 1)
        try:
            try:
                await asyncio.wait_for(lock.acquire(), timeout)
            except TimeoutError:
                if late is None:
                    raise
                raise late from None
            try:
                yield
            finally:
                lock.release()
        finally:
            lock, users = self._locks[name]
            if users > 1:
                self._locks[name] = (lock, users - 1)
            else:
                del self._locks[name]


class ControlPlane:
    def __init__(self, settings: Settings, redis: aioredis.Redis, id: str | None = None,
                 predecessor: str | None = None) -> None:
        """`id`: this one's (else made up); `predecessor`: the id of a control plane known to have exited,
        whose lease this one may take at once rather than wait out (serve's restart: roles.run_control)."""
        if settings.model_control_mode not in MODES:
            raise ConfigError(f"model control mode '{settings.model_control_mode}' is not one of "
                              f"{', '.join(MODES)}")
        self.settings, self.redis = settings, redis
        self.keys = Keys(settings.key_prefix)
        self.id = id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._predecessor = predecessor
        # this process's own start (not serve's restart of one that exited), while it leads at once: what
        # --load-model names must load then (registration.py), else the start fails with `start_failure`
        self.starting = predecessor is None
        self.start_failure: str | None = None
        # called once it leads (its catalog read) or stands by: serve then hears it is up (started.py)
        self.on_start: Callable[[], None] = lambda: None
        remote = settings.model_repository.startswith("s3://")
        self.cache = ArtifactCache.from_settings(settings) if remote else None
        self.registry = open_registry(settings.model_repository, settings, self.cache)
        self.lease = Lease(redis, self.keys.control_leader, self.id, LEASE_MS)
        self.skew = clock.Skew(settings.clock_skew_warn_s, f"control plane {self.id}")
        self.catalog = Catalog(redis, self.keys, self.id)  # its writes fenced by the lease
        self.workers = Workers(redis, self.keys)
        self.lifecycle = Lifecycle(settings, redis, self.keys, self.catalog, self.workers, self.lease)
        self.commands = Commands(self)
        self.replies = Replies(redis, self.keys)
        self.registration = Registration(self)  # the registry's models into the catalog
        self.locks = NamedLocks()  # model name -> its lock: a load, an unload and a sync take turns
        self._kick = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: set[bytes] = set()  # the command entries this one is running
        self._leading = False

    def kick(self) -> None:
        """Tick now: something changed."""
        self._kick.set()

    def stop(self) -> None:
        self._stop.set()

    def fail_start(self, why: str) -> None:
        """The start failed (Triton's --exit-on-error): stop; the process exits saying `why`."""
        log.error("%s", why)
        self.start_failure = why
        self.stop()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` beside the plane's loops, cancelled when it stops."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def leading(self) -> bool:
        """Whether this one leads: it took the lease, and has not stopped or lost it."""
        return self._leading and not self._stop.is_set()

    async def run(self) -> None:
        if not await self._lead():
            return
        self._leading = True
        if not await self._load_catalog():
            await self._resign()
            return
        self.lifecycle.idle.adopt()  # the cold starts its predecessor began
        self.on_start()
        loops = [self._ticks(), self._serve_commands(), self._listen(), self._keep_lease(),
                 self.registration.run(), self.skew.keep(self.redis, LEASE_MS / 4000)]
        tasks = [asyncio.create_task(loop) for loop in loops]
        try:
            await self._stop.wait()
        finally:
            for task in (*tasks, *self._tasks):
                task.cancel()
            await asyncio.gather(*tasks, *self._tasks, return_exceptions=True)
            await self.replies.close()
            await self._resign()

    async def _load_catalog(self) -> bool:
        """Read the catalog the lease lets this one own; False when the start failed or the plane stopped.
        Redis out for a moment just after the lease was taken is retried, as taking the lease is: the error
        used to end the process with a traceback, and serve stops everything for a role that was not yet up.
        A lease that lapsed meanwhile is found by the first renewal (lost, or vanished: republished)."""
        while not self._stop.is_set():
            try:
                await self.catalog.load()
                return True
            except ResponseError as exc:
                # Redis refused (another program's key where the catalog belongs): a restart would meet it
                # again, so the start fails in one line (roles.run_control), not with a traceback
                self.start_failure = f"cannot start: {trouble(exc)}"
                self.stop()
            except (RedisError, ConnectionError, OSError) as exc:
                log.warning("control: reading the catalog failed: %s; retrying", trouble(exc))
                await self.sleep(2.0)
        return False

    async def _resign(self) -> None:
        """Give the lease up, if still ours: a standby takes over at once rather than wait it out."""
        try:
            leader = cast(bytes | None, await self.redis.get(self.keys.control_leader))
            if (leader or b"").decode() == self.id:
                await self.redis.delete(self.keys.control_leader)
        except (RedisError, ConnectionError, OSError):
            pass

    # -- leadership --------------------------------------------------------------------------------

    async def _lead(self) -> bool:
        waiting = False
        while not self._stop.is_set():
            try:
                await self.skew.measure(self.redis, clock.SAMPLES)  # before a command's deadline is read
                if await self._take():
                    log.info("control plane %s leads (%s mode, repository %s)", self.id,
                             self.settings.model_control_mode, self.registry.url)
                    return True
                if not waiting:  # (not while Redis cannot tell: there may be no other)
                    log.info("control plane %s: another one leads; standing by", self.id)
                    waiting, self.starting = True, False  # a standby that takes over later is no start
                    self.on_start()
            except (RedisError, ConnectionError, OSError) as exc:
                log.warning("control: %s", trouble(exc))
            await self.sleep(2.0)
        return False

    async def _take(self) -> bool:
        """Take the lease; at the first look, the exited predecessor's too (else its restart would wait up to
        LEASE_MS, and a cold start meanwhile with it)."""
        dead, self._predecessor = self._predecessor, None
        if dead is None:
            return await self.lease.take()
        try:
            taken = await self.lease.take_over(dead)
        except BaseException:
            self._predecessor = dead  # (Redis did not answer: try again at the next look)
            raise
        if taken:
            log.info("control plane %s takes over from %s, which exited", self.id, dead)
        return taken

    async def _keep_lease(self) -> None:
        failed = logs.Throttled(log)
        while not self._stop.is_set():
            await self.sleep(LEASE_MS / 4000)
            try:
                held = await self.lease.renew()
                if held == 1:
                    await self.redis.pexpire(self.keys.catalog_generation, GENERATION_TTL_MS)
            except (RedisError, ConnectionError, OSError) as exc:
                failed.log("control: renewing the lease failed (%s)", exc)
                continue
            if held == -1:
                self.kick()
            elif not held:
                self.lost()
            else:
                try:
                    await self._claim_commands()
                except (RedisError, ConnectionError, OSError) as exc:  # (the command loop says why)
                    log.debug("control: claiming unanswered commands failed (%s)", exc)

    def lost(self) -> None:
        """Another control plane leads (this one stalled past its lease): act no more, stop."""
        if not self._stop.is_set():
            log.error("control plane %s lost its lease to another; stopping", self.id)
        self.lease.lapse()
        self.stop()

    async def _recover(self) -> None:
        """The lease is gone: Redis most likely restarted without its data. Publish the catalog again
        (workers and gateways keep what they have meanwhile), let workers announce themselves before
        anything is placed, then take the lease again unless another control plane did."""
        log.warning("control: the leader lease vanished (Redis restarted without its data?); publishing "
                    "the catalog again; requests that were queued in Redis are lost")
        self.catalog.republish()
        self.lifecycle.hold(self.settings.worker_ttl_s)
        await self.catalog.flush()
        if not await self.lease.take():
            self.lost()

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds`, or less when the plane stops."""
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    # -- the lifecycle loop ------------------------------------------------------------------------

    async def _ticks(self) -> None:
        failed = logs.Throttled(log)
        while not self._stop.is_set():
            try:  # the lease's holder and the workers' set in one round trip: an idle plane ticks a second
                pipe = self.redis.pipeline(transaction=False)
                pipe.get(self.keys.control_leader)
                pipe.smembers(self.keys.workers)
                holder, members = await pipe.execute()
                if holder is not None and holder.decode() != self.id:
                    raise LeaseLost(holder.decode())  # (woken from a stall: whatever it thinks is stale)
                if holder is None:
                    await self._recover()
                await self.lifecycle.tick(members if holder else None)  # the set may be new too
            except LeaseVanished:  # Redis lost its data after the lease was read: as if seen here
                self.kick()
            except LeaseLost:
                self.lost()
            except (RedisError, ConnectionError, OSError) as exc:
                failed.log("control: %s", trouble(exc))
            except Exception:  # a bug must not stop the control plane's heart
                log.exception("control: a lifecycle tick failed")
            try:
                await asyncio.wait_for(self._kick.wait(), 0.05 if self.lifecycle.busy else 1.0)
            except TimeoutError:
                pass
            self._kick.clear()

    async def _listen(self) -> None:
        """Workers announce state changes on the events channel: tick at once."""
        failed = logs.Throttled(log)
        while not self._stop.is_set():
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.keys.events)
                    await logs.follow(self.redis, self.keys)  # what was set while this one was away
                    while not self._stop.is_set():
                        message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                           timeout=IDLE_WAIT_S)
                        if message is not None and message.get("data") == logs.EVENT:
                            await logs.follow(self.redis, self.keys)
                        elif message is not None and message.get("data") != b"catalog":
                            self.kick()
            except (RedisError, ConnectionError, OSError) as exc:
                failed.log("control: event subscription lost (%s); retrying", exc)
                await self.sleep(1.0)

    # -- commands ----------------------------------------------------------------------------------

    async def _serve_commands(self) -> None:
        stream = self.keys.control_commands
        failed = logs.Throttled(log)
        while not self._stop.is_set():
            try:
                try:
                    await self.redis.xgroup_create(stream, CONTROL_GROUP, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                await self._claim_commands(0)  # what a previous leader read and never answered
                while not self._stop.is_set():
                    resp = await self.redis.xreadgroup(CONTROL_GROUP, self.id, {stream: ">"}, count=32,
                                                       block=int(IDLE_WAIT_S * 1000))
                    for _, entries in cast(list[list[Any]], resp) or ():  # RESP2: [[stream, entries]]
                        self._dispatch(entries)
            except (RedisError, ConnectionError, OSError) as exc:
                failed.log("control: reading commands failed (%s); retrying", exc)
                await self.sleep(0.5)

    async def _claim_commands(self, idle_ms: int = CLAIM_IDLE_MS) -> None:
        """Run the commands another control plane read and has not answered: a leader that stalled past its
        lease still had its read of the stream waiting, and Redis handed it the commands sent meanwhile."""
        cursor: bytes | str = "0-0"
        while True:
            claimed = await self.redis.xautoclaim(self.keys.control_commands, CONTROL_GROUP, self.id, idle_ms,
                                                  cursor, count=100)
            self._dispatch(claimed[1])
            cursor = claimed[0]
            if cursor in (b"0-0", "0-0"):
                return

    def _dispatch(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for entry_id, fields in entries:
            if fields and entry_id not in self._running:  # (a claim finds this one's own running ones too)
                self._running.add(entry_id)
                self.spawn(self._run_command(entry_id, fields.get(FIELD, b"")))

    async def _run_command(self, entry_id: bytes, payload: bytes) -> None:
        try:
            await self._run(entry_id, payload)
        finally:
            self._running.discard(entry_id)

    async def _run(self, entry_id: bytes, payload: bytes) -> None:
        try:
            command = Command.loads(payload)
        except DespinaError as exc:
            log.error("control: dropping a command: %s", exc.message)
            command = None
        try:
            if not await self.lease.confirm():  # left unanswered, unacknowledged: the leader claims it
                self.lost()
                return
            answer = None
            if command is not None and (not command.deadline or command.deadline > clock.now()):
                answer = await self.commands.handle(command)
            await self.replies.send(entry_id, command, answer)
        except LeaseLost:
            self.lost()
        except (RedisError, ConnectionError, OSError) as exc:
            log.warning("control: answering a command failed (%s)", exc)
