"""Requests that nobody would answer: those a dead worker had read, those left on an unloaded model.

A dead worker's: they go back on their stream at once, or to the dead letters when their worker died
too often running them (workers/redelivery.py says how).

The runners redeliver such entries too, but only after the visibility timeout (a minute by default);
the control plane knows the moment a worker's heartbeat key expires.

An unloaded model's: what is still queued is answered with an error rather than left to time out.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from ..contract import records
from ..contract.errors import Code, DespinaError
from ..contract.keys import FIELD, GROUP
from ..contract.records import InferReply
from ..workers import stats
from ..workers.answers import error as error_reply
from ..workers.redelivery import DeliveryPolicy, Queue, redeliver

log = logging.getLogger("despina.control")

CLAIMER = "control"


async def requeue(redis: aioredis.Redis, queue: Queue, consumer: str, policy: DeliveryPolicy) -> int:
    """Redeliver every entry pending for `consumer` on the queue's stream; returns how many requests."""
    moved = 0
    while True:
        try:
            pending = await redis.xpending_range(queue.stream, GROUP, min="-", max="+", count=100,
                                                 consumername=consumer)
        except ResponseError:  # no such stream or group: nothing was read there
            return moved
        if not pending:
            break
        moved += await redeliver(redis, queue, pending, policy, CLAIMER)
    try:
        await redis.xgroup_delconsumer(queue.stream, GROUP, consumer)
    except ResponseError:
        pass
    return moved


# what the queue's max_queue_size counter (when it has one) no longer holds
DECRBY_IF_EXISTS = "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[1], ARGV[1]) end"


async def refuse(redis: aioredis.Redis, queue: Queue, message: str, reply_ttl_ms: int) -> int:
    """Answer every request still on the queue's stream with UNAVAILABLE `message`, and empty it. The
    answers count as failures and leave the queue's count, as a worker's answers do: else the metrics
    would show them pending, and a reload's max_queue_size would hold them, for good. A reply stream
    written expires as a worker's writes make it (a dead gateway's is read by nobody)."""
    stream, refused = queue.stream, 0
    while True:
        # XRANGE's entries all have an id and fields (only XCLAIM's deleted ones have none)
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(stream, count=500))
        if not entries:
            return refused
        replies: defaultdict[str, list[InferReply]] = defaultdict(list)
        for _, fields in entries:
            try:
                requests = records.decode_requests(fields.get(FIELD, b""))
            except DespinaError:
                continue
            for r in requests:
                replies[r.reply_to].append(error_reply(r, Code.UNAVAILABLE, message))  # its wait: fail.ns
        pipe = redis.pipeline(transaction=False)
        for reply_to, answers in replies.items():
            pipe.xadd(reply_to, {FIELD: records.encode(answers)})
            pipe.pexpire(reply_to, reply_ttl_ms)
        pipe.xdel(stream, *(entry_id for entry_id, _ in entries))
        answered = [a for answers in replies.values() for a in answers]
        if answered:
            stats.record(pipe, queue.keys.stats(queue.model, queue.version), answered, 0, 0.0)
            pipe.eval(DECRBY_IF_EXISTS, 1, queue.keys.queued(queue.model, queue.version, queue.level),
                      len(answered))
        await pipe.execute()
        refused += len(answered)
