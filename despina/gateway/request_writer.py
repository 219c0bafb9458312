"""Requests out to the model streams (Dispatcher's part): every request that arrives in one event-loop
tick goes out in one pipeline, as one stream entry per model stream (grouped where the model batches
them), with the gateway's own counts; a request with a bounded queue goes through BOUNDED_XADD.

Each request is answered as its own command went: should Redis refuse some commands of a pipeline (at its
maxmemory, say), the requests of the entries it refused get its error (refusals.py), and the others wait
for their answers. Should the connection fail, every request of the pipeline is answered UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from hiredis import ReplyError

from ..contract import records
from ..contract.errors import Code, DespinaError
from ..contract.keys import ENTRY_REQUESTS, FIELD, IN_FLIGHT
from ..contract.records import GROUPED, InferRequest
from ..counters import HINCRBY_MANY, Deferred, record_counts
from ..logs import Throttled
from ..redis_client import allow_oom
from ..resp import Batch, Command, ReadAlong, Resp
from . import grouping, refusals
from .waiters import Waiters

# Enqueue unless the priority level already holds max_queue_size requests; a refusal is counted
# as Triton's REJECTED failure. KEYS: stream, queue counter, statistics hash.
BOUNDED_XADD = """
local n = tonumber(redis.call('GET', KEYS[2]) or '0')
if n < 0 then n = 0 redis.call('SET', KEYS[2], 0) end
if n >= tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[3], 'fail_count', 1)
  redis.call('HINCRBY', KEYS[3], 'fail:REJECTED', 1)
  redis.call('HINCRBY', KEYS[3], 'refused', 1)
  return 0
end
redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3], ARGV[4], ARGV[5])
redis.call('INCR', KEYS[2])
redis.call('HINCRBY', KEYS[3], 'enqueued', 1)
return 1
"""

Bound = tuple[str, int]  # (counter key, max_queue_size)


class RequestWriter(Waiters):
    """The Dispatcher's writing of its requests: _flush, once per tick that has any."""

    bulk_limit: int
    _outbox: dict[str, list[InferRequest]]
    _bounded: list[tuple[str, Bound, InferRequest]]
    _stats: dict[str, str]
    _group_rows: dict[str, int]
    _flush_scheduled: bool
    _writing: bool
    _counts: Deferred
    _write_failed: Throttled
    _in: Resp  # the reply reader's (ReplyReader): its next read goes out with the requests
    _read_along: ReadAlong
    _read_command: Callable[[], list[str | int]]

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._writing = True
        task = asyncio.create_task(self._write_all())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_all(self) -> None:
        """One pipeline in flight at a time: what arrives meanwhile goes out together next, so the
        busier the gateway, the more requests share a round trip (idle, none waits for another)."""
        try:
            while self._outbox or self._bounded:
                outbox, self._outbox = self._outbox, defaultdict(list)
                bounded, self._bounded = self._bounded, []
                await self._write(outbox, bounded)
        finally:
            self._writing = False  # no await since the loop's last check: nothing is left behind

    async def _write(self, outbox: dict[str, list[InferRequest]],
                     bounded: list[tuple[str, Bound, InferRequest]]) -> None:
        pipe = Batch()
        plain = 0  # commands before the bounded ones
        for stream, batch in outbox.items():
            in_flight = self._in_flight.get(self._stats[stream], 0)
            limit = self._group_rows[stream]
            entries = grouping.entries(grouping.grouped(batch, limit)) if limit and len(batch) > 1 else \
                [batch[i:i + ENTRY_REQUESTS] for i in range(0, len(batch), ENTRY_REQUESTS)]
            too_large: list[tuple[InferRequest, int]] = []
            for entry in entries:
                encoded = records.encode(entry)
                for payload in (encoded,) if len(encoded) <= self.bulk_limit else \
                        self._fitting(entry, encoded, too_large):
                    pipe.xadd(stream, {FIELD: payload, IN_FLIGHT: in_flight})
                    plain += 1
            for req, size in too_large:
                self._too_large(req, size)
            pipe.hincrby(self._stats[stream], "enqueued", len(batch) - len(too_large))
            plain += 1
        plain += self._counts.into(pipe)  # what the gateway counted itself rides along
        sent_bounded = []
        for stream, (counter, limit), req in bounded:
            payload = records.encode([req])
            if len(payload) > self.bulk_limit:
                self._too_large(req, len(payload))
                continue
            pipe.eval(BOUNDED_XADD, 3, stream, counter, self._stats[stream], limit, FIELD,
                      payload, IN_FLIGHT, self._in_flight.get(self._stats[stream], 0))
            sent_bounded.append((stream, (counter, limit), req))
        sent = self._read_along.send(pipe.commands, lambda c: self._in.send(c, [self._read_command()]))
        try:
            results = await (self._out.execute(pipe.commands, errors=False) if sent is None
                             else self._in.replies(sent, errors=False))
        except Exception as exc:  # every waiting caller must hear of it, whatever it was
            self._write_failed.log("gateway %s: queueing %d requests failed: %s", self.id,
                                   sum(map(len, outbox.values())) + len(bounded), exc)
            error = refusals.unreachable("the request queue (Redis) is unavailable", exc)
            for req in [r for batch in outbox.values() for r in batch] + [b[2] for b in bounded]:
                self._finish(req.id, error)
            return
        if ReplyError in map(type, results):  # Redis refused a command: each request as its own went
            await self._refused(pipe.commands, results, plain, sent_bounded)
            return
        for (_, (_, limit), req), accepted in zip(sent_bounded, results[plain:], strict=True):
            if not accepted:
                self._full(req, limit)

    async def _refused(self, commands: list[Command], results: list[Any], plain: int,
                       bounded: list[tuple[str, Bound, InferRequest]]) -> None:
        """Redis refused some commands of a pipeline (at its maxmemory; a key of another type): a request
        whose entry it refused gets its error, the others wait for their answers as usual, and the
        statistics are put right (refusals.read), as allow_oom lets them be written while Redis is full."""
        refused, fixes = refusals.read(commands[:plain], results)
        for (_, (_, limit), req), accepted in zip(bounded, results[plain:], strict=True):
            if type(accepted) is ReplyError:
                refused.append((req.id, refusals.refusal(accepted)))
            elif not accepted:
                self._full(req, limit)
        for request_id, error in refused:
            self._finish(request_id, error)
        self._write_failed.log("gateway %s: Redis refused %d requests: %s", self.id, len(refused),
                               next(r for r in results if type(r) is ReplyError))
        if not fixes:
            return
        try:
            script = await allow_oom(self._redis, HINCRBY_MANY)
            pipe = Batch()
            for key, counts in fixes.items():
                record_counts(pipe, key.decode(), counts, script)
            await self._out.execute(pipe.commands)
        except Exception as exc:  # statistics only: the requests are answered
            self._write_failed.log("gateway %s: putting the statistics right failed: %s", self.id, exc)

    def _full(self, request: InferRequest, limit: int) -> None:
        self._finish(request.id, DespinaError(f"Exceeds maximum queue size: the queue is full ({limit} "
                                              "requests); retry later", Code.RESOURCE_EXHAUSTED))

    def _fitting(self, entry: list[InferRequest], payload: bytes, too_large: list[tuple[InferRequest, int]]
                 ) -> list[bytes]:
        """The payloads of an entry over bulk_limit as entries that are not (records.fitting): a grouped
        request's members apart too; a request over the limit alone goes on `too_large` with its size."""
        def alone(req: InferRequest, size: int) -> list[bytes]:
            if req.id[:1] == GROUPED:
                members = records.split(req)
                return records.fitting(members, records.encode(members), self.bulk_limit, alone)
            too_large.append((req, size))
            return []

        return records.fitting(entry, payload, self.bulk_limit, alone)

    def _too_large(self, request: InferRequest, size: int) -> None:
        self._finish(request.id, DespinaError(
            f"the request's tensors come to {size} bytes, more than the {self.bulk_limit} that the request "
            "queue takes in one message (Redis's proto-max-bulk-len): send them in smaller requests",
            Code.PAYLOAD_TOO_LARGE))
