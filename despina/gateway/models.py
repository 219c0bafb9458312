"""The gateway's view of models: the catalog and which versions some live worker has READY.

Refreshed in the background (at once on an event, else twice a second), so that a request never pays
a Redis round trip to learn what it is calling: the catalog when its generation moved, each worker's
state when its digest did (worker_states.py), and the length of every request stream that serves, so
that requests are refused while one is at max_stream_length. A request for a
registered model that no worker has READY (scaled to zero, or coming up) asks the control plane to load
it and goes on once it is READY: concurrent requests share one such wake.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from .. import clock, logs
from ..contract.catalog import (
    UNLOADED,
    CatalogEntry,
    cold_start_failed,
    none_loaded,
    read_entries,
    unloaded,
    version_refused,
)
from ..contract.commands import WAKE
from ..contract.ensemble import Ensemble, is_ensemble
from ..contract.errors import (
    Code,
    ConfigError,
    DespinaError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from ..contract.keys import Keys
from ..contract.modelspec import ModelSpec
from ..redis_client import trouble
from .control import ControlClient, answer_room
from .worker_states import Ready, Served, WorkerStates

log = logging.getLogger("despina.gateway")

REFRESH_S = 0.5
# a refresh Redis has not answered within this (a Redis that hangs, a connection that died without a word)
# fails: the gateway reports not ready until Redis answers again
STALLED_S = 5.0
# a shared wake that ran out its time (its first caller's) while a caller that joined it has this much left
# or more: another wake waits out the rest
WAKE_AGAIN_S = 1.0


@dataclass(frozen=True)
class Model:
    entry: CatalogEntry
    spec: ModelSpec
    ensemble: Ensemble | None = None  # its steps, when the model is an ensemble


class NotLoaded(Unavailable):
    """The model is registered and usable, but no worker has the version READY: a wake will bring it."""


class ModelView:
    def __init__(self, redis: aioredis.Redis, keys: Keys, max_stream_length: int = 0) -> None:
        self.redis = redis
        self.keys = keys
        self.max_stream_length = max_stream_length
        self.full: set[str] = set()              # request streams at max_stream_length: refuse more
        self.control = ControlClient(redis, keys)
        self.models: dict[str, Model] = {}
        self.ready: Ready = {}                   # model -> versions READY on some live worker
        # resolve()'s answers while models and ready stay as they are: (name, version asked) -> them
        self._resolved: dict[tuple[str, str | None], tuple[Model, int]] = {}
        self._asked: set[tuple[str, int]] = set()  # the versions resolve() answered since the last refresh
        self.states = WorkerStates(keys)
        self._served: Served = {}
        self._revisions: dict[tuple[str, int], str | None] = {}  # revision()'s answers since the refresh
        self.connected = False
        self.published = False  # the control plane has read the repository: the catalog is whole
        self._blobs: dict[str, bytes] = {}
        self._generation: bytes | None = None  # the catalog's generation as last read
        self._task: asyncio.Task[None] | None = None
        # (model, version asked) -> the wake on its way, and when its time runs out (monotonic)
        self._waking: dict[tuple[str, int | None], tuple[asyncio.Future[int], float]] = {}
        self._reading: set[asyncio.Future[None]] = set()  # reads of the catalog after a failed cold start
        # one refresh at a time: the background one and one after a load command could otherwise end
        # in either order, the older view last (a model just loaded would look not ready)
        self._refreshing = asyncio.Lock()
        # settings announced on the events channel (data -> how to follow them), read again whenever the
        # subscription starts: what was set while this gateway was away
        self.followers: dict[bytes, Callable[[], Awaitable[None]]] = {
            logs.EVENT: lambda: logs.follow(self.redis, self.keys)}

    async def start(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:
            log.warning("gateway: at start, reading the model view failed: %s", trouble(exc))
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.control.close()

    async def _loop(self) -> None:
        failed = logs.Throttled(log)
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.keys.events)
                    for each in self.followers.values():
                        await _answered(each())
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=REFRESH_S)
                        follow = self.followers.get(message.get("data")) if message is not None else None
                        if follow is not None:
                            await _answered(follow())
                            continue
                        await _answered(self.refresh())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.connected = False
                failed.log("gateway: refreshing the model view failed: %s", trouble(exc))
                await asyncio.sleep(REFRESH_S)

    async def announce(self, key: str, change: Callable[[bytes | None], bytes], event: bytes) -> bytes:
        """Change a deployment-wide setting kept in Redis, `change` making the new value from the one there
        (None: none yet), and announce it on the events channel (followers); the value written. Should
        another gateway (or request) write it meanwhile, it is read and changed again: no change is lost."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    value = change(cast(bytes | None, await pipe.get(key)))
                    pipe.multi()
                    pipe.set(key, value)
                    pipe.publish(self.keys.events, event)
                    await pipe.execute()
                    return value
                except WatchError:
                    continue

    async def refresh(self) -> None:
        async with self._refreshing:
            await self._refresh()

    async def _refresh(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.catalog_generation)
        pipe.smembers(self.keys.workers)
        pipe.exists(self.keys.control_leader)
        pipe.exists(self.keys.catalog_published)
        generation, members, led, published = await pipe.execute()
        # the catalog only when it moved: 400 models are 0.5 MB, read twice a second by every gateway. No
        # generation (Redis lost its data, or a control plane of an earlier version writes): every time.
        moved = generation is None or generation != self._generation
        streams = self._asked_streams() if self.max_stream_length else []
        pipe = self.redis.pipeline(transaction=False)
        if moved:
            pipe.hgetall(self.keys.catalog)
        workers = sorted(members)
        self.states.ask(pipe, workers)
        if self.max_stream_length:
            for stream in streams:
                pipe.xlen(stream)
        replies = await pipe.execute() if moved or workers or (streams and self.max_stream_length) else []
        catalog = replies.pop(0) if moved else None
        if moved and not catalog and not led and self.models:
            # Redis lost its data (a restart without persistence): keep routing as before, report not
            # ready, until the control plane publishes the catalog again
            self.connected = False
            return
        self.full = {s for s, n in zip(streams, replies[len(workers):]) if n >= self.max_stream_length}
        models, blobs = (self.models, self._blobs) if catalog is None else self._read(catalog)
        await self.states.update(self.redis, workers, replies[:len(workers)])
        self.models, self.ready, self._served = models, self.states.ready, self.states.served
        self.connected, self.published, self._revisions = True, bool(published), {}
        self._resolved = {}
        self._blobs, self._generation = blobs, generation

    def _asked_streams(self) -> list[str]:
        """The streams requests went to since the last refresh, whose lengths it reads: not every stream's
        (4,000 XLENs a second for 2,000 idle models). The first request after a quiet spell is checked by
        the next refresh, as one is while a stream fills."""
        asked, self._asked = self._asked, set()
        models = [(m, v) for name, v in sorted(asked) if (m := self.models.get(name)) is not None]
        return [s for m, v in models if m.spec is not None for s in m.entry.streams(self.keys, v)]

    def _read(self, catalog: dict[bytes, bytes]) -> tuple[dict[str, Model], dict[str, bytes]]:
        """The catalog's models, and each one's JSON: an entry whose JSON is as before is the Model made from
        it then."""
        models: dict[str, Model] = {}
        blobs: dict[str, bytes] = {}  # (a model gone from the catalog goes from them too)
        for name_raw, blob in catalog.items():
            name = name_raw.decode()
            old = self.models.get(name)
            blobs[name] = blob
            if old is not None and self._blobs.get(name) == blob:
                models[name] = old
                continue
            read, bad = read_entries({name_raw: blob})
            if name in bad:  # written by hand, or by another version: skipped, as workers do (logged once)
                if self._blobs.get(name) != blob:
                    log.error("gateway: catalog entry '%s' cannot be read (%s); skipped", name, bad[name])
                continue
            entry = read[name]
            spec = ModelSpec.from_config(entry.config) if entry.state == "READY" else None
            ensemble = None
            if spec is not None and is_ensemble(entry.config):
                try:
                    ensemble = Ensemble.from_config(entry.config)
                except ConfigError as exc:  # a control plane of another version accepted it: not here
                    entry, spec = replace(entry, state="UNAVAILABLE", reason=exc.message), None
            models[name] = Model(entry, spec, ensemble)  # type: ignore[arg-type]
        return models, blobs

    def get(self, name: str) -> Model:
        model = self.models.get(name)
        if model is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        return model

    def resolve(self, name: str, version: str | None) -> tuple[Model, int]:
        """The model and the version to run: the one named, else the highest READY one (a version still
        serving while a newer one loads counts only when no newer one is READY).

        Raises NotLoaded when no worker has it READY but a wake would bring it.
        """
        resolved = self._resolved.get((name, version))
        if resolved is not None:
            return resolved
        model = self.get(name)
        e = model.entry
        if e.state != "READY":
            raise Unavailable(f"model '{name}' is unavailable: {e.reason}")
        if e.target == UNLOADED:
            raise unloaded(e, version)
        if e.cold_error and (cold := cold_start_failed(e, clock.now())) is not None:
            raise cold  # at once, until a request may try its cold start again
        if model.ensemble is not None:  # it runs here, on the models it calls: each is resolved in turn
            v = self._ensemble_version(model, version)
            self._asked.add((name, v))  # (or on a worker that runs it whole, through its stream)
            return model, v
        ready = self.ready.get(name, ())
        if version:
            v = _known_version(e, version)
            if v in ready:
                return self._remember(name, version, model, v)
            if v in e.failed:
                raise Unavailable(f"model '{name}' version {v} failed to load: {e.failed[v]}")
            raise NotLoaded(f"model '{name}' version {v} is not ready")
        current = [v for v in e.versions if v not in e.retiring]
        for group in (current, e.retiring):
            serving = [v for v in group if v in ready]
            if serving:
                return self._remember(name, version, model, max(serving))
        if (failed := none_loaded(e, current)) is not None:
            raise failed
        raise NotLoaded(f"model '{name}' is not ready")

    def _remember(self, name: str, version: str | None, model: Model, v: int) -> tuple[Model, int]:
        self._asked.add((name, v))
        if len(self._resolved) < 4096:  # bounded: a client may spell a version many ways ("1", "01")
            self._resolved[(name, version)] = (model, v)
        return model, v

    def _ensemble_version(self, model: Model, version: str | None) -> int:
        e = model.entry
        if not version and (failed := none_loaded(e)) is not None:
            raise failed
        v = _known_version(e, version) if version else max(e.versions)
        if v in e.failed:
            raise Unavailable(f"ensemble '{e.name}' cannot serve: {e.failed[v]}")
        return v

    async def serving(self, name: str, version: str | None, timeout: float) -> tuple[Model, int]:
        """resolve(), or when the model is not loaded, load it and wait (at most `timeout`) until READY."""
        try:
            return self.resolve(name, version)
        except NotLoaded:
            pass
        v = await self._wake(name, int(version) if version else None, timeout)
        self.ready = {**self.ready, name: {*self.ready.get(name, ()), v}}  # (the refresh's own stays as read)
        self._resolved = {}
        return self.get(name), v

    async def _wake(self, name: str, version: int | None, timeout: float) -> int:
        """Ask the control plane to load the model, and wait at most `timeout` until it is READY (over as a
        control plane call of `timeout` is: control.answer_room). A wake on its way is joined; it lasts its
        first caller's timeout, and where it runs out while this caller has WAKE_AGAIN_S or more left,
        another waits out the rest (a request that came during another's cold start was refused when the
        first one's time ran out, with most of its own left); a caller with less time than the wake stops
        waiting when its own runs out."""
        key = (name, version)
        deadline = time.monotonic() + timeout
        over = deadline - answer_room(timeout)
        while True:
            waking = self._waking.get(key)
            if waking is None or waking[0].done():
                params = {"version": version} if version is not None else {}
                left = deadline - time.monotonic()
                started = asyncio.ensure_future(self.control.call(WAKE, name, params, left))
                waking = self._waking[key] = (started, deadline)
                started.add_done_callback(lambda done: self._woken(key, done))
            call, ends = waking
            try:
                if ends <= deadline:  # it is over in this caller's time
                    return await asyncio.shield(call)
                return await asyncio.wait_for(asyncio.shield(call), max(over - time.monotonic(), 0.0))
            except TimeoutError:
                raise Unavailable(f"model '{name}' did not load within {timeout:g} s") from None
            except DespinaError as exc:
                now = time.monotonic()
                if exc.code != Code.UNAVAILABLE or now < ends - WAKE_AGAIN_S or deadline - now < WAKE_AGAIN_S:
                    raise  # it failed before its time ran out, or this caller's time is (nearly) out too

    def _woken(self, key: tuple[str, int | None], call: asyncio.Future[int]) -> None:
        if self._waking.get(key, (None, 0.0))[0] is call:
            del self._waking[key]
        if call.cancelled():
            return
        exc = call.exception()  # retrieved here too: every request that waited may have gone
        if isinstance(exc, DespinaError) and exc.retry_after:
            # its cold start failed: the catalog says so now. One read of it for all who waited, at once,
            # so that the next request hears of it here, not from the control plane
            reading = asyncio.ensure_future(_answered(self.refresh()))
            self._reading.add(reading)
            reading.add_done_callback(self._read_after)

    def _read_after(self, reading: asyncio.Future[None]) -> None:
        self._reading.discard(reading)
        if not reading.cancelled() and reading.exception() is not None:  # (the view's loop reads again)
            log.debug("gateway: reading the model view after a failed cold start: %s", reading.exception())

    def revision(self, name: str, version: int, depth: int = 0) -> str | None:
        """What a cached answer of a model version is keyed by (response_cache.py): the revision of its
        files and config, while every worker that has it serves that one and loads no other. During a
        rollout, None: an answer then may come from the files going or the files coming, and none is
        kept. An ensemble's is its own with its steps' (the versions they resolve to now)."""
        key = (name, version)
        if key in self._revisions:
            return self._revisions[key]
        found = self._revision(name, version, depth)
        if depth == 0:
            self._revisions[key] = found
        return found

    def _revision(self, name: str, version: int, depth: int) -> str | None:
        model = self.models.get(name)
        rev = model.entry.revisions.get(version) if model is not None else None
        if model is None or not rev:
            return None
        if model.ensemble is None:
            return rev if self._served.get((name, version), {rev}) == {rev} else None
        parts = [rev]
        for step in model.ensemble.steps:
            try:
                _, v = self.resolve(step.model, None if step.version is None else str(step.version))
            except DespinaError:
                return None
            part = self.revision(step.model, v, depth + 1) if depth < 8 else None
            if part is None:
                return None
            parts.append(f"{step.model}/{v}/{part}")
        return " ".join(parts)

    def is_ready(self, name: str, version: str | None, depth: int = 0) -> bool:
        """Whether a request would be served now, without loading anything: an ensemble when every
        model it calls is."""
        try:
            model, _ = self.resolve(name, version)
        except (NotFound, Unavailable, InvalidArgument, FailedPrecondition):
            return False
        if model.ensemble is None:
            return True
        return depth < 8 and all(
            self.is_ready(s.model, None if s.version is None else str(s.version), depth + 1)
            for s in model.ensemble.steps)


async def _answered(reading: Awaitable[None]) -> None:
    """A read of Redis, which fails when Redis has not answered within STALLED_S: the connection has no
    timeout of its own, and a Redis that hangs left the gateway ready, its last view kept, for good.
    (asyncio.timeout, not wait_for: Python 3.11's wait_for returns the read's result when the task is
    cancelled as the read ends, and the view's loop then never stopped: a gateway hung in its shutdown.)"""
    try:
        async with asyncio.timeout(STALLED_S):
            await reading
    except TimeoutError:
        raise TimeoutError(f"Redis did not answer within {STALLED_S:g} s") from None


def _known_version(e: CatalogEntry, version: str) -> int:
    """A version named in a URL: a number, and one of the model's."""
    if not version.isdigit():  # (check_target answers such a path before it gets here)
        raise NotFound(f"no such model version '{version}': a version is a number")
    v = int(version)
    if v not in e.versions:
        raise version_refused(e, v)
    return v
