"""A load makes a model's versions anew, and in Triton their statistics start again from nothing."""
from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from ..contract.catalog import CatalogEntry
from ..contract.instance_groups import same_but_instances
from ..contract.keys import Keys


def made_anew(entry: CatalogEntry, old: CatalogEntry | None = None) -> list[int]:
    """The versions a load of `entry` loads: not those still serving until it is done, nor failed ones,
    nor those of `old` (the entry before the load) whose files and config the load leaves as they were but
    perhaps their instance groups: Triton's load leaves such a model loaded, adding or removing instances
    in place, and its statistics go on."""
    same = old.revisions if old is not None and old.loaded else {}
    return [v for v in entry.versions if v not in entry.retiring and v not in entry.failed
            and not (old is not None and v in same and v not in old.failed
                     and same_but_instances(same[v], entry.revisions.get(v, "")))]


async def start_stats_afresh(redis: aioredis.Redis, keys: Keys, name: str, versions: Iterable[int]) -> None:
    """Take each version's counters as its statistics' new zero (Keys.stats_base). The counters themselves
    go on: the Prometheus metrics read them, and Triton's metrics are not reset by a load."""
    pipe = redis.pipeline(transaction=True)
    for v in versions:
        base = keys.stats_base(name, v)
        pipe.delete(base)  # (a version never counted has no counters to copy: no base either)
        pipe.copy(keys.stats(name, v), base)
    await pipe.execute()
