"""A worker's one sweep of its models' pending entries: what a consumer left unanswered past the
visibility timeout goes back on its stream (redelivery.py).

Each model version served here (a ModelRunner, an EnsembleHost) is a member while it reads its streams.
Every tick the sweep asks Redis, in one pipelined round trip, for the entries of each due member's streams
that have been pending past that member's own visibility timeout (XPENDING ... IDLE), and redelivers only
where there are some. The tick is the shortest of the members' periods (a quarter of a visibility
timeout); a member with a longer period is due every few ticks, as its own period says. A worker of 400
idle models, each looking for itself, made 400 round trips a period, each a wake-up of the worker and of
Redis; it now makes one.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..contract.keys import GROUP
from ..logs import Throttled
from .redelivery import DeliveryPolicy

if TYPE_CHECKING:
    from .streams import ModelStreams

log = logging.getLogger("despina.worker")

COUNT = 100  # the most entries of one stream redelivered per sweep (the rest: at the next)


@dataclass(slots=True)
class Member:
    streams: ModelStreams
    policy: DeliveryPolicy
    name: str           # for the logs: "model m", "ensemble e"
    last: float         # the loop's time it was last swept (or joined)

    @property
    def period(self) -> float:
        return self.policy.visibility_timeout_ms / 4000


class PendingSweep:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._members: dict[ModelStreams, Member] = {}
        self._joined = asyncio.Event()  # a member joined: the tick may be shorter now

    def add(self, streams: ModelStreams, policy: DeliveryPolicy, name: str) -> None:
        """Sweep these streams by this policy from now on, first about a period from now."""
        self._members[streams] = Member(streams, policy, name, asyncio.get_running_loop().time())
        self._joined.set()

    def discard(self, streams: ModelStreams) -> None:
        self._members.pop(streams, None)

    def __contains__(self, streams: ModelStreams) -> bool:
        return streams in self._members

    def _tick(self) -> float | None:
        return min((m.period for m in self._members.values()), default=None)

    async def run(self) -> None:
        """Sweep every tick, the members due, until cancelled."""
        loop = asyncio.get_running_loop()
        failed = Throttled(log)
        last = loop.time()
        while True:
            tick = self._tick()
            wait = None if tick is None else last + tick - loop.time()
            if wait is None or wait > 0:
                self._joined.clear()
                try:
                    await asyncio.wait_for(self._joined.wait(), wait)
                except TimeoutError:
                    pass
                continue
            assert tick is not None
            last = loop.time()
            # due a half tick early rather than a half tick late: members of one period go together
            due = [m for m in self._members.values() if last - m.last >= m.period - tick / 2]
            try:
                await self.sweep(due)
            except (RedisError, OSError) as exc:
                failed.log("worker: reading the pending entries of its streams failed (%s)", exc)
            except Exception:  # a bug here must not end every model's redelivery on this worker for good
                log.exception("worker: sweeping the pending entries of its streams failed")

    async def sweep(self, members: Iterable[Member] | None = None) -> int:
        """Redeliver what is pending past its visibility timeout on the streams of `members` (None: all),
        asked in one round trip; returns how many requests went back (or were dead-lettered)."""
        members = list(self._members.values() if members is None else members)
        if not members:
            return 0
        now = asyncio.get_running_loop().time()
        pipe = self.redis.pipeline(transaction=False)
        for m in members:
            m.last = now
            for queue in m.streams.queues:
                pipe.xpending_range(queue.stream, GROUP, "-", "+", COUNT, idle=m.policy.visibility_timeout_ms)
        results = iter(await pipe.execute(raise_on_error=False))
        moved = 0
        for m in members:
            for queue in m.streams.queues:
                pending = next(results)
                if not pending or isinstance(pending, Exception):  # none, or no stream or group (yet)
                    continue
                try:
                    moved += await m.streams.redeliver(queue, pending, m.policy)
                except (RedisError, OSError) as exc:
                    log.warning("%s: redelivering pending entries failed (%s)", m.name, exc)
        return moved
