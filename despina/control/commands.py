"""The repository API on the control plane's side: index, load, unload, and wake (a cold start)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import RedisError

from .. import clock
from ..contract.catalog import LOADED, UNLOADED, CatalogEntry, retire, version_refused
from ..contract.commands import INDEX, LOAD, UNLOAD, WAKE, Answer, Command
from ..contract.ensemble import called_by, is_ensemble
from ..contract.errors import DespinaError, FailedPrecondition, InvalidArgument, Unavailable
from ..contract.modelconfig import check_model_name
from ..registry import ArtifactCache
from ..registry.given import given_digest
from .backlog import refuse_model
from .dependents import back_with, ensembles_calling, steps_loaded_for, unloaded_with
from .fresh_stats import made_anew, start_stats_afresh
from .index import RepositoryIndex
from .lease import LeaseLost
from .load_files import config_override, forget, given_files, keep
from .repository import read_model, unavailable
from .versions import dropped_since, retired_since, transition, try_again

if TYPE_CHECKING:
    from ..registry.base import ModelFiles, Registry
    from ..registry.given import GivenFiles
    from .plane import ControlPlane

log = logging.getLogger("despina.control")

# the load API's parameters beside its `file:<path>` entries: Triton's config, and Despina's own
LOAD_PARAMETERS = ("config", "fail_without_room")
# how long a load waits, in all, for the registry's reads of the model (its files' listing, its config),
# at most: the same store held a load for boto3's read timeout three times (~3 min, past most clients'
# timeouts) before its 503
LOAD_LOOK_S = 10.0

T = TypeVar("T")


class Commands:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._index = RepositoryIndex(plane)
        self._stuck: dict[str, asyncio.Future[Any]] = {}  # model -> a registry read that outlived its load
        self._cache = plane.cache

    async def handle(self, command: Command) -> Answer:
        timeout = self.plane.settings.load_timeout_s
        if command.deadline:
            timeout = max(0.1, min(timeout, command.deadline - clock.now()))
        try:
            if command.op == INDEX:
                return Answer(await self.index(command.params.get("ready")))
            if command.op == LOAD:
                self._check_mode()
                await self.load(command.model, command.params, timeout)
            elif command.op == UNLOAD:
                self._check_mode()
                await self.unload(command.model, bool(command.params.get("unload_dependents")), timeout)
            elif command.op == WAKE:
                return Answer(await self.wake(command.model, command.params.get("version"), timeout))
            return Answer()
        except DespinaError as exc:
            return Answer.error(exc)
        except LeaseLost:  # the leader that took over answers it
            raise
        except Exception as exc:  # a bug must answer the caller, not leave it waiting
            log.exception("control command %s %s failed", command.op, command.model)
            return Answer.error(DespinaError(f"control plane: {command.op} failed: {exc}"))

    def _check_mode(self) -> None:
        mode = self.plane.settings.model_control_mode
        if mode != "explicit":
            raise FailedPrecondition(
                "explicit model load / unload is not allowed if polling is enabled (the model control "
                f"mode is '{mode}'; start with --model-control-mode explicit)")

    async def index(self, ready: Any) -> list[dict[str, str]]:
        return await self._index.rows(ready)

    # -- load / unload -----------------------------------------------------------------------------

    async def load(self, name: str, params: dict[str, Any], timeout: float, wait: bool = True,
                   calling: tuple[str, ...] = ()) -> None:
        """Read the model from the registry (with the `config` override), or from the `file:` entries alone
        (kept in Redis, never written into the registry), and load it; a loaded model is reloaded, its old
        versions serving until the new are READY. An ensemble loads the models it calls first (those not
        loaded yet), as Triton does."""
        plane = self.plane
        check_model_name(name)
        for key in params:  # as Triton's: a misspelt "config" must not load the repository's own config
            if key not in LOAD_PARAMETERS and not key.startswith("file:"):
                raise InvalidArgument(f"unrecognized load parameter '{key}'")
        no_room_fails = params.get("fail_without_room", False)
        if not isinstance(no_room_fails, bool):
            raise InvalidArgument("'fail_without_room' must be true or false")
        override = config_override(name, params.get("config"))
        limited = plane.settings.rate_limit != "off"  # the workers heed rate_limiter: no warning
        files = {k[5:]: v for k, v in params.items() if k.startswith("file:")}
        if files and override is None:
            raise InvalidArgument("load parameters with 'file:' entries need 'config' too")
        deadline = time.monotonic() + timeout
        async with self._turn(name, deadline):
            look_s = min(LOAD_LOOK_S, _left(deadline))
            looked = time.monotonic() + look_s
            old = plane.catalog.get(name)
            given: GivenFiles | None = None
            registry: Registry = plane.registry
            if files:  # as Triton's (a temporary folder): these files alone are the model
                registry = given = await asyncio.to_thread(given_files, name, files, self._given_cache())
                model = given.files
                await self._keep(given, deadline)
            else:
                model = await self._read(name, lambda: plane.registry.model(name), looked, look_s)
            if not files and override is None and old is not None and old.override is not None \
                    and old.target != UNLOADED:
                # Triton's: a model loaded with a `config` is unchanged for a load without one until its files
                # change (their times pass the override's), so that load keeps it; an unload forgets it
                override = old.override if model.unchanged_since(old.override_files) else None
            try:
                entry = await self._read(name, lambda: read_model(registry, model, override, limited),
                                         looked, look_s)
            except DespinaError as exc:
                log.error("load of %s failed: %s", name, exc.message)
                await self._take_back(model, old, given, exc.message)
                raise
            if override is not None and given is None:  # (a later load without files reads the registry)
                entry = replace(entry, override=override, override_files=model.fingerprint())
            if entry.state == "READY" and is_ensemble(entry.config):
                await self._load_steps(entry, timeout, (*calling, name))
                # a step unloaded meanwhile (its unload takes no turn of this ensemble's): that unload came
                # first, as Triton's one at a time would have it, and this load loads the step again
                for _ in range(3):
                    if not any((s := plane.catalog.get(m)) is not None and s.target == UNLOADED
                               for m in called_by(entry.config) if m not in calling):
                        break
                    await self._load_steps(entry, timeout, (*calling, name))
            plane.lifecycle.forget(name)
            # a load is no cold start, even of one on its way: its failure is the load's 400, not a backoff
            plane.lifecycle.idle.cold.pop(name, None)
            if old is None or old.target != LOADED:
                plane.lifecycle.idle.awake_since[name] = clock.now()
            # Triton's unload_dependents unloads the steps an ensemble loaded, not those asked for by name
            # (an ensemble unloaded with a model it calls was loaded as what it was before)
            step_only = bool(calling) and (old is None or old.target == UNLOADED and not old.with_steps
                                           or old.step_only)
            entry = try_again(transition(old, entry, LOADED, lambda v: bool(plane.workers.ready_on(name, v))))
            # a load is no cold start: a cold start's mark and failures go (transition carries them for a
            # registry read again)
            plane.catalog.put(replace(entry, step_only=step_only, cold_since=0.0, cold_error="",
                                      cold_failures=0, cold_retry_at=0.0))
            log.info("model %s: loading version %s", name, ",".join(map(str, entry.versions)))
            await self._bring_back()
            plane.kick()
            anew = old is None or not old.loaded  # else what serves keeps its statistics until the load ends
            if anew or not wait:
                await start_stats_afresh(plane.redis, plane.keys, name, made_anew(entry, old))
            if not wait:  # (no take-back follows: what loaded before is gone now)
                await self._files_follow(name)
                return
            try:
                await plane.lifecycle.wait(name, "load", None, _left(deadline), no_room_fails)
            except InvalidArgument as exc:  # it failed on the workers
                tried = plane.catalog.get(name)
                if not _served(old, lambda v: bool(plane.workers.ready_on(name, v))):
                    old = None  # nothing of it served: what failed now, and why, is what the index shows
                if given is not None or _reload_failed(old, tried):
                    await self._take_back(model, old, given, exc.message, tried)
                elif tried is not None and tried.override is not None:  # a config that failed to load is not
                    plane.catalog.put(replace(tried, override=None))   # kept: the next load reads the files
                await self._files_follow(name)
                raise
            except DespinaError:  # not loaded in time: it goes on loading, from what the catalog names
                await self._files_follow(name)
                if (now := plane.catalog.get(name)) is not None and now.target == UNLOADED and now.with_steps:
                    return  # unloaded with a model it calls as it loaded: as Triton's, the load, then that
                raise
            if not anew and (done := plane.catalog.get(name)) is not None:
                await start_stats_afresh(plane.redis, plane.keys, name, made_anew(done, old))
            await forget(plane.redis, plane.keys, name, entry.path)  # what loaded before is gone now

    async def _files_follow(self, name: str) -> None:
        """The files loads gave the model are removed but those its catalog entry loads from (all of them
        where it loads none): called where the entry is final, holding the model's turn."""
        e = self.plane.catalog.get(name)
        keeping = e.path if e is not None and e.loaded else None
        try:  # best effort: a Redis error here must not stand in for the load's own answer
            await forget(self.plane.redis, self.plane.keys, name, keeping)
        except (RedisError, OSError) as exc:  # left for the model's next load or unload to remove
            log.warning("model %s: removing the files a load gave, which it no longer loads from, failed: %s",
                        name, exc)

    def _given_cache(self) -> ArtifactCache:
        """Where the control plane reads a load's given files from (a local registry's plane has no cache)."""
        if self._cache is None:
            self._cache = ArtifactCache.from_settings(self.plane.settings)
        return self._cache

    async def _keep(self, given: GivenFiles, deadline: float) -> None:
        try:
            await asyncio.wait_for(keep(self.plane.redis, self.plane.keys, given), _left(deadline))
        except TimeoutError:  # (whatever landed is removed by the model's next load or unload)
            raise Unavailable(f"Redis did not take the files the load of model '{given.name}' gave in "
                              "time") from None

    async def _read(self, name: str, read: Callable[[], T], until: float, look_s: float,
                    doing: str = "the load of", late: Callable[[T], None] | None = None) -> T:
        """`read`, a registry read (or write: `doing`) for model `name`'s load, in a thread, waited on until
        `until` (monotonic): past it, Unavailable, and `late` gets its result if it ends well after all. One
        that outlived its load is not started again until it ends: a store that hangs holds a thread per
        model, not one per call (the threads are few)."""
        url = self.plane.registry.url
        stuck = self._stuck.get(name)
        if stuck is not None and not stuck.done():
            raise Unavailable(f"registry {url} has not yet answered an earlier read of model '{name}'; "
                              "try again later")
        future = asyncio.ensure_future(asyncio.to_thread(read))
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, until - time.monotonic()))
        except TimeoutError:
            self._stuck[name] = future

            def ended(f: asyncio.Future[T]) -> None:
                if self._stuck.get(name) is f:
                    del self._stuck[name]
                # retrieved: no "exception never retrieved" for a late failure
                if not f.cancelled() and f.exception() is None and late is not None:
                    late(f.result())
            future.add_done_callback(ended)
            raise Unavailable(f"registry {url} did not answer {doing} model '{name}' within "
                              f"{look_s:.3g} s") from None

    @asynccontextmanager
    async def _turn(self, name: str, deadline: float) -> AsyncIterator[None]:
        """The model's lock, held by a load or an unload until it answers: they take turns, as Triton's
        do (a load and an unload sent together both succeed, in order)."""
        late = Unavailable(f"model '{name}' is still being loaded or unloaded by an earlier call; "
                           "try again later")
        async with self.plane.locks.hold(name, _left(deadline), late):
            yield

    async def _take_back(self, model: ModelFiles, old: CatalogEntry | None, given: GivenFiles | None,
                         why: str, tried: CatalogEntry | None = None) -> None:
        """After a failed load: the files it gave are removed (those an old model still loads from stay);
        a model that served serves on from its old files, one that did not says why. The versions that
        failed on the workers (`tried`) and that the old model does not load stay listed with their
        errors, as Triton's index keeps them."""
        if given is not None:
            await forget(self.plane.redis, self.plane.keys, model.name,
                         old.path if old is not None and old.loaded else None)
        if old is not None and old.loaded:  # (with the tries the workers failed it by: not tried once more)
            tries = tried.tries if tried is not None else old.tries
            # a cold start's mark only while it is one still (this load, once under way, ended it)
            cold_since = old.cold_since if model.name in self.plane.lifecycle.idle.cold else 0.0
            self.plane.catalog.put(replace(old, dropped=dropped_since(tried, old), tries=tries,
                                           cold_since=cold_since))
        else:  # (the versions it loaded once are still listed once it loads again)
            entry = unavailable(model, why)
            self.plane.catalog.put(replace(entry, retired=retired_since(old, entry)))
        self.plane.kick()

    async def _load_steps(self, entry: CatalogEntry, timeout: float, calling: tuple[str, ...]) -> None:
        """Load what an ensemble calls and is not loaded (an idle model stays idle: a request wakes it), and
        what it calls whose load failed: as Triton's, the ensemble's load tries it again (try_again). A step
        loaded from a load's files is loaded again from the repository: Triton's load of an ensemble reads
        the models it calls from there, and files given differ from their folder."""
        for model in sorted(called_by(entry.config)):
            step = self.plane.catalog.get(model)
            if model in calling or (step is not None and step.loaded and not _failed(step)
                                    and given_digest(step.path) is None):
                continue
            try:
                await self.load(model, {}, timeout, wait=False, calling=calling)
            except DespinaError as exc:  # the ensemble then says which step cannot serve, and why
                log.error("ensemble %s: loading model %s failed: %s", entry.name, model, exc.message)

    async def _bring_back(self) -> None:
        """The ensembles unloaded with a model they call load again once all of them are loaded, as
        Triton's do; their statistics start afresh, as after any load."""
        plane = self.plane
        back = [replace(plane.catalog.entries[name], target=LOADED, with_steps=False, failed={})
                for name in back_with(plane.catalog.entries)]
        for e in back:  # all of them before anything is awaited: an unload meanwhile sees them loaded
            plane.catalog.put(e)
            plane.lifecycle.idle.awake_since[e.name] = clock.now()
            log.info("ensemble %s: loading again, with the models it calls", e.name)
        for e in back:
            await start_stats_afresh(plane.redis, plane.keys, e.name, made_anew(e))

    async def unload(self, name: str, dependents: bool, timeout: float) -> None:
        plane = self.plane
        check_model_name(name)
        deadline = time.monotonic() + timeout
        ttl_ms = plane.lifecycle.delivery.reply_ttl_ms
        # its turn first: a load sent just before it (or queued with it while no control plane ran) puts the
        # model in the catalog only once it has read the registry, and must not be left to load after it
        async with self._turn(name, deadline):
            if plane.catalog.get(name) is None:
                return  # never loaded, or no such model: as Triton's, the unload has no effect and succeeds
            names = [name] + (steps_loaded_for(plane.catalog.entries, name) if dependents else [])
            self._mark_unloaded(name)
            for n in names[1:]:
                async with self._turn(n, deadline):
                    self._mark_unloaded(n)
            # as Triton's, the ensembles that call it go with it, and load again once it is back (not
            # waiting for their turns: a load of one waits for the models it calls, this one's among them)
            for d in unloaded_with(plane.catalog.entries, name, names):
                self._mark_unloaded(d, with_steps=True)
            plane.kick()
            for n in names:
                await plane.lifecycle.wait(n, "unload", None, _left(deadline))
                await forget(plane.redis, plane.keys, n)  # the files a load gave it, if any
                if not await plane.lease.confirm():  # the queue is the new leader's to empty, or not
                    raise LeaseLost(f"not emptying unloaded model '{n}''s queue: another control plane leads")
                e = plane.catalog.get(n)
                if e is None or e.target != UNLOADED:
                    continue
                await refuse_model(plane.redis, plane.keys, e, f"model '{n}' was unloaded", ttl_ms)
        # an ensemble unloaded with it: no worker runs it now (each stopped running it before the model
        # unloaded), so what is still on its stream would wait for nobody
        for d in ensembles_calling(plane.catalog.entries, name):
            e = plane.catalog.get(d)
            if e is None or d in names or e.target != UNLOADED:  # (one a load brought back meanwhile runs)
                continue
            await refuse_model(plane.redis, plane.keys, e, f"ensemble '{d}' cannot run: model '{name}' was "
                               "unloaded", ttl_ms)

    def _mark_unloaded(self, name: str, with_steps: bool = False) -> None:
        plane = self.plane
        e = plane.catalog.get(name)
        if e is not None and e.state == "READY":
            current = tuple(v for v in e.versions if v not in e.retiring)
            plane.catalog.put(replace(e, target=UNLOADED, workers=(), versions=current, retiring=(),
                                      retired=retire(e, e.retiring, current), with_steps=with_steps,
                                      cold_error="", cold_failures=0, cold_retry_at=0.0, cold_since=0.0))
            plane.lifecycle.idle.cold.pop(name, None)
            plane.lifecycle.retire_at.pop(name, None)
            log.info("model %s: unloading", name)

    # -- cold start --------------------------------------------------------------------------------

    async def wake(self, name: str, version: Any, timeout: float) -> int:
        """Load a registered model that is not loaded (or wait for one coming up); answers the version
        to call once it is READY."""
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise InvalidArgument(f"model version '{version}' is not a number")
        e = self.plane.lifecycle.wake(name)
        if version is not None and version not in e.versions:
            raise version_refused(e, version)
        self.plane.kick()
        return await self.plane.lifecycle.wait(name, "wake", version, timeout)


def _served(old: CatalogEntry | None, ready: Callable[[int], bool]) -> bool:
    """Whether a model served before a reload: loaded, and some version of it not failed or ready."""
    return old is not None and old.loaded and any(v not in old.failed or ready(v) for v in old.versions)


def _reload_failed(old: CatalogEntry | None, new: CatalogEntry | None) -> bool:
    """Whether a reload of a model that served failed in every new version: its old config goes back
    with its old files, as Triton's (the gateways checked requests against the config that failed)."""
    if old is None or not old.loaded or new is None:
        return False
    return all(v in new.failed for v in new.versions if v not in new.retiring)


def _failed(e: CatalogEntry) -> bool:
    """Whether a version the model loads failed to (a load tries it again: try_again)."""
    return any(v in e.failed for v in e.versions if v not in e.retiring)


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())
