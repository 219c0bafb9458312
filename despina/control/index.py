"""The repository API's index on the control plane's side: every model of the repository and the catalog,
each version's state and why, as Triton's index lists them."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .. import clock
from ..contract.catalog import IDLE, UNLOADED, CatalogEntry, cold_start_failed
from ..contract.ensemble import is_ensemble
from ..contract.errors import DespinaError, Unavailable
from ..registry.given import given_digest

if TYPE_CHECKING:
    from .plane import ControlPlane

# how long the index waits for the registry's listing before it answers from what it knows (a store
# that accepts connections and never answers holds a listing for boto3's read timeout, three times)
INDEX_LOOK_S = 5.0


class RepositoryIndex:
    """POST /v2/repository/index, answered by the control plane that leads."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._look: asyncio.Future[list[str]] | None = None  # the index's listing in flight, one at a time

    async def rows(self, ready: Any) -> list[dict[str, str]]:
        """The index's rows (`ready` true: the READY ones only); the catalog's models when the registry
        cannot list its own, each row saying so."""
        plane = self.plane
        note = plane.registration.error
        try:
            listed = set(await self._names())
        except DespinaError as exc:
            note = exc.message
            listed = set(plane.registration.names)  # the repository's models as last listed
        # the catalog as it is after the listing (a poll may have taken a model out meanwhile); as Triton's,
        # a model made only of a load's files (none of it in the repository) is not listed, loaded or not
        names = listed | {n for n, e in plane.catalog.entries.items() if given_digest(e.path) is None}
        if note and not names:  # nothing to list: the answer is that the repository cannot be read
            raise Unavailable(f"the repository cannot be read: {note}")
        rows: list[dict[str, str]] = []
        for name in sorted(names):
            e = plane.catalog.get(name)
            if e is None:
                rows.append({"name": name})  # in the repository, never loaded (as Triton answers)
            elif e.state != "READY":
                rows.append(_row(name, "UNAVAILABLE", e.reason))
            else:
                for v in sorted(set(e.versions) | set(e.failed) | set(e.retired) | set(e.dropped)):
                    state, reason = self._version_state(e, v)
                    if note:
                        told = f"the repository cannot be read: {note}; the files already fetched serve"
                        reason = f"{reason}; {told}" if reason else told
                    rows.append(_row(name, state, reason, v))
        if ready is True:
            rows = [r for r in rows if r.get("state") == "READY"]
        return rows

    async def _names(self) -> list[str]:
        """The registry's model folders, waiting at most INDEX_LOOK_S: indexes asked meanwhile share one
        listing, so a store that hangs holds one thread, not one per index."""
        if self._look is None or self._look.done():
            self._look = asyncio.ensure_future(asyncio.to_thread(self.plane.registry.names))
            self._look.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, if late
        try:
            return await asyncio.wait_for(asyncio.shield(self._look), INDEX_LOOK_S)
        except TimeoutError:
            raise Unavailable(f"registry {self.plane.registry.url} did not list its models within "
                              f"{INDEX_LOOK_S:g} s") from None

    def _version_state(self, e: CatalogEntry, v: int) -> tuple[str, str]:
        plane = self.plane
        if v in e.dropped and v not in e.versions:  # as Triton's: its failed load's record stays
            return "UNAVAILABLE", e.dropped[v]
        if e.target == UNLOADED and v in e.failed and not is_ensemble(e.config):
            return "UNAVAILABLE", e.failed[v]  # as Triton's: an unload leaves a failed load's record
        if e.target == UNLOADED or (v in e.retired and v not in e.versions):  # as Triton's, once unloaded
            return "UNAVAILABLE", "unloaded"
        if is_ensemble(e.config):
            return plane.lifecycle.ensembles.state(e, v)
        if e.target == IDLE and e.cold_error:
            return "UNAVAILABLE", cold_failure(e, clock.now())
        if e.target == IDLE:
            return "UNAVAILABLE", (f"idle: unloaded after {plane.lifecycle.idle.timeout(e):g} s without "
                                   "requests; the next request loads it")
        if plane.workers.ready_on(e.name, v):
            return "READY", e.failed.get(v, "") or e.reason
        if v in e.failed:
            return "UNAVAILABLE", e.failed[v]
        if v in e.retiring:
            return "UNLOADING", ""
        return "LOADING", plane.lifecycle.shortfall.get(e.name, "") or plane.workers.held_up(e.name, v)


def cold_failure(e: CatalogEntry, now: float) -> str:
    """An idle model's reason after its cold start failed: the error, and when a request tries again."""
    failed = cold_start_failed(e, now)
    if failed is not None:
        return failed.message
    return f"{e.cold_error} (its cold start failed; the next request tries again)"


def _row(name: str, state: str, reason: str, version: int | None = None) -> dict[str, str]:
    """One row of the index, as Triton writes it: no "version" for the model as a whole, no empty "reason"."""
    row = {"name": name} if version is None else {"name": name, "version": str(version)}
    row["state"] = state
    if reason:
        row["reason"] = reason
    return row
