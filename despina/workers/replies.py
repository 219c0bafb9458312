"""What a worker writes back to Redis with its answers: the reply entries, the queued counters of priority
levels with a max_queue_size (queued.py), the statistics and the acknowledgements, in one pipeline
(ReplyWriter).
Shared by a model's runner (outbox.py) and an ensemble run in the worker (ensembles.py)."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import clock
from ..contract import records
from ..contract.errors import Code
from ..contract.keys import FIELD, Keys
from ..contract.modelspec import ModelSpec
from ..contract.records import InferReply
from ..counters import Deferred, record_counts
from ..redis_client import BULK_DEFAULT, allow_oom, bulk_limit
from ..resp import Batch, Command, ReadAlong, Resp
from .queued import QUEUE_MOVES, QueueMoves, bounded_levels

if TYPE_CHECKING:
    from .streams import ModelStreams

log = logging.getLogger("despina.worker")

REPLY_MAXLEN = 100_000       # backstop: gateways trim what they have read
RESEND_S = 0.5               # how often reply entries Redis refused are written again


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
    while clock.now() < until:
        await asyncio.sleep(RESEND_S)
        try:
            await out.execute(commands)
            return True
        except (RedisError, OSError):
            continue
    return False


class ReplyWriter:
    """The way out of a model's runner or of an ensemble run in the worker: `build` a pipeline of the
    replies (one entry per gateway), the queued counters, the statistics and the acknowledgements, after
    the replies they follow; then `send` it, the owner's next read riding along where one waits."""

    def __init__(self, kind: str, redis: aioredis.Redis, keys: Keys, spec: ModelSpec, version: int,
                 streams: ModelStreams, ttl_ms: int, deferred: Deferred | None,
                 read_along: ReadAlong) -> None:
        self.kind, self.redis, self.keys, self.spec, self.version = kind, redis, keys, spec, version
        self.name = spec.name
        self.streams, self.ttl_ms, self.deferred, self.read_along = streams, ttl_ms, deferred, read_along
        self.stats_key = keys.stats(spec.name, version)
        # the bounded levels' queued counters (queued.py); None: no level has a max_queue_size
        self.moves = QueueMoves(keys, spec, version, streams.consumer) if bounded_levels(spec) else None
        self.moves_script = QUEUE_MOVES  # as allow_oom makes it for this Redis, at start
        self.bulk = BULK_DEFAULT  # the most bytes of one reply entry: this Redis's, at start (bulk_limit)
        self.out: Resp | None = None  # replies, statistics and acknowledgements go out here

    async def start(self) -> None:
        if self.moves is not None:
            self.moves_script = await allow_oom(self.redis, QUEUE_MOVES)
        self.bulk = await bulk_limit(self.redis)

    def close(self) -> None:
        if self.out is not None:
            self.out.close()

    def resp(self) -> Resp:
        if self.out is None:
            self.out = Resp.like(self.redis)
        return self.out

    def begin(self, by_gateway: dict[str, list[InferReply]]) -> tuple[Batch, int]:
        """A pipeline that begins with the replies' entries (replies_into), and how many."""
        pipe = Batch()
        return pipe, replies_into(pipe, by_gateway, self.ttl_ms, self.name, self.bulk)

    def build(self, pipe: Batch, by_gateway: dict[str, list[InferReply]], counts: dict[str, int],
              acks: list[tuple[str, bytes]], quiet: bool) -> int:
        """Into `pipe`: the replies' entries, then the queued counters' moves waiting (queued.py), the
        statistics `counts` (with a Deferred: every counter waiting goes along when `quiet`, else they wait
        for a later pipeline) and the acknowledgement of the entries `acks`. How many reply entries.
        (Not begin's tuple and call: this runs for every batch.)"""
        entries = replies_into(pipe, by_gateway, self.ttl_ms, self.name, self.bulk)
        if self.moves:
            self.moves.into(pipe, self.moves_script)
        if self.deferred is None:
            record_counts(pipe, self.stats_key, counts)
        else:
            self.deferred.add(self.stats_key, counts)
            if quiet:
                self.deferred.into(pipe)
        if acks:
            self.streams.ack_into(pipe, acks)
        return entries

    async def send(self, pipe: Batch, entries: int, replies: int, room: int) -> list[Command]:
        """Send a pipeline of `replies` that `build` began with `entries` reply entries, with the owner's next
        read (of `room` stream entries) where one waits. The commands of the entries Redis refused, to write
        again (write_again); none when it took them all, or when sending failed: then nothing was
        acknowledged, and the stream entries stay pending for reclaim."""
        out = self.out if self.out is not None else self.resp()
        sent = self.read_along.send(pipe.commands, lambda c: self.streams.send_with(c, room))
        try:
            if sent is None:
                results = await out.execute(pipe.commands, errors=False)
            else:
                results = await self.streams.replies(sent, errors=False)
        except Exception as exc:
            log.error("%s %s: writing %d replies failed: %s; their entries stay pending for reclaim",
                      self.kind, self.name, replies, exc)
            return []
        return refused(self.kind, self.name, pipe, results, entries, replies)

    def refused(self, pipe: Batch, results: list[Any], entries: int, replies: int) -> list[Command]:
        return refused(self.kind, self.name, pipe, results, entries, replies)

    async def write_again(self, commands: list[Command], until: float) -> bool:
        return await write_again(self.resp(), commands, until)
