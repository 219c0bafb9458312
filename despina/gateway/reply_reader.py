"""The gateway's reply stream, read (Dispatcher's part): one background task reads it, blocking, on a
connection of its own, resolves each entry's replies (Dispatcher._resolve), and trims what it read.

While no request waits for an answer, the next read goes out with the next requests (ReadAlong).
Should the connection to Redis break, the requests waiting keep waiting if Redis answers again at once (a
connection killed, a proxy restarted); if it cannot be reached, each is answered UNAVAILABLE at once. A Redis
that lost its data (restarted without it, FLUSHALL, a failover to a replica that had none) is noticed within
WATCH_S by the gateway's mark (Keys.gateway_mark) gone: the requests then waiting that are not answered
within GRACE_S are answered UNAVAILABLE, but for those a worker says it still has in hand (an IN_HAND entry,
workers/in_hand.py), which wait for their answers to their own deadlines. The gateway tells the workers at
once (DATA_LOST_EVENT), so that one slower to find its own mark gone still speaks within GRACE_S. Each outage
is logged as a pair: unreachable, then reachable again; lost its data, then has it again (the catalog
published again).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from ..contract import records
from ..contract.errors import DespinaError, Unavailable
from ..contract.keys import DATA_LOST_EVENT, FIELD, IN_HAND
from ..logs import Throttled
from ..resp import ReadAlong, Resp, fields
from . import refusals
from .waiters import Waiters

log = logging.getLogger("despina.gateway")

TRIM_BYTES = 4 << 20  # replies read past which the reply stream is trimmed (else every 1000 read)
WATCH_S = 1.0  # how often the gateway looks for its mark in Redis, and renews it
GRACE_S = 1.0  # after Redis lost its data, how long the requests waiting may still be answered
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
    _held: set[str]  # requests waiting that a worker said, after Redis lost its data, it still holds
    _lost_at: float | None  # when Redis was found to have lost its data, until the catalog is back

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
                if not (isinstance(exc, ConnectionError) and await self._answers()):
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
                entry = fields(raw)
                payload = entry.get(FIELD)
                if payload is None:  # a worker's word after Redis lost its data (or nothing at all)
                    self._keep_in_hand(entry.get(IN_HAND, b""))
                    continue
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
        """Every WATCH_S, whether Redis kept this gateway's data (_look). A Redis flushed, or failed over to
        a replica without the data, kept the gateway's connections but not the requests it had queued:
        their clients waited out their whole deadlines for answers that could not come. Also where an outage
        is logged, with its end, once each: it runs whether or not requests come (the reply reader, idle, does
        not read)."""
        unreachable = Throttled(log)
        while True:
            try:
                await self._look()
                if unreachable.since is not None:
                    unreachable.recovered("gateway %s: Redis is reachable again", self.id)
            except (ConnectionError, RedisTimeout, OSError) as exc:
                unreachable.log("gateway %s: Redis is unreachable (%s)", self.id, exc)
            except RedisError:
                pass  # refused (an ACL, a full Redis): the next look tries again
            await asyncio.sleep(WATCH_S)

    async def _answers(self) -> bool:
        """After the reading connection broke: whether Redis answers (a look at the mark, _look)."""
        try:
            await asyncio.wait_for(self._look(), LOOK_S)
            return True
        except (RedisError, OSError):  # (asyncio's TimeoutError is an OSError)
            return False

    async def _look(self) -> None:
        """Renew the gateway's mark in Redis. Found missing, Redis lost its data: the reply stream is read
        from its start again (a new one, whose ids may start below the last read: a replica's clock), the
        workers are told (DATA_LOST_EVENT), and the requests waiting that no answer reaches within GRACE_S
        are answered UNAVAILABLE, but those a worker says it still holds (_keep_in_hand)."""
        mark = self.keys.gateway_mark(self.id)
        if await self._redis.pexpire(mark, self.reply_ttl_ms):
            self._marked = True
            if self._lost_at is not None:
                await self._look_for_catalog()
            return
        lost, self._marked = self._marked, False
        self._marked = bool(await self._redis.set(mark, 1, px=self.reply_ttl_ms))
        if lost:
            self._last_reply = "0-0"
            self._lost_at = time.monotonic()
            log.warning("gateway %s: Redis lost its data (restarted without it, flushed, or failed over to a "
                        "replica that had none): %d request(s) waiting, answered 503 unless answered within "
                        "%g s or still held by a worker", self.id, self.waiting, GRACE_S)
            asyncio.get_running_loop().call_later(GRACE_S, self._give_up_lost, list(self._waiting))
            await self._redis.publish(self.keys.events, DATA_LOST_EVENT)

    async def _look_for_catalog(self) -> None:
        """After Redis lost its data: once the control plane has published the catalog again, say so."""
        if await self._redis.exists(self.keys.catalog_published):
            assert self._lost_at is not None
            log.warning("gateway %s: Redis has its data again: the catalog is published again, %.1f s after "
                        "the loss was found", self.id, time.monotonic() - self._lost_at)
            self._lost_at = None

    def _keep_in_hand(self, payload: bytes) -> None:
        """A worker's word, after Redis lost its data, that it still holds these requests (in_hand.py):
        they wait for their answers, to their own deadlines, instead of being given up (_give_up_lost).
        Only requests waiting now are kept (a word read again, or too late, names others)."""
        try:
            named = records.decode_ids(payload)
            ids = [one for rid in named  # a grouped request's members wait each under its own id
                   for one in ([m for m, _ in records.members(rid)] if rid[:1] == records.GROUPED else [rid])]
        except DespinaError as exc:
            log.error("gateway %s: undecodable entry on its reply stream: %s", self.id, exc)
            return
        waiting = self._waiting
        self._held = {i for i in self._held if i in waiting}
        self._held.update(i for i in ids if i in waiting)

    def _give_up_lost(self, request_ids: list[str]) -> None:
        held, self._held = self._held, set()
        kept = 0
        for request_id in request_ids:
            if request_id in held:
                kept += 1
                continue
            self._finish(request_id, Unavailable(LOST))
        if kept:
            log.warning("gateway %s: %d request(s) a worker still holds keep waiting for their answers",
                        self.id, kept)
