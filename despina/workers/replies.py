"""What a worker writes back to Redis with its answers: the reply entries, and the queued counters of
priority levels with a max_queue_size. Shared by a model's runner and an ensemble run in the worker."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import hiredis
from redis.exceptions import RedisError

from ..contract import records
from ..contract.errors import Code
from ..contract.keys import FIELD, Keys
from ..contract.modelspec import ModelSpec
from ..contract.records import InferReply, InferRequest
from ..redis_client import BULK_DEFAULT
from ..resp import Batch, Command, Resp

log = logging.getLogger("despina.worker")

REPLY_MAXLEN = 100_000       # backstop: gateways trim what they have read
RESEND_S = 0.5               # how often reply entries Redis refused are written again


def bounded_levels(spec: ModelSpec) -> set[int]:
    """The priority levels whose queue policy sets max_queue_size: gateways count what they queue there."""
    return {level for level in range(1, max(spec.policy.priority_levels, 1) + 1)
            if spec.policy.queue_policy(level).max_queue_size}


# Takes answered requests off a level's queued counter (KEYS[1]) while Redis is full too (allow_oom: the
# counter exists, and shrinks): else Redis refused it then, took the acknowledgement, and the requests
# stayed counted for good, until the level refused every request as full on an empty queue.
DEQUEUED = "return redis.call('DECRBY', KEYS[1], ARGV[1])"


def count_dequeued(pipe: Batch, keys: Keys, spec: ModelSpec, version: int, bounded: set[int],
                   answered: list[InferRequest], script: str = DEQUEUED) -> None:
    """Take the answered requests off their levels' queued counters (those `bounded` ones), with DEQUEUED
    as allow_oom made it for this Redis (`script`)."""
    levels: dict[int, int] = {}
    for req in answered:
        if not req.reply_to:
            continue  # made in this process: never counted as queued
        level = spec.policy.level(req.priority)
        if level in bounded:
            levels[level] = levels.get(level, 0) + 1
    for level, n in levels.items():
        pipe.eval(script, 1, keys.queued(spec.name, version, level), n)


def replies_into(pipe: Batch, by_gateway: dict[str, list[InferReply]], ttl_ms: int, name: str,
                 limit: int = BULK_DEFAULT) -> int:
    """One reply entry per gateway's reply stream, which expires if its gateway is gone; how many entries.

    No entry is more than `limit` bytes, the most Redis takes in one value (bulk_limit): a longer one is a
    protocol error that closes the connection, and the whole pipeline failed with it, acknowledgements
    included, the requests redelivered and run again until dead-lettered as if they had killed the worker.
    A gateway's replies that come to more go in several entries; a reply that is more on its own is
    answered with an error instead (413: the model `name` answered with more than the queue carries)."""
    entries = 0
    for stream, group in by_gateway.items():
        encoded = records.encode(group)
        for payload in (encoded,) if len(encoded) <= limit else _fitting(group, encoded, name, limit):
            pipe.xadd(stream, {FIELD: payload}, maxlen=REPLY_MAXLEN, approximate=True)
            pipe.pexpire(stream, ttl_ms)
            entries += 1
    return entries


def _fitting(group: list[InferReply], payload: bytes, name: str, limit: int) -> list[bytes]:
    """The replies' entries at most `limit` bytes each (records.fitting); a reply over it alone is answered
    with an error instead."""
    def alone(reply: InferReply, size: int) -> list[bytes]:
        message = (f"model '{name}' answered with {size} bytes, more than the {limit} that the reply queue "
                   "takes in one message (Redis's proto-max-bulk-len): ask for less in one request")
        log.error("%s (request %s)", message, reply.id)
        return [records.encode([InferReply(reply.id, (), (Code.PAYLOAD_TOO_LARGE, message), reply.queue_us,
                                           reply.compute_us, index=reply.index, final=reply.final)])]

    return records.fitting(group, payload, limit, alone)


def refused(kind: str, name: str, pipe: Batch, results: list[Any], entries: int,
            replies: int) -> list[Command]:
    """What Redis refused of a pipeline that replies_into began with its `entries` (`results`:
    its answers, errors included), logged once for the `kind` ("model") `name`: the commands of the
    reply entries refused, to write again. Each command stands alone: a Redis out of memory (maxmemory)
    refuses the XADD of a reply and takes the XACK after it, so the request is neither answered nor
    redelivered unless written again."""
    error = next((r for r in results if isinstance(r, hiredis.ReplyError)), None)
    if error is None:
        return []
    again = [c for i in range(0, 2 * entries, 2) if isinstance(results[i], hiredis.ReplyError)
             for c in pipe.commands[i:i + 2]]
    log.error("%s %s: Redis refused a command of %d replies' writes: %s%s", kind, name, replies, error,
              "; writing the replies again until their deadline" if again else "")
    return again


async def write_again(out: Resp, commands: list[Command], until: float) -> bool:
    """Write reply entries Redis refused again, every RESEND_S, until it takes them (True) or the wall clock
    passes `until`, their requests' deadline (False: their gateways have answered 504 by then)."""
    while time.time() < until:
        await asyncio.sleep(RESEND_S)
        try:
            await out.execute(commands)
            return True
        except (RedisError, OSError):
            continue
    return False
