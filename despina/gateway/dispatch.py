"""Requests out to the model streams, replies back from this gateway's own reply stream.

Every request that arrives in one event-loop tick goes out in one pipeline, as one stream entry per
model stream. One background task reads the reply stream and resolves the waiting futures by id;
a reply whose request is no longer waited for (a duplicate, or one past its deadline) is dropped.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from collections import defaultdict

import redis.asyncio as aioredis

from ..contract import records
from ..contract.errors import Unavailable
from ..contract.keys import FIELD, Keys
from ..contract.records import InferReply, InferRequest

log = logging.getLogger("despina.gateway")

REPLY_TTL_MS = 120_000


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, keys: Keys, gateway_id: str | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.id = gateway_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.reply_stream = keys.reply_stream(self.id)
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future[InferReply]] = {}
        self._outbox: dict[str, list[InferRequest]] = defaultdict(list)
        self._flush_scheduled = False
        self._reader: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()

    def new_id(self) -> str:
        return f"{next(self._ids):x}"

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_replies())

    async def close(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(Unavailable("the gateway is shutting down"))
        try:
            await self.redis.delete(self.reply_stream)
        except (ConnectionError, OSError):
            pass

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def call(self, stream: str, request: InferRequest, timeout: float) -> InferReply:
        """Queue the request and wait for its reply; TimeoutError after `timeout` seconds."""
        fut: asyncio.Future[InferReply] = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = fut
        self._outbox[stream].append(request)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._waiting.pop(request.id, None)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, defaultdict(list)
        task = asyncio.create_task(self._write(outbox))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, outbox: dict[str, list[InferRequest]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for stream, batch in outbox.items():
            pipe.xadd(stream, {FIELD: records.encode(batch)})
        try:
            await pipe.execute()
        except Exception as exc:
            log.error("gateway %s: queueing %d requests failed: %s", self.id,
                      sum(map(len, outbox.values())), exc)
            error = Unavailable(f"the request queue (Redis) is unavailable: {exc}")
            for batch in outbox.values():
                for req in batch:
                    fut = self._waiting.get(req.id)
                    if fut and not fut.done():
                        fut.set_exception(error)

    async def _read_replies(self) -> None:
        last = "0-0"
        read_since_trim = 0
        while True:
            try:
                resp = await self.redis.xread({self.reply_stream: last}, count=1000, block=1000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("gateway %s: reading replies failed (%s); retrying", self.id, exc)
                await asyncio.sleep(0.2)
                continue
            for _, entries in resp or ():
                for entry_id, fields in entries:
                    last = entry_id
                    self._resolve(fields.get(FIELD, b""))
                read_since_trim += len(entries)
            if read_since_trim >= 1000 or (read_since_trim and not resp):
                read_since_trim = 0
                await self._trim(last)

    def _resolve(self, payload: bytes) -> None:
        try:
            replies = records.decode_replies(payload)
        except Exception as exc:
            log.error("gateway %s: undecodable reply entry: %s", self.id, exc)
            return
        for reply in replies:
            fut = self._waiting.get(reply.id)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _trim(self, last: str | bytes) -> None:
        last_id = last.decode() if isinstance(last, bytes) else last
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xtrim(self.reply_stream, minid=last_id, approximate=False)
            pipe.pexpire(self.reply_stream, REPLY_TTL_MS)
            await pipe.execute()
        except Exception:
            pass
