"""The control plane's two views: the catalog it writes, and the workers it reads."""
from __future__ import annotations

import asyncio
import logging
import secrets
from typing import cast

import redis.asyncio as aioredis

from ..contract.catalog import CatalogEntry, read_entries
from ..contract.cluster import WorkerInfo, WorkerStatus
from ..contract.keys import Keys
from .lease import LeaseLost, LeaseVanished

log = logging.getLogger("despina.control")

# The catalog's generation (Keys.catalog_generation) lives while a control plane of this version leads: each
# flush and each renewal of the lease keep it. Under one of an earlier version, which changes the catalog
# and not the generation, it is gone within this, and readers read the whole catalog every time again.
GENERATION_TTL_MS = 10_000
# The catalog's changes in one step, fenced by the lease: a control plane that stalled past its lease while
# another took over must not write its stale catalog over the new leader's (the workers would follow it,
# and the new leader, whose entries are not dirty, would never write them again). A lease nobody holds
# does not stop it: after Redis lost its data, the catalog is written again before the lease is taken.
# KEYS: lease, catalog, published marker, generation. ARGV: holder ('' = unfenced), mark (0/1), a random
# start for the generation, its TTL ms, the events channel, the number of names written, then each name
# and entry, then the names removed. Returns 0 when another holds the lease (nothing written), else 1.
FLUSH = """
local holder = redis.call('GET', KEYS[1])
if ARGV[1] ~= '' and holder and holder ~= ARGV[1] then return 0 end
local dirty = tonumber(ARGV[6])
local first = 7
for i = first, first + 2 * dirty - 1, 1000 do
  redis.call('HSET', KEYS[2], unpack(ARGV, i, math.min(i + 999, first + 2 * dirty - 1)))
end
for i = first + 2 * dirty, #ARGV, 1000 do
  redis.call('HDEL', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
if ARGV[2] == '1' then redis.call('SET', KEYS[3], '1') end
redis.call('SET', KEYS[4], ARGV[3], 'NX')
redis.call('INCR', KEYS[4])
redis.call('PEXPIRE', KEYS[4], ARGV[4])
redis.call('PUBLISH', ARGV[5], 'catalog')
return 1
"""


class Catalog:
    """The desired state, kept in memory and mirrored to the catalog hash (one writer: this process)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, holder: str = "") -> None:
        """`holder`: the control plane's id: it flushes only while no other holds the lease ('': always)."""
        self.redis, self.keys, self.holder = redis, keys, holder
        self.entries: dict[str, CatalogEntry] = {}
        self.changes = 0  # counts the changes of `entries`: the lifecycle skips a tick that moved nothing
        self._dirty: set[str] = set()
        self._removed: set[str] = set()
        self.complete = False  # the repository has been read once (republish() writes the marker again)
        self._mark = False     # the published marker is to be written at the next flush
        # one flush at a time: two in flight on two connections can reach Redis in either order, and an
        # older entry written last would stay there (nothing is dirty any more to write it again)
        self._flushing = asyncio.Lock()

    async def load(self) -> None:
        """Adopt what a previous control plane published: placement and targets survive a restart. An entry
        that cannot be read (written by hand, or by another version) is named and skipped, and the next
        flush takes it out: the workers and gateways cannot read it either (it failed this start with a
        traceback, and every restart after), and the repository brings its model back."""
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(self.keys.catalog))
        self.entries, bad = read_entries(raw)
        for name, why in bad.items():
            log.error("catalog entry '%s' (%s) cannot be read (%s); skipped and removed: the repository "
                      "brings the model back (explicit mode: when it is loaded again)", name,
                      self.keys.catalog, why)
            self._removed.add(name)
        self.changes += 1

    def get(self, name: str) -> CatalogEntry | None:
        return self.entries.get(name)

    def put(self, entry: CatalogEntry) -> None:
        if self.entries.get(entry.name) != entry:
            self.entries[entry.name] = entry
            self.changes += 1
            self._dirty.add(entry.name)
            self._removed.discard(entry.name)

    def remove(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self.changes += 1
            self._removed.add(name)
            self._dirty.discard(name)

    def republish(self) -> None:
        """Write every entry again at the next flush (the hash was lost)."""
        self._dirty |= set(self.entries)
        self._mark = self.complete

    def mark_complete(self) -> None:
        """The repository has been read once: the next flush tells gateways the catalog is whole."""
        self.complete = self._mark = True

    @property
    def changed(self) -> bool:
        return bool(self._dirty or self._removed or self._mark)

    async def flush(self) -> None:
        """Write what changed in one step (FLUSH), with a new generation, and announce it; raises LeaseLost
        when another control plane leads."""
        async with self._flushing:
            if not self.changed:
                return
            dirty, removed, mark = self._dirty, self._removed, self._mark
            self._dirty, self._removed, self._mark = set(), set(), False
            args: list[bytes | str | int] = [self.holder, int(mark), secrets.randbits(48), GENERATION_TTL_MS,
                                             self.keys.events, len(dirty)]
            for name in list(dirty):
                try:
                    args += [name, self.entries[name].dumps()]
                except (TypeError, ValueError) as exc:  # (text that is not UTF-8): the others are written
                    log.error("control: model %s's state cannot be written, left out: %s", name, exc)
                    dirty.discard(name)
                    args[5] = len(dirty)
            args += list(removed)
            try:
                keys = self.keys
                written = await self.redis.eval(FLUSH, 4, keys.control_leader, keys.catalog,
                                                keys.catalog_published, keys.catalog_generation, *args)
            except BaseException:
                self._dirty |= dirty - self._removed
                self._removed |= removed - self._dirty
                self._mark |= mark
                raise
            if not written:
                raise LeaseLost("another control plane holds the lease; the catalog was not written")


# The workers a placement saw (Keys.placed), all at once and fenced by the lease as FLUSH is. KEYS: lease,
# the set. ARGV: holder ('' = unfenced), then the worker ids. Returns 0 when another holds the lease.
PLACED = """
local holder = redis.call('GET', KEYS[1])
if ARGV[1] ~= '' and holder and holder ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
for i = 2, #ARGV, 1000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
return 1
"""


class Workers:
    """The live workers, as their heartbeats describe them. A worker's hash is read again only when the
    digest of its state (`state`, contract/cluster.py) moved: a worker of 400 models writes 40 KB there on
    every heartbeat, the same most of the time, and the control plane ticks every second (20 times a second
    while anything moves). Its other fields (the cache's counters) are as of its last change of state."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.status: dict[str, WorkerStatus] = {}
        self.infos: dict[str, WorkerInfo] = {}  # each live worker's WorkerInfo
        self.leaving: set[str] = set()  # live workers told to stop: they hand their models over (worker.py)
        self.homes: dict[str, WorkerInfo] = {}  # infos of those not leaving: placement reads it per model
        self._digests: dict[str, bytes] = {}  # worker id -> the digest its status was read with
        self.changes = 0  # counts the refreshes that found a worker come, gone or changed
        self._placed: frozenset[str] | None = None  # what Keys.placed holds, as last written (None: unknown)

    async def refresh(self, members: set[bytes] | None = None) -> dict[str, WorkerStatus | None]:
        """Read every worker's digest (of `members`, the workers' set where the caller read it already), and
        the hash of each one whose digest moved or is missing (a worker of an earlier version writes none; an
        expired heartbeat key has none); returns the workers whose heartbeat key expired (now forgotten),
        each with its status as last read (what it was loading when it died), if any."""
        if members is None:
            members = cast(set[bytes], await self.redis.smembers(self.keys.workers))
        ids = sorted(m.decode() for m in members)
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hget(self.keys.worker(wid), "state")
        digests = await pipe.execute() if ids else []
        moved = [wid for wid, d in zip(ids, digests) if d is None or self._digests.get(wid) != d]
        pipe = self.redis.pipeline(transaction=False)
        for wid in moved:
            pipe.hgetall(self.keys.worker(wid))
        hashes = dict(zip(moved, await pipe.execute() if moved else []))
        status, digests_now, dead = {}, {}, {}
        for wid in ids:  # (in the order of their ids, as placement saw them before)
            h = hashes.get(wid)
            if h is None:  # its digest as before
                status[wid], digests_now[wid] = self.status[wid], self._digests[wid]
            elif h:
                status[wid] = WorkerStatus.from_hash(wid, h)
                if b"state" in h:  # (what was read, if the worker wrote again between the two reads)
                    digests_now[wid] = h[b"state"]
            else:
                dead[wid] = self.status.get(wid)
        # a heartbeat read after Redis lost its data is gone with the lease (read before it, by the caller):
        # taken for dead, the workers' models were placed on none and unloaded, before the next tick held
        # placement for the workers to announce themselves again
        if dead and not await self.redis.exists(self.keys.control_leader):
            raise LeaseVanished(f"the lease vanished with the heartbeats of {', '.join(dead)}")
        if dead:
            await self.redis.srem(self.keys.workers, *dead)
            for wid in dead:
                log.warning("worker %s stopped sending heartbeats; removed", wid)
        if moved or list(status) != list(self.status):
            self.changes += 1
        self.status, self._digests = status, digests_now
        self.infos = {wid: s.info for wid, s in status.items()}
        self.leaving = {wid for wid, s in status.items() if s.leaving}
        self.homes = {wid: info for wid, info in self.infos.items() if wid not in self.leaving}
        return dead

    async def mark_placed(self, holder: str) -> None:
        """Tell the live workers a placement saw them (Keys.placed), once the catalog it wrote is flushed: a
        worker is ready for Kubernetes once it is there and its loads have ended. Written when the set
        moves; raises LeaseLost when another control plane (`holder`: this one's id) leads."""
        seen = frozenset(self.status)
        if seen == self._placed:
            return
        if not await self.redis.eval(PLACED, 2, self.keys.control_leader, self.keys.placed, holder, *seen):
            raise LeaseLost("another control plane holds the lease; the placed workers were not written")
        self._placed = seen

    def forget_placed(self) -> None:
        """Keys.placed may be gone (Redis lost its data): the next mark_placed() writes it again."""
        self._placed = None

    def ready_on(self, name: str, version: int, revision: str | None = None) -> list[str]:
        return [wid for wid, s in self.status.items() if s.ready(name, version, revision)]

    def held_up(self, name: str, version: int) -> str:
        """Why a worker's load of the version waits (its registry cannot serve the files now), or ''."""
        for s in self.status.values():
            v = s.version(name, version)
            if v is not None and (v.state == "LOADING" or v.loading) and v.error and not v.failed:
                return f"worker {s.info.id} waits for the registry: {v.error}"
        return ""

    def hosting(self, name: str) -> list[str]:
        """Workers that still report any version of the model (loaded, loading or unloading)."""
        return [wid for wid, s in self.status.items()
                if any(v.state != "UNAVAILABLE" for v in s.detail.get(name, {}).values())]
