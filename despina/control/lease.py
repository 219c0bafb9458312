"""The leader's lease: one control plane acts at a time.

A leader that stalls past the lease (a paused VM, SIGSTOP, a long GC, a partition) wakes up still
believing it leads while a standby has taken over. Every step that acts first asks `confirm()`: free while
the lease is surely still this one's by the local clock, one round trip to Redis once it may have lapsed.
What the catalog writes is fenced in Redis itself (state.py: FLUSH), so a stall between the check and the
write cannot overwrite the new leader's catalog.
"""
from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

# 1: renewed; 0: another holds it; -1: nobody does (Redis lost its data, or this one stalled past the
# lease): the lifecycle loop republishes the catalog before it leads again.
RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not holder then return -1 end
return 0
"""
# the lease of a holder known to be dead (serve reaped it), deleted only while that one still holds it: a
# control plane elsewhere that took it meanwhile keeps it
TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# of the lease, the part that the local clock vouches for: Redis's clock may run a little faster, and a
# renewal's answer may take a while to come back
TRUSTED = 0.5


class LeaseLost(Exception):
    """Another control plane holds the lease: this one must stop acting."""


class LeaseVanished(Exception):
    """Nobody holds the lease any more (Redis lost its data): what was read with it is gone, and what a
    step would decide from the gap (workers without heartbeats: dead) is not so."""


class Lease:
    def __init__(self, redis: aioredis.Redis, key: str, holder: str, ms: int) -> None:
        self.redis, self.key, self.holder, self.ms = redis, key, holder, ms
        self._until = 0.0  # monotonic: the lease is surely this one's until then
        self._renewing: asyncio.Future[int] | None = None

    @property
    def held(self) -> bool:
        return time.monotonic() < self._until

    async def take(self) -> bool:
        sent = time.monotonic()
        if await self.redis.set(self.key, self.holder, nx=True, px=self.ms):
            self._trust(sent)
            return True
        return False

    async def take_over(self, dead: str) -> bool:
        """Free the lease of `dead`, a holder known to have exited (not merely silent: one that is stalled
        may wake up still leading), then take it. False when another holds it: stand by as usual."""
        await self.redis.eval(TAKE_OVER, 1, self.key, dead)
        return await self.take()

    async def renew(self) -> int:
        """RENEW's answer: 1 renewed, 0 another holds it, -1 nobody does. Those who ask while a renewal is
        on its way share it: a hundred commands that come as the local clock stops vouching for the lease
        would take a hundred connections of the pool at once (past its size: "Too many connections")."""
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.ensure_future(self._renew())
            self._renewing.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, if late
        return await asyncio.shield(self._renewing)

    async def _renew(self) -> int:
        sent = time.monotonic()
        held = int(await self.redis.eval(RENEW, 1, self.key, self.holder, self.ms))
        if held == 1:
            self._trust(sent)
        else:
            self.lapse()
        return held

    async def confirm(self) -> bool:
        """False when another control plane holds the lease: by the local clock while it can tell, else
        asked of Redis. (A lease nobody holds is the lifecycle loop's to take again: not a reason to stop.)"""
        return self.held or await self.renew() != 0

    def lapse(self) -> None:
        self._until = 0.0

    def _trust(self, sent: float) -> None:
        self._until = sent + self.ms / 1000 * TRUSTED
