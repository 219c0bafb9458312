"""One model version on one worker: read its stream, batch, execute, reply, then acknowledge."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from ..contract import records
from ..contract.datatypes import numpy_to_v2, to_bytes
from ..contract.errors import Code, DespinaError
from ..contract.keys import FIELD, GROUP, Keys
from ..contract.modelconfig import ModelSpec
from ..contract.records import InferReply, InferRequest, Tensor
from .backends import Backend, Instance, backend_class
from .batcher import BatchPolicy, DynamicBatcher, Item

log = logging.getLogger("despina.worker")

REPLY_MAXLEN = 100_000       # backstop: gateways trim what they have read
REPLY_TTL_MS = 120_000       # a dead gateway's reply stream expires
RECLAIM_IDLE_MS = 60_000     # a message pending this long belonged to a dead consumer


@dataclass
class Pending:
    """A request inside the batcher, and the stream entry it came in."""

    request: InferRequest
    entry: bytes
    inputs: dict[str, np.ndarray]


class ModelRunner:
    def __init__(self, redis: aioredis.Redis, keys: Keys, spec: ModelSpec, version: int, path: Path,
                 consumer: str, threads: int = 1, read_ahead: int | None = None) -> None:
        self.redis, self.keys, self.spec, self.version = redis, keys, spec, version
        self.path = path
        self.stream = keys.request_stream(spec.name, version)
        self.stats_key = keys.stats(spec.name, version)
        self.consumer = consumer
        self.threads = threads
        count = spec.instance_count()
        self.instances: asyncio.Queue[Backend] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix=f"{spec.name}-")
        self._count = count
        policy = BatchPolicy(spec.max_batch_size, spec.batching.preferred if spec.batching else (),
                             spec.batching.max_queue_delay_us if spec.batching else 0,
                             spec.batching is not None)
        self.batcher = DynamicBatcher(policy, self._execute, count)
        limit = max(spec.max_batch_size, 1) * count * 4
        self._read_ahead = read_ahead or max(limit, 64)
        self._entries: dict[bytes, int] = {}     # stream entry id -> requests not yet answered
        self._in_flight = 0
        self._room = asyncio.Event()
        self._room.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.state = "LOADING"

    # -- lifecycle -------------------------------------------------------------------------------

    async def load(self) -> None:
        cls = backend_class(self.spec.backend)
        kind = "GPU" if cls.gpu_available() and self._wants_gpu() else "CPU"
        version_dir = self.path / str(self.version)
        loop = asyncio.get_running_loop()
        for i in range(self._count):
            backend = cls(self.spec, version_dir, Instance(f"{self.spec.name}_{i}", kind, 0, self.threads))
            await loop.run_in_executor(self._executor, backend.load)
            self.instances.put_nowait(backend)

    def _wants_gpu(self) -> bool:
        kinds = {g.get("kind", "KIND_AUTO") for g in self.spec.config.get("instance_group", [])}
        return bool(kinds & {"KIND_GPU", "KIND_AUTO"}) or not kinds

    async def start(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.state = "READY"
        self._tasks = [asyncio.create_task(self.batcher.run()), asyncio.create_task(self._read_loop()),
                       asyncio.create_task(self._reclaim_loop())]

    async def stop(self) -> None:
        """Stop reading, finish what was read (reply and acknowledge it), then unload."""
        self._stopping = True
        self.state = "UNLOADING"
        reader, reclaimer = self._tasks[1:] if self._tasks else (None, None)
        for task in (reader, reclaimer):
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.batcher.close()
        if self._tasks:
            await asyncio.gather(self._tasks[0], return_exceptions=True)
        while not self.instances.empty():
            backend = self.instances.get_nowait()
            await asyncio.get_running_loop().run_in_executor(self._executor, backend.unload)
        self._executor.shutdown(wait=False)
        self.state = "UNAVAILABLE"

    # -- reading ---------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while not self._stopping:
            await self._room.wait()
            try:
                resp = await self.redis.xreadgroup(
                    GROUP, self.consumer, {self.stream: ">"},
                    count=max(1, (self._read_ahead - self._in_flight) // 4 or 1), block=1000)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # the stream was deleted (e.g. Redis restarted): recreate
                    await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
                    continue
                raise
            except (ConnectionError, OSError) as exc:
                log.warning("model %s: reading its stream failed (%s); retrying", self.spec.name, exc)
                await asyncio.sleep(0.5)
                continue
            for _, entries in resp or ():
                await self._accept(entries)

    async def _reclaim_loop(self) -> None:
        """Claim messages left pending by consumers that died before acknowledging them."""
        while not self._stopping:
            await asyncio.sleep(RECLAIM_IDLE_MS / 4000)
            try:
                result = await self.redis.xautoclaim(self.stream, GROUP, self.consumer,
                                                     RECLAIM_IDLE_MS, "0-0", count=100)
            except (ResponseError, ConnectionError, OSError):
                continue
            entries = [e for e in result[1] if e and e[1]]
            if entries:
                log.warning("model %s: reclaimed %d pending entries", self.spec.name, len(entries))
                await self._accept(entries)

    async def _accept(self, entries: list[Any]) -> None:
        now = time.time()
        failures: list[InferReply] = []
        reply_to: dict[str, str] = {}
        for entry_id, fields in entries:
            try:
                reqs = records.decode_requests(fields[FIELD])
            except (KeyError, DespinaError) as exc:
                log.error("model %s: dropping undecodable entry %s: %s", self.spec.name, entry_id, exc)
                await self._ack([entry_id])
                continue
            self._entries[entry_id] = len(reqs)
            for req in reqs:
                reply_to[req.id] = req.reply_to
                if req.deadline < now:
                    failures.append(_error(req, Code.DEADLINE_EXCEEDED,
                                           "request timed out in the queue before it could run"))
                    self._entries[entry_id] -= 1
                    continue
                try:
                    inputs = {t.name: t.numpy() for t in req.inputs}
                except DespinaError as exc:
                    failures.append(_error(req, exc.code, exc.message))
                    self._entries[entry_id] -= 1
                    continue
                self._in_flight += 1
                pending = Pending(req, entry_id, inputs)
                self.batcher.put(Item(self._rows(inputs), self._shape_key(req), pending))
        if len(self._entries) and self._in_flight >= self._read_ahead:
            self._room.clear()
        if failures:
            await self._reply(failures, reply_to, [])
        done = [e for e, n in self._entries.items() if n == 0]
        if done:
            for e in done:
                del self._entries[e]
            await self._ack(done)

    def _rows(self, inputs: dict[str, np.ndarray]) -> int:
        if not self.spec.batched or not inputs:
            return 1
        return int(next(iter(inputs.values())).shape[0])

    def _shape_key(self, req: InferRequest) -> tuple[Any, ...]:
        return tuple(sorted((t.name, t.datatype, t.shape[1:]) for t in req.inputs))

    # -- executing -------------------------------------------------------------------------------

    async def _execute(self, batch: list[Item]) -> None:
        pendings: list[Pending] = [item.payload for item in batch]
        started = time.time()
        live = [p for p in pendings if p.request.deadline >= started]
        replies = [_error(p.request, Code.DEADLINE_EXCEEDED,
                          "request timed out in the queue before it could run")
                   for p in pendings if p.request.deadline < started]
        if live:
            replies.extend(await self._run_batch(live, started))
        rows = sum(self._rows(p.inputs) for p in live)
        reply_to = {p.request.id: p.request.reply_to for p in pendings}
        await self._reply(replies, reply_to, pendings, rows=rows if live else 0, started=started)

    async def _run_batch(self, live: list[Pending], started: float) -> list[InferReply]:
        names = self._output_names(live)
        if self.spec.batched and len(live) > 1:
            inputs = {n: np.concatenate([p.inputs[n] for p in live]) for n in live[0].inputs}
        else:
            inputs = live[0].inputs if len(live) == 1 else {}
        backend = await self.instances.get()
        try:
            if len(live) > 1 and not self.spec.batched:  # no batch dimension: one request at a time
                results = [await self._call(backend, p.inputs, names) for p in live]
            else:
                results = [await self._call(backend, inputs, names)]
        except DespinaError as exc:
            return [_error(p.request, exc.code, exc.message) for p in live]
        except Exception as exc:  # a backend bug must fail the batch, not the worker
            log.exception("model %s: backend raised", self.spec.name)
            return [_error(p.request, Code.BACKEND, f"model '{self.spec.name}' failed: {exc}") for p in live]
        finally:
            self.instances.put_nowait(backend)
        compute_us = int((time.time() - started) * 1e6)
        if len(results) > 1:
            return [self._answer(p, r, started, compute_us) for p, r in zip(live, results)]
        return self._split(live, results[0], started, compute_us)

    async def _call(self, backend: Backend, inputs: dict[str, np.ndarray], names: list[str]
                    ) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, backend.execute, inputs, names)

    def _output_names(self, live: list[Pending]) -> list[str]:
        every = [o.name for o in self.spec.outputs]
        if any(not p.request.outputs for p in live):
            return every
        wanted = {o for p in live for o in p.request.outputs}
        return [n for n in every if n in wanted]

    def _split(self, live: list[Pending], out: dict[str, np.ndarray], started: float,
               compute_us: int) -> list[InferReply]:
        if len(live) == 1:
            return [self._answer(live[0], out, started, compute_us)]
        sizes = [self._rows(p.inputs) for p in live]
        total = sum(sizes)
        for name, array in out.items():
            if array.ndim == 0 or array.shape[0] != total:
                msg = (f"model '{self.spec.name}' returned {name} with batch dimension "
                       f"{array.shape[0] if array.ndim else 'none'} for a batch of {total}")
                return [_error(p.request, Code.BACKEND, msg) for p in live]
        offsets = np.cumsum([0, *sizes])
        return [self._answer(p, {n: a[offsets[i]:offsets[i + 1]] for n, a in out.items()}, started,
                             compute_us) for i, p in enumerate(live)]

    def _answer(self, p: Pending, out: dict[str, np.ndarray], started: float, compute_us: int) -> InferReply:
        wanted = p.request.outputs or tuple(out)
        tensors = []
        for name in wanted:
            array = out[name]
            datatype = numpy_to_v2(array.dtype)
            tensors.append(Tensor(name, datatype, tuple(array.shape), to_bytes(array, datatype)))
        queue_us = max(0, int((started - p.request.enqueued) * 1e6))
        return InferReply(p.request.id, tuple(tensors), None, queue_us, compute_us)

    # -- replying --------------------------------------------------------------------------------

    async def _reply(self, replies: list[InferReply], reply_to: dict[str, str], pendings: list[Pending],
                     rows: int = 0, started: float = 0.0) -> None:
        by_gateway: dict[str, list[InferReply]] = {}
        for r in replies:
            by_gateway.setdefault(reply_to[r.id], []).append(r)
        pipe = self.redis.pipeline(transaction=False)
        for stream, group in by_gateway.items():
            pipe.xadd(stream, {FIELD: records.encode(group)}, maxlen=REPLY_MAXLEN, approximate=True)
            pipe.pexpire(stream, REPLY_TTL_MS)
        if rows:
            self._count_stats(pipe, replies, rows, started)
        try:
            await pipe.execute()
        except Exception as exc:
            log.error("model %s: writing %d replies failed: %s; they stay pending for reclaim",
                      self.spec.name, len(replies), exc)
            return
        done = []
        for p in pendings:
            self._entries[p.entry] -= 1
            if self._entries[p.entry] == 0:
                del self._entries[p.entry]
                done.append(p.entry)
        self._in_flight -= len(pendings)
        if self._in_flight < self._read_ahead:
            self._room.set()
        if done:
            await self._ack(done)

    def _count_stats(self, pipe: Any, replies: list[InferReply], rows: int, started: float) -> None:
        """Triton's statistics counters for one execution, summed over workers by HINCRBY."""
        ok = [r for r in replies if r.error is None]
        failed = [r for r in replies if r.error is not None]
        key = self.stats_key
        compute_ns = (ok[0].compute_us if ok else 0) * 1000
        pipe.hincrby(key, "inference_count", rows)
        pipe.hincrby(key, "execution_count", 1)
        pipe.hincrby(key, f"batch:{rows}", 1)
        pipe.hincrby(key, f"batch_ns:{rows}", compute_ns)
        if ok:
            queue_ns = sum(r.queue_us for r in ok) * 1000
            pipe.hincrby(key, "success_count", len(ok))
            pipe.hincrby(key, "success_ns", queue_ns + compute_ns * len(ok))
            pipe.hincrby(key, "queue_count", len(ok))
            pipe.hincrby(key, "queue_ns", queue_ns)
            pipe.hincrby(key, "compute_infer_count", len(ok))
            pipe.hincrby(key, "compute_infer_ns", compute_ns * len(ok))
        if failed:
            pipe.hincrby(key, "fail_count", len(failed))
        pipe.hset(key, "last_inference", int(started * 1000))

    async def _ack(self, entry_ids: list[bytes]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.stream, GROUP, *entry_ids)
        pipe.xdel(self.stream, *entry_ids)  # acknowledged work leaves the stream: its length is the backlog
        try:
            await pipe.execute()
        except Exception as exc:
            log.error("model %s: acknowledging failed: %s", self.spec.name, exc)


def _error(req: InferRequest, code: Code, message: str) -> InferReply:
    return InferReply(req.id, (), (code, message))
