"""Requests that nobody would answer: those a dead worker had read, those left on an unloaded model.

A dead worker's: they go back on their stream at once.

The runners' own XAUTOCLAIM catches such entries too, but only after they idled a minute; the control
plane knows the moment a worker's heartbeat key expires. A requeued entry is appended anew (any live
consumer reads it), then the old one is acknowledged and deleted. Should the worker have answered
before dying, the gateway drops the duplicate reply.

An unloaded model's: what is still queued is answered with an error rather than left to time out.
"""
from __future__ import annotations

import logging
from collections import defaultdict

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from ..contract import records
from ..contract.errors import Code, DespinaError
from ..contract.keys import FIELD, GROUP
from ..contract.records import InferReply

log = logging.getLogger("despina.control")

CLAIMER = "control"


async def requeue(redis: aioredis.Redis, stream: str, consumer: str) -> int:
    """Move every entry pending for `consumer` on `stream` back to the stream's end; returns how many."""
    moved = 0
    while True:
        try:
            pending = await redis.xpending_range(stream, GROUP, min="-", max="+", count=100,
                                                 consumername=consumer)
        except ResponseError:  # no such stream or group: nothing was read there
            return moved
        ids = [p["message_id"] for p in pending]
        if not ids:
            break
        claimed = await redis.xclaim(stream, GROUP, CLAIMER, 0, ids)
        pipe = redis.pipeline(transaction=True)
        for _, fields in claimed:
            if fields:  # an entry deleted meanwhile comes back empty
                pipe.xadd(stream, fields)
        pipe.xack(stream, GROUP, *ids)
        pipe.xdel(stream, *ids)
        await pipe.execute()
        moved += sum(1 for _, fields in claimed if fields)
    try:
        await redis.xgroup_delconsumer(stream, GROUP, consumer)
    except ResponseError:
        pass
    if moved:
        log.warning("requeued %d entries that worker %s had read on %s", moved, consumer, stream)
    return moved


async def refuse(redis: aioredis.Redis, stream: str, message: str) -> int:
    """Answer every request still on `stream` with UNAVAILABLE `message`, and empty it."""
    refused = 0
    while True:
        entries = await redis.xrange(stream, count=500)
        if not entries:
            return refused
        replies: defaultdict[str, list[InferReply]] = defaultdict(list)
        for _, fields in entries:
            try:
                requests = records.decode_requests(fields.get(FIELD, b""))
            except DespinaError:
                continue
            for r in requests:
                replies[r.reply_to].append(InferReply(r.id, (), (Code.UNAVAILABLE, message)))
        pipe = redis.pipeline(transaction=False)
        for reply_to, answers in replies.items():
            pipe.xadd(reply_to, {FIELD: records.encode(answers)})
        pipe.xdel(stream, *(entry_id for entry_id, _ in entries))
        await pipe.execute()
        refused += sum(len(a) for a in replies.values())
