"""Requests that nobody would answer: those a dead worker had read, those left on an unloaded model.

A dead worker's: they go back on their stream at once, or to the dead letters when their worker died
too often running them (workers/redelivery.py says how).

The workers' sweeps redeliver such entries too, but only after the visibility timeout (a minute by default);
the control plane knows the moment a worker's heartbeat key expires.

An unloaded model's: what is still queued is answered with an error rather than left to time out.
"""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from ..contract import records
from ..contract.catalog import CatalogEntry
from ..contract.errors import Code, DespinaError
from ..contract.keys import FIELD, GROUP, Keys
from ..contract.records import InferReply
from ..workers import stats
from ..workers.answers import error as error_reply
from ..workers.redelivery import DeliveryPolicy, Queue, redeliver

log = logging.getLogger("despina.control")

CLAIMER = "control"
PAGE = 100                # pending entries read per queue and round trip
REDELIVERING = 8          # queues redelivered at once (each takes a connection of the pool meanwhile)


async def requeue_all(redis: aioredis.Redis, queues: list[Queue], consumer: str,
                      policy: DeliveryPolicy) -> int:
    """Redeliver every entry pending for `consumer` on the queues' streams, and forget the consumer there;
    returns how many requests. What is pending is read for all the queues in one round trip, and the
    consumer forgotten in another: only the queues it had read cost more (a worker of 1,000 models had
    read a few of them, and one queue at a time took 2,000 round trips while its requests waited)."""
    pending = await _pending(redis, queues, consumer)
    grouped = [q for q, rows in pending.items() if rows is not None]  # (no such stream or group: None)
    moved = 0
    limit = asyncio.Semaphore(REDELIVERING)

    async def one(queue: Queue, rows: list[dict[str, Any]]) -> int:
        async with limit:
            return await redeliver(redis, queue, rows, policy, CLAIMER)

    while busy := {q: rows for q, rows in pending.items() if rows}:
        done = await asyncio.gather(*(one(q, rows) for q, rows in busy.items()), return_exceptions=True)
        for queue, result in zip(busy, done):
            if isinstance(result, (RedisError, ConnectionError, OSError)):  # that queue's: the others go on
                log.warning("requeueing %s for dead worker %s failed: %s", queue.stream, consumer, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                moved += result
        # a queue past a page has more: read again where nothing failed
        pending = await _pending(redis, [q for q, r in zip(busy, done) if isinstance(r, int)], consumer)
    if grouped:
        pipe = redis.pipeline(transaction=False)
        for queue in grouped:
            pipe.xgroup_delconsumer(queue.stream, GROUP, consumer)
        await pipe.execute(raise_on_error=False)
    return moved


async def requeue_worker(redis: aioredis.Redis, keys: Keys, entries: list[CatalogEntry], worker_id: str,
                         policy: DeliveryPolicy) -> None:
    """Requeue what a dead worker had read on any queue of the catalog's `entries`, and forget what it
    was running."""
    queues = [Queue(keys, e.name, v, level) for e in entries
              for v in e.versions for level in range(1, len(e.streams(keys, v)) + 1)]
    try:
        await requeue_all(redis, queues, worker_id, policy)
    except (RedisError, ConnectionError, OSError) as exc:
        log.warning("requeueing what dead worker %s had read failed: %s", worker_id, exc)
    try:
        await redis.delete(keys.executing(worker_id))
    except (RedisError, OSError):
        pass


async def _pending(redis: aioredis.Redis, queues: list[Queue], consumer: str
                   ) -> dict[Queue, list[dict[str, Any]] | None]:
    """A page of each queue's entries pending for `consumer`, in one round trip; None where the stream or
    its group does not exist (nothing was read there)."""
    pipe = redis.pipeline(transaction=False)
    for queue in queues:
        pipe.xpending_range(queue.stream, GROUP, min="-", max="+", count=PAGE, consumername=consumer)
    rows = await pipe.execute(raise_on_error=False) if queues else []
    return {q: None if isinstance(r, ResponseError) else r for q, r in zip(queues, rows)}


# what the queue's max_queue_size counter (when it has one) no longer holds
DECRBY_IF_EXISTS = "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[1], ARGV[1]) end"


async def refuse_model(redis: aioredis.Redis, keys: Keys, e: CatalogEntry, message: str, reply_ttl_ms: int
                       ) -> None:
    """refuse() every queue of the model (each version, each priority level), logging what each answered."""
    for v in e.versions:
        for level, _ in enumerate(e.streams(keys, v), start=1):
            if count := await refuse(redis, Queue(keys, e.name, v, level), message, reply_ttl_ms):
                log.warning("model %s: %d queued requests answered: %s", e.name, count, message)


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
