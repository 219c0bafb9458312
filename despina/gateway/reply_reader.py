"""The gateway's reply stream, read (Dispatcher's part): one background task reads it, blocking, on a
connection of its own, resolves each entry's replies (Dispatcher._resolve), and trims what it read.

While no request waits for an answer, the next read goes out with the next requests (ReadAlong).
Should the connection to Redis break, the requests waiting keep waiting if Redis still holds the gateway's
data (a connection killed, a proxy restarted); if Redis cannot be reached, or lost the data, each is answered
UNAVAILABLE at once. A Redis that loses its data without breaking the connection (FLUSHALL, a failover to a
replica that had none) is noticed within WATCH_S by the gateway's mark (Keys.gateway_mark) gone.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError, RedisError

from ..contract.errors import Unavailable
from ..contract.keys import FIELD
from ..logs import Throttled
from ..resp import ReadAlong, Resp, fields
from . import refusals
from .waiters import Waiters

log = logging.getLogger("despina.gateway")

TRIM_BYTES = 4 << 20  # replies read past which the reply stream is trimmed (else every 1000 read)
WATCH_S = 0.5  # how often the gateway looks for its mark in Redis, and renews it
LOOK_S = 2.0  # how long a look for the mark may take, after the reading connection broke
LOST = ("Redis (the request queue) lost its data (restarted without it, flushed, or failed over to a replica "
        "that had none), and the request with it: its answer may never come")


class ReplyReader(Waiters):
    """The Dispatcher's reading of its reply stream (_read_replies, its background task)."""

    _in: Resp
    _read_along: ReadAlong  # the reader's next read, waiting for the next requests
    _last_reply: str
    _read_failed: Throttled
    _resolve: Callable[[bytes], None]  # the Dispatcher's: an entry's replies to their requests
    _marked: bool  # the gateway's mark was written: found missing now, Redis lost the gateway's data

    def _read_command(self) -> list[str | int]:
        return ["XREAD", "COUNT", 1000, "BLOCK", 1000, "STREAMS", self.reply_stream, self._last_reply]

    async def _read_with_requests(self) -> asyncio.Future[list] | None:
        """While no request waits for an answer, no reply can come before more requests go out: the next
        read then goes out with them (_write), in one write, instead of a round trip to Redis of its own
        (on a shared core, each wakes Redis and hands it the core). The read as sent, or None: read now."""
        if self._waiting or not self._in.connected:
            return None
        return await self._read_along.wait()

    async def _read_replies(self) -> None:
        read_since_trim = bytes_since_trim = 0
        while True:
            try:
                resp = await self._read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._read_failed.log("gateway %s: reading replies failed (%s); retrying", self.id, exc)
                # the answers of those waiting may never come (a Redis that restarted lost them), unless
                # only the connection went and Redis kept the requests
                if not (isinstance(exc, ConnectionError) and await self._still_kept()):
                    self._fail_waiting(refusals.unreachable(
                        "lost the connection to Redis (the request queue) while waiting for the answer", exc))
                await asyncio.sleep(0.2)
                continue
            read, size = self._take(resp)
            resp = None  # let go now, not when the next read returns (which may wait long): large replies
            read_since_trim += read
            bytes_since_trim += size
            # trimmed every 1000 entries or TRIM_BYTES, or when a read finds none: an idle gateway reads only
            # with its next requests (_read_with_requests), and large replies read but kept filled Redis
            if read_since_trim >= 1000 or bytes_since_trim >= TRIM_BYTES or (read_since_trim and not read):
                read_since_trim = bytes_since_trim = 0
                await self._trim(self._last_reply)

    async def _read(self) -> Any:
        """The next read of the reply stream: XREAD's answer."""
        sent = await self._read_with_requests()
        if sent is None:
            return (await self._in.execute([self._read_command()]))[0]
        return (await self._in.replies(sent, shield=True))[0]

    def _take(self, resp: Any) -> tuple[int, int]:
        """Resolve the replies of an XREAD of the reply stream; how many entries it read, and their bytes."""
        read = size = 0
        for _, entries in resp or ():
            for entry_id, raw in entries:
                self._last_reply = entry_id
                payload = fields(raw).get(FIELD, b"")
                size += len(payload)
                self._resolve(payload)
            read += len(entries)
        return read, size

    async def _trim(self, last: str | bytes) -> None:
        """Drop the replies read, up to `last` included (the next read starts after it, entry or not)."""
        ms, _, seq = (last.decode() if isinstance(last, bytes) else last).partition("-")
        try:
            await self._in.execute([["XTRIM", self.reply_stream, "MINID", f"{ms}-{int(seq or 0) + 1}"],
                                    ["PEXPIRE", self.reply_stream, self.reply_ttl_ms]])
        except Exception:
            pass

    async def _watch(self) -> None:
        """Every WATCH_S, whether Redis kept this gateway's data (_kept). A Redis flushed, or failed over to
        a replica without the data, kept the gateway's connections but not the requests it had queued:
        their clients waited out their whole deadlines for answers that could not come."""
        while True:
            try:
                await self._kept()
            except (RedisError, OSError):
                pass  # unreachable (the reply reader says so), or refused: the next look tries again
            await asyncio.sleep(WATCH_S)

    async def _still_kept(self) -> bool:
        """After the reading connection broke: whether Redis answers, and kept this gateway's data."""
        try:
            return await asyncio.wait_for(self._kept(), LOOK_S)
        except (RedisError, OSError):  # (asyncio's TimeoutError is an OSError)
            return False

    async def _kept(self) -> bool:
        """Whether Redis still holds the gateway's mark, renewed; if it lost it, every request waiting is
        answered UNAVAILABLE (they went with it), and the mark is written again."""
        mark = self.keys.gateway_mark(self.id)
        if await self._redis.pexpire(mark, self.reply_ttl_ms):
            self._marked = True
            return True
        lost, self._marked = self._marked, False
        self._marked = bool(await self._redis.set(mark, 1, px=self.reply_ttl_ms))
        if lost:
            log.warning("gateway %s: Redis lost its data (restarted without it, flushed, or failed over to a "
                        "replica that had none): the %d request(s) waiting are answered 503", self.id,
                        self.waiting)
            self._fail_waiting(Unavailable(LOST))
        return not lost
