"""After Redis lost its data (restarted without it, flushed, or failed over to a replica that had none):
the worker tells each gateway which of its requests it still has in hand.

A gateway that finds its own mark gone answers 503 to every request it waits on that no answer reaches
within its grace (gateway/reply_reader.py): those that were only queued went with Redis's data. A request a
worker was running on a slow model was not lost, but its answer came after the grace, was dropped, and a
client that retried ran it twice. So the worker, once it finds its own mark gone (its heartbeat renews it,
presence.py), writes to each gateway's reply stream one entry naming that gateway's requests it holds
(keys.IN_HAND), and the gateway keeps those waiting, to their own deadlines. Nothing of this runs on the
way of a request: only once Redis is found to have lost its data.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..contract import records
from ..contract.keys import IN_HAND
from .replies import REPLY_MAXLEN
from .runner import ModelRunner

log = logging.getLogger("despina.worker")


def by_gateway(runners: Iterable[ModelRunner]) -> dict[str, list[str]]:
    """Reply stream -> the ids of its gateway's requests these runners hold (ModelRunner.in_hand)."""
    held: dict[str, list[str]] = {}
    for runner in runners:
        for reply_to, request_id in runner.in_hand():
            held.setdefault(reply_to, []).append(request_id)
    return held


async def tell_gateways(redis: aioredis.Redis, worker_id: str, runners: Iterable[ModelRunner],
                        ttl_ms: int) -> int:
    """Write each gateway the ids of its requests the runners hold, in one entry on its reply stream (which
    expires, as replies' do, if its gateway is gone); how many requests were named."""
    held = by_gateway(runners)
    if not held:
        return 0
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for stream, ids in held.items():
                pipe.xadd(stream, {IN_HAND: records.encode_ids(ids)}, maxlen=REPLY_MAXLEN, approximate=True)
                pipe.pexpire(stream, ttl_ms)
            await pipe.execute()
    except (RedisError, OSError) as exc:
        log.error("worker %s: telling %d gateway(s) of the requests it still holds failed: %s", worker_id,
                  len(held), exc)
        return 0
    count = sum(map(len, held.values()))
    log.warning("worker %s: told %d gateway(s) it still holds %d of their request(s): their answers will "
                "come", worker_id, len(held), count)
    return count
