"""Requests whose worker died before answering them: back on their stream, or at last dead-lettered.

Two paths find them. The control plane takes every entry pending for a worker the moment that
worker's heartbeat expires (control/backlog.py); each worker's sweep (sweep.py) takes the entries of its
models' streams pending longer than their visibility timeout, whoever read them (a backstop when no
control plane does). Both come here.

Each request of such an entry goes back on the stream as an entry of its own (each client's request of a
grouped one, records.GROUPED, too), which carries in
ATTEMPTS how many of its deliveries ended with the death of the worker. A worker runs a request that
has attempts alone (a batch of one), after naming it in its `executing` set: should it die then, that
request alone is charged, not the others it had read. The entries of a worker that died running
ordinary batches are all charged: any of them may have been the culprit. A request charged
max_attempts times is not run again: it is answered with a BACKEND error, counted as a failure, and
kept on its model version's dead-letter stream (the last DEAD_LETTER_MAXLEN, approximately).

Requests of an entry that the worker had answered before it died run again; the gateway drops the
second answer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from .. import clock
from ..contract import records
from ..contract.errors import Code, DespinaError
from ..contract.keys import ATTEMPTS, FIELD, GROUP, Keys
from ..contract.records import InferReply, InferRequest
from ..settings import Settings
from . import stats

log = logging.getLogger("despina.worker")

DEAD_LETTER_MAXLEN = 1_000
EXECUTING_TTL_S = 3_600  # outlives any heartbeat TTL or visibility timeout; deleted once used
# The queue counter of a priority level exists only where its queue policy sets max_queue_size.
INCRBY_IF_EXISTS = "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('INCRBY', KEYS[1], ARGV[1]) end"


@dataclass(frozen=True)
class DeliveryPolicy:
    visibility_timeout_ms: int = 60_000   # pending this long: its consumer is taken for dead
    max_attempts: int = 3                 # deliveries ended by a worker's death before dead-lettering
    reply_ttl_ms: int = 120_000           # set on every reply stream written: a dead gateway's expires

    @classmethod
    def from_settings(cls, settings: Settings) -> DeliveryPolicy:
        return cls(max(1, int(settings.visibility_timeout_s * 1000)), max(1, settings.max_attempts),
                   max(1, int(settings.reply_ttl_s * 1000)))


@dataclass(frozen=True)
class Queue:
    """One request stream: a model version's priority level."""

    keys: Keys
    model: str
    version: int
    level: int = 1

    @property
    def stream(self) -> str:
        return self.keys.request_stream(self.model, self.version, self.level)


def marker(stream: str, entry_id: bytes | str) -> str:
    """How an entry is named in a worker's `executing` set."""
    return f"{stream}/{entry_id.decode() if isinstance(entry_id, bytes) else entry_id}"


async def redeliver(redis: aioredis.Redis, queue: Queue, pending: list[dict[str, Any]],
                    policy: DeliveryPolicy, claimer: str, min_idle_ms: int = 0) -> int:
    """Redeliver (or dead-letter) these XPENDING rows of the queue's stream; returns how many requests.

    With min_idle_ms, a row that some consumer read again meanwhile is left alone (XCLAIM's check)."""
    stream = queue.stream
    ids = [p["message_id"] for p in pending]
    consumer_of = {p["message_id"]: _text(p["consumer"]) for p in pending}
    claimed: list[Any] = [c for c in await redis.xclaim(stream, GROUP, claimer, min_idle_ms, ids) if c]
    consumers = sorted(set(consumer_of.values()))
    pipe = redis.pipeline(transaction=False)
    for name in consumers:
        pipe.smembers(queue.keys.executing(name))
    running = dict(zip(consumers, await pipe.execute()))
    pipe = redis.pipeline(transaction=True)
    moved, dead = 0, []
    queued = 0  # what the level's queued count gains: started requests back on the stream, less those dropped
    for entry_id, fields in claimed:
        if not fields:  # deleted meanwhile
            continue
        try:  # a grouped request comes back as the clients' requests it held: one may be the culprit
            requests = [one for req in records.decode_requests(fields[FIELD]) for one in records.split(req)]
        except (KeyError, DespinaError) as exc:
            log.error("dropping undecodable entry %s of %s: %s", _text(entry_id), stream, exc)
            continue
        consumer = consumer_of.get(entry_id, "")
        mark = marker(stream, entry_id).encode()
        before = int(fields.get(ATTEMPTS, 0))
        # named: it was running (each redelivered entry is), or its requests' batch had started (each on a
        # level with max_queue_size: workers/queued.py), and they had left their level's queued count
        started = mark in running.get(consumer, ())
        attempts = before + int(before == 0 or started)
        if started:
            pipe.srem(queue.keys.executing(consumer), mark)
        for req in requests:
            if attempts >= policy.max_attempts:
                dead.append(req)
                _dead_letter(pipe, queue, req, attempts, consumer, policy)
                queued -= not started
            else:
                pipe.xadd(stream, {FIELD: records.encode([req]), ATTEMPTS: attempts})
                moved += 1
                queued += started
    if queued:
        pipe.eval(INCRBY_IF_EXISTS, 1, queue.keys.queued(queue.model, queue.version, queue.level), queued)
    if dead:
        stats.record(pipe, queue.keys.stats(queue.model, queue.version),
                     [InferReply(r.id, (), (Code.BACKEND, "")) for r in dead], 0, 0.0)
    done = ids if not min_idle_ms else [entry_id for entry_id, _ in claimed]
    if done:
        pipe.xack(stream, GROUP, *done)
        pipe.xdel(stream, *done)
    await pipe.execute()
    if moved:
        log.warning("requeued %d requests that %s had read on %s (%s)", moved, ", ".join(consumers), stream,
                    "its heartbeat stopped" if not min_idle_ms else f"pending over {min_idle_ms} ms")
    if dead:
        log.error("dead-lettered %d requests on %s: their worker died %d times running them",
                  len(dead), stream, policy.max_attempts)
    return moved + len(dead)


def _dead_letter(pipe: Any, queue: Queue, req: InferRequest, attempts: int, consumer: str,
                 policy: DeliveryPolicy) -> None:
    """Answer the request with an error that says why, and keep it on the dead-letter stream."""
    message = (f"model '{queue.model}': request dead-lettered after {attempts} attempts: the worker died "
               f"each time it ran it (max_attempts {policy.max_attempts}); it is not run again")
    pipe.xadd(req.reply_to, {FIELD: records.encode([InferReply(req.id, (), (Code.BACKEND, message))])})
    pipe.pexpire(req.reply_to, policy.reply_ttl_ms)
    pipe.xadd(queue.keys.dead_letters(queue.model, queue.version),
              {FIELD: records.encode([req]), ATTEMPTS: attempts, b"worker": consumer, b"at": clock.now()},
              maxlen=DEAD_LETTER_MAXLEN, approximate=True)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
