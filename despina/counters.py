"""Statistics counters on their way to Redis, from workers and gateways alike.

Triton's statistics live in one Redis hash per model version (workers/stats.py names the fields);
every process adds to it with HINCRBY, so the sums are over all of them. What need not go out at once
(a busy model's batches, a gateway's own refusals and ensembles) waits in a Deferred for the next
pipeline its process writes anyway.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis

from .contract.records import packb
from .resp import Batch, Resp

log = logging.getLogger("despina.counters")

# One command for all of a batch's counters, in one argument: the counters as a msgpack map, which
# Redis's Lua reads with its cmsgpack. As field/value arguments (two per counter, some forty a batch),
# packing them cost a worker ~75,000 instructions a batch, hiredis formatting each argument's length
# with sprintf; msgpack packs the map in ~3,000. Lua's numbers are doubles: a counter's value in one
# update is exact below 2^53 (104 days in nanoseconds), and redis.call writes such a number as the
# integer's digits (Redis's "%.17g", Valkey's shortest form), as HINCRBY wants them. last_inference is
# set, not added.
HINCRBY_MANY = """
for field, n in pairs(cmsgpack.unpack(ARGV[1])) do
  if field == 'last_inference' then redis.call('HSET', KEYS[1], field, n)
  else redis.call('HINCRBY', KEYS[1], field, n) end
end
"""

DEFER_S = 0.02  # how long counters may wait for a pipeline to ride along with


def record_counts(pipe: Any, key: str, counts: dict[str, int], script: str = HINCRBY_MANY) -> None:
    """Add `counts` to the statistics hash `key` (last_inference is set), in one command of `pipe`, with
    HINCRBY_MANY or the `script` made of it (Deferred.script)."""
    if counts:
        pipe.eval(script, 1, key, packb(counts))


class Deferred:
    """Counters that need not go out at once. They ride along with the next pipeline their process
    sends anyway (`into`), or go alone after DEFER_S, instead of a round trip, or a statistics update,
    of their own each time."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        # A worker's counters go as allow_oom makes HINCRBY_MANY: while Redis is full too. Else requests
        # a gateway counted as enqueued before, and answered meanwhile, were never counted as answered,
        # and the metrics showed them pending for good. A gateway's need not: when its requests cannot be
        # queued, the counts of its refusals (fail_count and refused alike) cancel out.
        self.script = HINCRBY_MANY
        self._counts: dict[str, dict[str, int]] = {}  # statistics hash -> counters
        self._timer: asyncio.TimerHandle | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._out: Resp | None = None

    def add(self, key: str, counts: dict[str, int]) -> None:
        if not counts:
            return
        mine = self._counts.get(key)
        if mine is None:  # the usual case when batches are far apart: copied in C, not summed field by field
            self._counts[key] = dict(counts)
        else:
            get = mine.get
            for field, n in counts.items():
                mine[field] = max(get(field, 0), n) if field == "last_inference" else get(field, 0) + n
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(DEFER_S, self._flush)

    def count(self, key: str, field: str) -> None:
        """add(key, {field: 1}), for a counter counted one by one (a request made in a worker, queued)."""
        mine = self._counts.get(key)
        if mine is None:
            self._counts[key] = {field: 1}
        else:
            mine[field] = mine.get(field, 0) + 1
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(DEFER_S, self._flush)

    def into(self, pipe: Any) -> int:
        """Move every counter waiting into `pipe`; how many commands that added."""
        if not self._counts:
            return 0  # the usual case
        counts, self._counts = self._counts, {}
        for key, added in counts.items():
            record_counts(pipe, key, added, self.script)
        return len(counts)

    def _flush(self) -> None:
        self._timer = None
        if self._counts:
            task = asyncio.get_running_loop().create_task(self._write())
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write(self) -> None:
        pipe = Batch()
        self.into(pipe)
        if self._out is None:
            self._out = Resp.like(self.redis)
        try:
            await self._out.execute(pipe.commands)
        except Exception as exc:  # statistics only: the requests were answered
            log.warning("writing statistics failed: %s", exc)

    async def close(self) -> None:
        """Write what is left; then nothing more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counts:
            await self._write()
        await asyncio.gather(*self._writes, return_exceptions=True)
        if self._out is not None:
            self._out.close()
