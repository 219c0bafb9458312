"""The Redis side of one model version on one worker: its request streams, read through the shared
consumer group, one stream per priority level (highest first), redelivered when a consumer died."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from ..contract.keys import GROUP, Keys
from ..resp import Arg, Command, Resp, fields, packed
from .redelivery import EXECUTING_TTL_S, DeliveryPolicy, Queue, marker, redeliver

log = logging.getLogger("despina.worker")

Entry = tuple[str, bytes, dict[bytes, bytes]]   # (stream, entry id, fields)

# How long a read of empty streams blocks. Each end of a block wakes the worker and Redis for nothing, an
# idle worker's main cost; a stop that cannot end the read at once waits it out (end_read).
READ_BLOCK_MS = 1000     # where it cannot
LONG_BLOCK_MS = 30_000   # where it can: CLIENT UNBLOCK of the reading connection
UNBLOCK_EVERY_S = 0.05   # a read sent just after an UNBLOCK is unblocked again this soon
# Delete a consumer from a stream's group unless it holds pending entries (XGROUP DELCONSUMER would drop
# them from the group's pending list, where nobody could redeliver them). KEYS: stream; ARGV: group, consumer.
LEAVE_IF_DONE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if not ok or #pending > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class ModelStreams:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, version: int, levels: int,
                 consumer: str) -> None:
        self.redis = redis
        self.consumer = consumer
        self.queues = [Queue(keys, model, version, level) for level in range(1, max(levels, 1) + 1)]
        self.streams = [q.stream for q in self.queues]
        self.executing = keys.executing(consumer)
        self._reader: Resp | None = None  # reads block: they get a lean connection of their own
        self._joined = False  # a consumer of the streams' group: made by this consumer's first read or claim

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    async def leave(self) -> None:
        """Take this consumer out of the streams' group once all it read is acknowledged: a consumer
        stays there until deleted, and the control plane deletes only a dead worker's, from the streams
        of what is loaded then. Without this every worker that stopped (scaled in, restarted) and every
        unload would leave one behind for good. Another runner of this worker reading the stream (a
        reload of the same version) has entries pending, or makes itself a consumer again with its next
        read."""
        if not self._joined:
            return
        try:
            for stream in self.streams:
                await self.redis.eval(LEAVE_IF_DONE, 1, stream, GROUP, self.consumer)
        except (RedisError, OSError) as exc:  # left for the control plane, should this worker die
            log.debug("leaving the group of %s failed (%s)", self.streams[0], exc)

    @property
    def _reader_id(self) -> int | None:
        """The reading connection's CLIENT ID where CLIENT UNBLOCK may end its read (connected, allowed)."""
        reader = self._reader
        return reader.client_id if reader is not None and reader.connected else None

    @property
    def block_ms(self) -> int:
        """How long the next read blocks when the streams are empty: LONG_BLOCK_MS where end_read can end
        it at once (the reading connection's id is known), else READ_BLOCK_MS."""
        return READ_BLOCK_MS if self._reader_id is None else LONG_BLOCK_MS

    async def end_read(self, reading: asyncio.Task[None]) -> None:
        """Wait for the task that reads (`reading`) to end, ending its blocked read at once where the
        connection allows: CLIENT UNBLOCK from another connection answers the read as a timeout would, and
        what Redis had delivered to it stays its own to answer. A read sent after an UNBLOCK (the loop had
        not yet seen that it stops) is unblocked again UNBLOCK_EVERY_S later. At most a second more than
        the read's block: then the caller cancels it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.block_ms / 1000 + 1.0
        unblock = True
        while not reading.done() and (left := deadline - loop.time()) > 0:
            client_id = self._reader_id
            if unblock and client_id is not None:
                try:
                    await self.redis.client_unblock(client_id)
                except (RedisError, OSError) as exc:  # waited for as a short block would be, then cancelled
                    log.warning("ending a blocked read of %s failed (%s)", self.streams[0], exc)
                    unblock = False
                    deadline = min(deadline, loop.time() + READ_BLOCK_MS / 1000 + 1.0)
            await asyncio.wait([reading], timeout=min(UNBLOCK_EVERY_S, left))

    async def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` new entries, higher priority levels first; blocks (`block_ms`, None: not at all)
        only when all are empty."""
        try:
            if len(self.streams) == 1:
                return _flatten(await self._xread(self._read_command(count, block_ms)))
            found: list[Entry] = []
            for stream in self.streams:
                found += _flatten(await self._xread(self._command({stream: ">"}, count - len(found), None)))
                if len(found) >= count:
                    return found
            if found:
                return found
            return _flatten(await self._xread(self._command({s: ">" for s in self.streams}, count, block_ms)))
        except ResponseError as exc:
            return await self._vanished(exc)

    @property
    def can_send_with(self) -> bool:
        """Whether a read may go out behind other commands (`send_with`): one priority level, connected."""
        return len(self.streams) == 1 and self._reader is not None and self._reader.connected

    def send_with(self, commands: list[Command], count: int) -> list[asyncio.Future[list[Any]]] | None:
        """`commands`, then the next read (blocking `block_ms`), in one write on the reading connection:
        one wake-up of Redis where two writes would make two. Their futures, or None when that cannot be
        (`can_send_with`, or not connected): then `read` as usual. Read the entries with `sent_read`."""
        if not self.can_send_with:
            return None
        return self._reader.send(commands, [self._read_command(count, self.block_ms)])  # type: ignore[union-attr]

    async def replies(self, fut: asyncio.Future[list[Any]], errors: bool = True) -> list[Any]:
        """The replies to `send_with`'s commands (raises as Resp.execute does)."""
        return await self._reader.replies(fut, errors)  # type: ignore[union-attr]

    async def sent_read(self, fut: asyncio.Future[list[Any]]) -> list[Entry]:
        """The entries of a read sent by `send_with`."""
        try:
            return _flatten((await self._reader.replies(fut, shield=True))[0])  # type: ignore[union-attr]
        except ResponseError as exc:
            return await self._vanished(exc)

    async def _vanished(self, exc: ResponseError) -> list[Entry]:
        if "NOGROUP" not in str(exc):
            raise exc
        log.warning("a request stream or its group vanished (Redis restarted?); recreating")
        await self.ensure_groups()
        return []

    def _read_command(self, count: int, block_ms: int | None) -> Command:
        """The read of the one stream's new entries, packed once and kept: the same few counts come back
        batch after batch."""
        return packed(*self._command({self.streams[0]: ">"}, count, block_ms))

    def _command(self, streams: dict[str, str], count: int, block_ms: int | None) -> Command:
        block: list[Arg] = ["BLOCK", block_ms] if block_ms is not None else []
        return ["XREADGROUP", "GROUP", GROUP, self.consumer, "COUNT", count, *block, "STREAMS", *streams,
                *streams.values()]

    async def _xread(self, command: Command) -> Any:
        self._joined = True
        if self._reader is None:
            self._reader = Resp.like(self.redis, identify=True)
        return (await self._reader.execute([command]))[0]

    async def redeliver(self, queue: Queue, pending: list[dict[str, Any]], policy: DeliveryPolicy) -> int:
        """Redeliver these XPENDING rows of one of its queues, pending past the policy's visibility
        timeout (the worker's sweep, workers/sweep.py): their consumer is taken for dead. Returns how many
        requests."""
        self._joined = True  # the claim makes this consumer one of the group's
        idle_ms = policy.visibility_timeout_ms
        return await redeliver(self.redis, queue, pending, policy, self.consumer, idle_ms)

    async def mark_executing(self, entries: list[tuple[str, bytes]]) -> None:
        """Name the redelivered entries about to run: should this worker die now, only they are charged."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(self.executing, *(marker(stream, entry_id) for stream, entry_id in entries))
        pipe.expire(self.executing, EXECUTING_TTL_S)
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:  # run them anyway: at worst, a death charges the others too
            log.warning("marking redelivered requests as running failed (%s)", exc)

    def unmark_into(self, pipe: Any, entries: list[tuple[str, bytes]]) -> None:
        pipe.srem(self.executing, *(marker(stream, entry_id) for stream, entry_id in entries))

    async def ack(self, entries: list[tuple[str, bytes]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self.ack_into(pipe, entries)
        await pipe.execute()

    @staticmethod
    def ack_into(pipe: Any, entries: list[tuple[str, bytes]]) -> None:
        """Acknowledge and delete: a request stream's length is then its backlog."""
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in entries:
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)


def _flatten(response: Any) -> list[Entry]:
    out: list[Entry] = []
    for stream, entries in response or ():
        name = stream.decode() if isinstance(stream, bytes) else stream
        # an entry deleted while pending comes back with no fields (None)
        out += [(name, entry_id, fields(raw or [])) for entry_id, raw in entries]
    return out
