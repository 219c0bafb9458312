"""A load makes a model's versions anew, and in Triton their statistics start again from nothing."""
from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from ..contract.catalog import CatalogEntry
from ..contract.keys import Keys


def made_anew(entry: CatalogEntry) -> list[int]:
    """The versions a load of `entry` loads: not those still serving until it is done, nor failed ones."""
    return [v for v in entry.versions if v not in entry.retiring and v not in entry.failed]


async def start_stats_afresh(redis: aioredis.Redis, keys: Keys, name: str, versions: Iterable[int]) -> None:
    """Take each version's counters as its statistics' new zero (Keys.stats_base). The counters themselves
    go on: the Prometheus metrics read them, and Triton's metrics are not reset by a load."""
    pipe = redis.pipeline(transaction=True)
    for v in versions:
        base = keys.stats_base(name, v)
        pipe.delete(base)  # (a version never counted has no counters to copy: no base either)
        pipe.copy(keys.stats(name, v), base)
    await pipe.execute()
