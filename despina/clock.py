"""Wall-clock time that processes on different hosts agree on: Redis's.

A gateway writes a request's deadline and enqueue time, a worker compares them with its own time; a worker
writes a model's last inference, the control plane compares it with its own time to scale the model to
zero; a gateway writes a command's deadline, the control plane drops the command past it. Across hosts
the wall clocks differ: by milliseconds with NTP, by seconds or minutes without (a VM resumed from a
snapshot, a node whose NTP is broken), and a worker 60 s ahead answered every request "past its deadline".

So each process measures the offset of its clock to Redis's (`TIME`) at start and then now and again (a
worker at each heartbeat, a gateway at each view refresh, the control plane at each lease renewal), and
every timestamp another process reads is `now()`: time.time() plus that offset, no Redis call per request.
A process whose clock is off by more than DESPINA_CLOCK_SKEW_WARN_S says so once in its log (a worker in
its status too); it keeps working, on Redis's time.
"""
from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("despina.clock")

SAMPLES = 3  # round trips at start: the shortest bounds the offset best

_offset = 0.0  # seconds to add to time.time() for Redis's time; one per process, as the clock is


def now() -> float:
    """Seconds since the epoch by Redis's clock (as last measured): the time to write where another
    process reads it, and to compare with what another process wrote."""
    return time.time() + _offset


def offset() -> float:
    """Seconds this host's clock is behind Redis's (negative: ahead), as last measured."""
    return _offset


class Skew:
    """Measures this process's clock offset to Redis's and warns when it is large."""

    def __init__(self, warn_s: float, who: str) -> None:
        self.warn_s, self.who = warn_s, who
        self.measured = False
        self.warned = False

    async def measure(self, redis: aioredis.Redis, samples: int = 1) -> float:
        """Measure the offset (`samples` round trips) and set it for now(); the offset."""
        global _offset
        low, high = -float("inf"), float("inf")
        for _ in range(samples):
            before = time.time()
            seconds, micros = await redis.time()
            after = time.time()
            redis_now = seconds + micros / 1e6  # its clock truncated to the microsecond
            # Redis read its clock between `before` and `after`: the offset lies between these two bounds
            low, high = max(low, redis_now - after), min(high, redis_now + 1e-6 - before)
        if low > high:  # the clock stepped between two samples: the last one alone
            low, high = redis_now - after, redis_now + 1e-6 - before
        # kept while it lies within the bounds: a round trip slowed by a busy loop moves nothing, the offset
        # does not jitter by the round trip's noise from one measurement to the next, and on Redis's own
        # host (or one in step with it) it stays exactly 0, as every process's there
        if not low <= _offset <= high:
            _offset = (low + high) / 2
        self.measured = True
        self._warn()
        return _offset

    async def keep(self, redis: aioredis.Redis, every_s: float) -> None:
        """Measure the offset every `every_s` until cancelled (Redis out of reach: the last one holds)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.measure(redis)
            except (RedisError, ConnectionError, OSError) as exc:
                log.debug("%s: measuring the clock's offset to Redis's failed (%s)", self.who, exc)

    def warning(self) -> str:
        """What is wrong with this host's clock, or ''."""
        if not self.warn_s or abs(_offset) <= self.warn_s:
            return ""
        way = "behind" if _offset > 0 else "ahead of"
        return (f"this host's clock is {abs(_offset):.3f} s {way} Redis's (more than "
                f"DESPINA_CLOCK_SKEW_WARN_S={self.warn_s:g} s): Despina uses Redis's time; fix the host's "
                "time synchronisation (NTP)")

    def _warn(self) -> None:
        text = self.warning()
        if text and not self.warned:
            log.warning("%s: %s", self.who, text)
        elif not text and self.warned:
            log.info("%s: this host's clock is within %g s of Redis's again", self.who, self.warn_s)
        self.warned = bool(text)
