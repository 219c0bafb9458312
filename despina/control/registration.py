"""The registry's models into the catalog, as the model control mode says: none, all of them at start;
explicit, the --load-model ones at start (and the API's); poll, all of them, then every
--repository-poll-secs, a model's change applied once two looks in a row see the same files."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from .. import logs
from ..contract.catalog import LOADED, CatalogEntry
from ..contract.errors import DespinaError, InvalidArgument, NotFound, Unavailable
from ..redis_client import trouble
from ..registry import ModelFiles
from .fresh_stats import made_anew, start_stats_afresh
from .lease import LeaseLost
from .repository import read_model, unavailable
from .versions import transition

if TYPE_CHECKING:
    from .plane import ControlPlane

log = logging.getLogger("despina.control")

# how long a look at the repository waits for the registry's listing (one call a 1,000 files): a store that
# takes connections and never answers held each look, saying nothing, for boto3's read timeout three times
SCAN_LOOK_S = 30.0


class Registration:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.names: list[str] = []          # the registry's models at the last successful look
        self.error = ""                     # why the last look at the registry failed
        self._applied: dict[str, str] = {}  # model -> fingerprint of the files now in the catalog
        self._seen: dict[str, str] = {}     # model -> fingerprint seen by the last poll
        self._load_waits: set[str] = set()  # --load-model models whose failure to load was logged
        self._start_failures: dict[str, str] = {}  # --load-model model -> why it cannot load, at the start
        self._scan: asyncio.Future[dict[str, ModelFiles]] | None = None  # the registry's listing in flight

    async def run(self) -> None:
        """Register the repository's models as the mode says; in poll mode, keep looking."""
        plane, mode = self.plane, self.plane.settings.model_control_mode
        first = True
        pending: list[str] | None = None  # explicit mode: --load-model names the store kept from loading
        failed = logs.Throttled(log, logging.ERROR)  # a store down for an hour: not a line every poll
        down = False
        while not plane.stopping:
            try:
                if mode == "explicit":
                    loading = pending is None
                    pending = await self._load_at_start(pending)
                    if first:
                        await self._published()
                    if loading and self._checks_start():
                        plane.spawn(self._check_start(pending))
                    first = False
                    if not pending:
                        return
                else:
                    await self.sync(first)
                    if down:
                        log.info("repository %s can be read again", plane.registry.url)
                        failed, down = logs.Throttled(log, logging.ERROR), False
                    if first:
                        await self._published()
                    first = False
                    if mode == "none" or not plane.settings.repository_poll_secs:  # Triton's 0: no polls
                        return
            except LeaseLost:
                plane.lost()
                return
            except DespinaError as exc:
                self.error, down = exc.message, True
                failed.log("repository %s: %s; models already loaded keep serving", plane.registry.url,
                           exc.message)
            except (RedisError, ConnectionError, OSError) as exc:
                log.warning("control: %s", trouble(exc))
            except Exception:  # a bug must not end the registry's loop without a word
                log.exception("control: a look at the repository failed")
            await plane.sleep(plane.settings.repository_poll_secs if mode == "poll" and not first else 2.0)

    async def _published(self) -> None:
        plane = self.plane
        plane.catalog.mark_complete()
        await plane.catalog.flush()

    def _ready_check(self, name: str) -> Callable[[int], bool]:
        return lambda version: bool(self.plane.workers.ready_on(name, version))

    async def _load_at_start(self, names: list[str] | None) -> list[str]:
        """Load the --load-model models (`names`: those left from the last try); returns those that the
        store kept from loading (unreachable, refusing), to try again: they load once it answers."""
        plane = self.plane
        if names is None:
            names = [n.strip() for n in plane.settings.load_model.split(",") if n.strip()]
            if "*" in names:
                names = await asyncio.to_thread(plane.registry.names)
        else:  # a load or unload through the API meanwhile has the last word (a failed one leaves none)
            names = [n for n in names if (e := plane.catalog.get(n)) is None or e.state != "READY"]
        pending = []
        for name in names:
            try:
                await plane.commands.load(name, {}, plane.settings.load_timeout_s, wait=False)
            except Unavailable as exc:
                if name not in self._load_waits:
                    log.error("--load-model %s: %s; trying again until it answers", name, exc.message)
                self._load_waits.add(name)
                pending.append(name)
            except DespinaError as exc:
                log.error("--load-model %s: %s", name, exc.message)
                self._start_failures[name] = exc.message
        return pending

    def _checks_start(self) -> bool:
        """Whether what --load-model names must load for the start to succeed, as Triton's --exit-on-error
        (default true) says: at this process's own start only (not serve's restart of an exited control
        plane, nor a standby taking over), and not for '*', the repository as a whole (README: a model
        broken in a shared repository must not keep every restart from serving the others)."""
        settings = self.plane.settings
        return self.plane.starting and settings.exit_on_error and settings.load_model.strip() != "*"

    async def _check_start(self, pending: list[str]) -> None:
        """Wait for the --load-model models' loads to end (those the store keeps from loading are tried
        again, as without the check: not a failure of theirs); stop the start if any failed, as Triton's
        "failed to load all models"."""
        plane, failures = self.plane, self._start_failures
        names = [n.strip() for n in plane.settings.load_model.split(",") if n.strip()]
        for name in names:
            if name in failures or name in pending:
                continue
            try:
                await plane.lifecycle.wait(name, "load", None, plane.settings.load_timeout_s)
            except (InvalidArgument, NotFound) as exc:  # it failed on the workers, or was taken away
                failures[name] = exc.message
            except Unavailable:  # still loading (a worker to join, say): no failure to stop the start for
                pass
        if failures:
            plane.fail_start("failed to load all models: " + "; ".join(
                f"--load-model {name}: {why}" for name, why in failures.items()))

    async def sync(self, first: bool) -> None:
        """Bring the catalog to the registry. After the first look, a model's change is applied once two
        looks in a row see the same files (an upload in progress is not loaded half-done)."""
        plane = self.plane
        models = await self._scanned()
        self.error = ""
        plane.lifecycle.ensembles.syncing = True  # checked once the models they call are all read
        try:
            await self._sync(models, first)
        finally:
            plane.lifecycle.ensembles.syncing = False

    async def _scanned(self) -> dict[str, ModelFiles]:
        """The registry's listing, waited on at most SCAN_LOOK_S. One that outlived its look is not started
        again until it ends: the looks meanwhile are skipped (run() logs why), and a store that hangs holds
        one thread, not one a poll."""
        url = self.plane.registry.url
        if self._scan is not None and not self._scan.done():
            raise Unavailable(f"registry {url} has not yet answered an earlier scan of the repository; this "
                              "look is skipped")
        self._scan = scan = asyncio.ensure_future(asyncio.to_thread(self.plane.registry.scan))
        scan.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, if late
        try:
            return await asyncio.wait_for(asyncio.shield(scan), SCAN_LOOK_S)
        except TimeoutError:
            raise Unavailable(f"registry {url} did not answer a scan of the repository within "
                              f"{SCAN_LOOK_S:g} s") from None

    async def _sync(self, models: dict[str, ModelFiles], first: bool) -> None:
        plane = self.plane
        self.names = sorted(models)
        for name, files in models.items():
            fingerprint = files.fingerprint()
            if self._applied.get(name) == fingerprint:
                continue
            if not first and self._seen.get(name) != fingerprint:
                self._seen[name] = fingerprint
                continue
            async with plane.locks.hold(name):
                try:
                    entry = await asyncio.to_thread(read_model, plane.registry, files, None,
                                                  plane.settings.rate_limit != "off")
                except Unavailable as exc:  # the store, not the model: try again next time
                    self.error = exc.message
                    log.error("model %s: %s; what is loaded keeps serving", name, exc.message)
                    if plane.catalog.get(name) is None:  # never read: the index says why, not just its name
                        plane.catalog.put(unavailable(files, exc.message))
                    continue
                except DespinaError as exc:
                    log.error("%s", exc.message)
                    entry = unavailable(files, exc.message)
                except Exception as exc:  # a bug, or a file that cannot be read: this model only
                    log.exception("model %s cannot be read", name)
                    entry = unavailable(files, f"model '{name}' cannot be read: {exc}")
                old = plane.catalog.get(name)
                target = old.target if old is not None and old.state == "READY" else LOADED
                plane.lifecycle.forget(name)
                new = transition(old, entry, target, self._ready_check(name))
                plane.catalog.put(new)
                if new.loaded:  # a version loaded anew counts from nothing (one reloaded in place goes on)
                    before = old.versions if old is not None and old.loaded else ()
                    await start_stats_afresh(plane.redis, plane.keys, name,
                                             [v for v in made_anew(new) if v not in before])
                self._applied[name] = fingerprint
                if old is not None and _differs(old, entry):  # a new leader reads the same, unchanged
                    log.info("model %s changed in the repository: %s", name,
                             f"loading version {','.join(map(str, entry.versions))}" if entry.state == "READY"
                             else "its new files cannot be used")
        for name in [n for n in plane.catalog.entries if n not in models]:
            log.info("model %s is gone from the repository; unloading it", name)
            plane.catalog.remove(name)
            self._applied.pop(name, None)
        ready = sorted(n for n, e in plane.catalog.entries.items() if e.state == "READY")
        if first and not models:  # as Triton, not an error; but a mistyped prefix looks just like this
            log.warning("repository %s holds no model folders: nothing to serve until one is added (is the "
                        "path right?)", plane.registry.url)
        if first:
            unusable = len(plane.catalog.entries) - len(ready)
            log.info("catalog: %d models, %d usable (%s)%s", len(plane.catalog.entries), len(ready),
                     ", ".join(ready) or "none", f"; {unusable} not: the index says why" if unusable else "")
        await plane.catalog.flush()
        plane.kick()


def _differs(old: CatalogEntry, new: CatalogEntry) -> bool:
    return (old.state, old.revisions, old.reason) != (new.state, new.revisions, new.reason)
