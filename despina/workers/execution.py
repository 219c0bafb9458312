"""How one model version's batches run: its instances loaded and warmed up, a batch's inputs put
together, the backend called on a free instance (on the event loop when the batch is short, else on the
instance's thread), and the outputs cut into each request's reply. The runner (runner.py) reads the
stream, forms the batches and sends the replies; what happens in between is here."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import clock
from ..contract.errors import Code, ConfigError, DespinaError
from ..contract.instance_groups import resolve
from ..contract.modelspec import ModelSpec
from ..contract.records import InferReply
from . import answers, checksums, instance_update
from .backends import Backend, backend_class
from .backends.base import Instance, text_inputs
from .instance_update import loaded
from .instances import Free
from .instances import plan as plan_instances
from .ragged import BatchIO
from .rate_limiter import RateLimiter, Slot
from .reshape import Reshapes
from .responses import OpenRequests, Send
from .warmup import run as warmup
from .warmup import samples

if TYPE_CHECKING:
    from .bls import ModelCaller
    from .runner import Pending

log = logging.getLogger("despina.worker")

# A batch expected to take less than this runs on the event loop itself: handing it to a thread and
# back costs tens of microseconds of CPU (as much as a small model's batch), and with one instance
# batches run one at a time anyway. The loop (the other models of this worker included) then pauses
# at most about this long, Triton's usual queue delay. Longer batches, and models with several
# instances, run on the instances' threads.
INLINE_BELOW_US = 1000
# A batch run on the loop that took this long was not foreseen by the model's cost so far (a data-dependent
# loop in it, say): the loop, every other model of the worker and its heartbeat (a worker silent for
# DESPINA_WORKER_TTL_S is taken for dead) waited all along. Such a model runs on its thread from then on.
LONG_INLINE_US = 100_000
# the implicit states' outputs of a stateful model's batch kept by its sequence batcher: (requests, rows
# per request, results) -> the results without them
Keep = Callable[[list["Pending"], list[int], list[Any]], list[Any]]
Nulls = Sequence[tuple[int, dict[str, np.ndarray]]]  # (row of a batch, its inputs): SequenceBatcher.nulls


class Execution:
    def __init__(self, spec: ModelSpec, path: Path, version: int, threads: int, caller: ModelCaller | None,
                 send: Send, finish: Send, release: Callable[[], None], limiter: RateLimiter | None = None,
                 more: Callable[[], bool] = lambda: False) -> None:
        """`send` and `finish`: how a decoupled model's responses go out, one before its last and the
        last (responses.py); `release` is called when a batch goes to a thread: the loop is free
        meanwhile. `limiter`: the worker's rate limiter (None: off), which an instance asks for the
        resources its batch takes; `more`: whether the model has requests waiting for an instance."""
        self.spec, self.path, self.version, self.threads = spec, path, version, threads
        self.caller = caller  # how its models call other models (workers/bls.py); None: they cannot
        self._release = release
        self.reshape = Reshapes.of(spec)  # None: the model takes and gives the config's dims
        # a decoupled model's requests between their execute and their final response
        self.streams = OpenRequests(spec.name, self.reshape, send, finish)
        self.batch_io = BatchIO.of(spec)  # None: no ragged inputs, batch inputs or batch outputs
        # the requests' inputs -> one execution's (ragged ones end to end, with their batch inputs)
        self._assemble = self.batch_io.assemble if self.batch_io is not None else _concatenated
        # implicit states' outputs: asked of the model with every batch, kept by the sequence batcher
        self.state_outputs = tuple(st.output for st in spec.sequence.states) if spec.sequence else ()
        self.count = spec.instance_count()
        self.instances: Free[Backend] = Free()  # those free now
        self.backends: list[Backend] = []  # every instance, in order (a sequence runs on one of them)
        self.standby: list[Backend] = []  # passive instances: loaded and warmed up, given no requests
        self.executor = ThreadPoolExecutor(max_workers=self.count, thread_name_prefix=f"{spec.name}-")
        self.row_us: float | None = None  # moving average of a batch's cost per row (µs)
        self.inline = True  # whether a short batch may run on the loop (False once one held it long)
        self.text: frozenset[str] = frozenset()  # BYTES inputs the backend takes as UTF-8 only (from load)
        self.gpus = 0  # GPUs the backend saw as it planned the instances (from load): how KIND_AUTO resolved
        self._retiring: asyncio.Future[None] | None = None  # instances an update removes, as each frees
        self.limiter, self._more = limiter, more
        self.slots: dict[Backend, Slot] = {}  # the instances that need rate limiter resources, their slots
        self._claimed: list[Slot] = []  # every slot this model took in the limiter (given back at unload)

    async def load(self) -> None:
        """Load every instance of the instance groups, then run the warmup samples on each. `count` may
        change: the config's count on every GPU for KIND_GPU without `gpus`, say. Passive instances are
        loaded and warmed up too, and left out of `count`, `instances` and `backends`."""
        cls = backend_class(self.spec.backend)
        self.text = text_inputs(self.spec, cls)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, checksums.verify, self.spec.name, self.path,
                                   self.spec.config)
        self.gpus = gpus = await loop.run_in_executor(self.executor, cls.gpu_count)
        instances = plan_instances(self.spec, gpus, self.threads)
        warmups = samples(self.spec, self.path)
        active = sum(not i.passive for i in instances)
        slots = self._rate_limited(instances, gpus) if self.limiter is not None else {}
        if len(instances) != self.count:
            self.executor.shutdown(wait=False)
            self.executor = ThreadPoolExecutor(max_workers=len(instances),
                                               thread_name_prefix=f"{self.spec.name}-")
        self.count = active
        for instance in instances:
            backend = self._backend(cls, self.spec, instance, loop)
            try:
                await loaded(self.executor, backend)
                if instance.passive:
                    self.standby.append(backend)
                else:
                    self.instances.put_nowait(backend)
                    self.backends.append(backend)
                    if (slot := slots.get(id(instance))) is not None:
                        self.slots[backend] = slot
                await loop.run_in_executor(self.executor, warmup, backend, self.spec, warmups)
            except DespinaError:
                raise
            except Exception as exc:  # a backend bug must fail this model, not the worker
                log.exception("model %s: loading instance %s failed", self.spec.name, instance.name)
                raise ConfigError(f"model '{self.spec.name}': loading failed: {exc}") from None

    def _rate_limited(self, instances: list[Instance], gpus: int, spec: ModelSpec | None = None
                      ) -> dict[int, Slot]:
        """Each active instance's slot in the rate limiter, by id() of its Instance, where it needs resources
        (ConfigError where the limiter can never give them: the slots this call took are given back)."""
        assert self.limiter is not None
        spec = spec or self.spec
        groups = resolve(spec, gpus)
        slots: dict[int, Slot] = {}
        try:
            for instance in (i for i in instances if not i.passive):
                limiter = groups[instance.group].get("rate_limiter") or {}
                slot = self.limiter.add(spec.name, instance.name, limiter, instance.device)
                if slot is not None:
                    self._claimed.append(slot)
                    slots[id(instance)] = slot
        except ConfigError:
            self._unclaim(slots.values())
            raise
        return slots

    def _unclaim(self, slots: Iterable[Slot]) -> None:
        """Give back the slots of instances unloaded (or that never served)."""
        assert self.limiter is not None
        for slot in list(slots):
            self.limiter.remove(slot)
            self._claimed.remove(slot)

    async def _allocate(self, backend: Backend) -> bool:
        """Wait for the resources a batch of `backend` takes, when it needs any (True: it holds them)."""
        slot = self.slots.get(backend)
        if slot is None:
            return False
        assert self.limiter is not None
        await self.limiter.acquire(slot)
        return True

    def _free(self, backend: Backend) -> None:
        assert self.limiter is not None
        self.limiter.release(self.slots[backend], self._more())

    def _backend(self, cls: type[Backend], spec: ModelSpec, instance: Instance,
                 loop: asyncio.AbstractEventLoop) -> Backend:
        backend = cls(spec, self.path / str(self.version), instance)
        backend.caller = self.caller
        if spec.decoupled:  # a Python model (checked at load)
            cast(Any, backend).on_response = self._from_thread(loop)
        return backend

    async def resize(self, spec: ModelSpec, resized: Callable[[int], None]) -> None:
        """Triton's in-place instance update (instance_update.py)."""
        await instance_update.resize(self, spec, resized)

    async def unload(self) -> None:
        if self._retiring is not None:
            await asyncio.shield(self._retiring)
        if self.limiter is not None:
            for slot in self._claimed:
                self.limiter.remove(slot)
        while not self.instances.empty() or self.standby:
            backend = self.instances.get_nowait() if not self.instances.empty() else self.standby.pop()
            await asyncio.get_running_loop().run_in_executor(self.executor, backend.unload)
        self.executor.shutdown(wait=False)

    def _from_thread(self, loop: asyncio.AbstractEventLoop) -> Callable[..., None]:
        """A decoupled model's responses come on a thread: they are handled on the loop (while it runs)."""
        def on_response(*args: Any) -> None:
            try:
                loop.call_soon_threadsafe(self.streams.response, *args)
            except RuntimeError:  # the loop is closed: the worker is gone, and these requests with it
                pass
        return on_response

    async def run_batch(self, live: list[Pending], sizes: list[int], started: float, marks: dict[str, int],
                        instance: int | None = None, keep: Keep | None = None,
                        nulls: Nulls = ()) -> list[InferReply]:
        """Run one batch (on the instance the sequence batcher names, else the first free one); `marks`
        records when its inputs were ready and when the model returned. `keep`: a stateful model's
        sequence batcher, which takes the implicit states' outputs; `nulls`: its rows that no request
        fills (SequenceBatcher.nulls), run with the batch and dropped from its outputs."""
        names = self._output_names(live)
        if self.state_outputs:
            names += [n for n in self.state_outputs if n not in names]
        # a sequence batcher runs one batch at a time per instance: the instance it names is free
        backend = await self.instances.get() if instance is None else self.backends[instance]
        limited = False
        try:
            limited = self.limiter is not None and await self._allocate(backend)
            if backend.per_request:
                return await self._run_requests(backend, live, started, marks, keep, nulls)
            if len(live) > 1 and not self.spec.batched:  # no batch dimension: one request at a time
                marks["input"] = time.perf_counter_ns()
                results = [await self.call(backend, self._assemble([p.inputs]), names, 1) for p in live]
            else:
                arrays = [p.inputs for p in live]
                for row, null in nulls:
                    arrays.insert(row, null)
                inputs = self._assemble(arrays)
                marks["input"] = time.perf_counter_ns()
                results = [await self.call(backend, inputs, names, len(arrays) if nulls else sum(sizes))]
                if nulls:
                    rows = [row for row, _ in nulls]
                    results = [{n: np.delete(a, rows, axis=0) for n, a in results[0].items()}]
            marks["infer"] = time.perf_counter_ns()
        except DespinaError as exc:
            return [answers.error(p.request, exc.code, exc.message, started) for p in live]
        except Exception as exc:  # a backend bug must fail the batch, not the worker
            log.exception("model %s: backend raised", self.spec.name)
            failed = f"model '{self.spec.name}' failed: {exc}"
            return [answers.error(p.request, Code.BACKEND, failed, started) for p in live]
        finally:
            if limited:
                self._free(backend)
            if instance is None:
                self.instances.put_nowait(backend)
        compute_us = int((clock.now() - started) * 1e6)
        if keep is not None:
            results = keep(live, sizes, results)
        if self.batch_io is not None:  # its batch outputs cut by the requests' input shapes
            return answers.scattered(self.spec.name, self.batch_io, [p.request for p in live],
                                     [p.inputs for p in live], sizes, results, started, compute_us)
        if len(results) > 1:
            return [answers.answer(p.request, r, started, compute_us) for p, r in zip(live, results)]
        return answers.split(self.spec.name, [p.request for p in live], sizes, results[0], started,
                             compute_us)

    def _each_request(self, live: list[Pending]) -> tuple[list[dict[str, np.ndarray]], list[list[str]]]:
        """A per-request backend's batch: each request's inputs in the model's shapes, and the outputs it
        asks for (with the implicit states' always)."""
        every = [o.name for o in self.spec.outputs]
        chosen: dict[tuple[str, ...], list[str]] = {(): every}  # requests mostly ask alike: once per choice
        asked = []
        for p in live:
            names = chosen.get(p.request.outputs)
            if names is None:
                wanted = p.request.outputs
                names = chosen[wanted] = [n for n in every if n in wanted]
            asked.append(names)
        if self.state_outputs:
            asked = [a + [n for n in self.state_outputs if n not in a] for a in asked]
        arrays = [p.inputs for p in live]
        if self.reshape is not None:
            arrays = [self.reshape.to_model(a) for a in arrays]
        return arrays, asked

    async def _run_requests(self, backend: Backend, live: list[Pending], started: float,
                            marks: dict[str, int], keep: Keep | None, nulls: Nulls = ()) -> list[InferReply]:
        """A per-request backend: each request keeps its own inputs, and its own error. `marks` as
        run_batch's: the backend stamps them where it can tell (Backend.execute_requests)."""
        arrays, asked = self._each_request(live)
        for row, null in nulls:
            arrays.insert(row, null if self.reshape is None else self.reshape.to_model(null))
            asked.insert(row, asked[0])
        reshape = self.reshape
        marks["input"] = time.perf_counter_ns()
        if backend.awaitable and backend.quick():  # it waits on its model's process: no thread needed
            results = await backend.execute_requests_async(arrays, asked, marks)
        else:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, backend.execute_requests, arrays, asked, marks)
        marks.setdefault("infer", time.perf_counter_ns())
        if nulls and len(results) == len(arrays):
            dropped = {row for row, _ in nulls}
            results = [r for row, r in enumerate(results) if row not in dropped]
        if len(results) != len(live):
            msg = f"model '{self.spec.name}' returned {len(results)} results for {len(live)} requests"
            return [answers.error(p.request, Code.BACKEND, msg, started) for p in live]
        if keep is not None:
            results = keep(live, [1] * len(live), results)
        compute_us = int((clock.now() - started) * 1e6)
        if reshape is not None:
            results = [r if isinstance(r, DespinaError) else _reshaped(reshape, r) for r in results]
        return [answers.error(p.request, r.code, r.message, started) if isinstance(r, DespinaError)
                else answers.answer(p.request, r, started, compute_us) for p, r in zip(live, results)]

    async def run_streams(self, live: list[Pending], started: float, marks: dict[str, int]) -> list[int]:
        """A decoupled model's batch: its requests stay open for the responses the model sends whenever it
        likes (self.streams); the instance is free when execute returns. `marks` as run_batch's. Returns
        the places in `live` of the requests that execute failed (it raised): they count no inference."""
        arrays, asked = self._each_request(live)
        backend: Any = await self.instances.get()
        limited = False
        try:
            limited = self.limiter is not None and await self._allocate(backend)
        except BaseException:
            self.instances.put_nowait(backend)
            raise
        ids = self.streams.open(live, started, backend)
        marks["input"] = time.perf_counter_ns()
        try:
            if backend.quick():
                results = await backend.execute_streams_async(arrays, asked, ids, marks)
            else:
                results = await asyncio.get_running_loop().run_in_executor(
                    self.executor, backend.execute_streams, arrays, asked, ids, marks)
        finally:
            if limited:
                self._free(backend)
            self.instances.put_nowait(backend)
            marks.setdefault("infer", time.perf_counter_ns())
        failed = []
        for i, (stream, result) in enumerate(zip(ids, results)):
            if result is not None:  # execute failed: the requests it did not finish end with its error
                self.streams.response(stream, result, True)
                failed.append(i)
        return failed

    async def call(self, backend: Backend, inputs: dict[str, np.ndarray], names: list[str], rows: int
                   ) -> dict[str, np.ndarray]:
        """Run the backend, inline when the batch is expected to be short (INLINE_BELOW_US). What is timed
        is the backend's call alone: timed around the await, a batch run on a thread would count the
        loop's other work until it resumed this coroutine, the estimate would grow with the load, and
        ever more batches would pay the hand-off to a thread and back (W3 at c=32 with the worker under a
        profiler, which slows the loop: 63 % of `mlp`'s)."""
        if self.reshape is not None:
            inputs = self.reshape.to_model(inputs)
        short = self.row_us is not None and self.row_us * rows < INLINE_BELOW_US
        if short and self.count == 1 and self.inline:
            cpu = time.thread_time()  # (a system call, ~1 µs, once a batch; its end one only for a long one)
            out, took = timed(backend.execute, inputs, names)
            # the loop's own CPU, not the wall clock alone: a batch of a busy host's process that was
            # descheduled a while must not send a fast model to its thread for good
            if took * 1e6 >= LONG_INLINE_US and (time.thread_time() - cpu) * 2e6 >= LONG_INLINE_US:
                self.inline = False
                log.warning("model %s: a batch expected to be short held the worker's loop for %.0f ms; its "
                            "batches run on its thread from now on", self.spec.name, took * 1e3)
        else:
            self._release()  # the loop is free meanwhile: the next batch forms as this one runs
            out, took = await asyncio.get_running_loop().run_in_executor(self.executor, timed,
                                                                         backend.execute, inputs, names)
        row_us = took * 1e6 / max(rows, 1)
        self.row_us = row_us if self.row_us is None else 0.8 * self.row_us + 0.2 * row_us
        return out if self.reshape is None else self.reshape.from_model(out)

    def _output_names(self, live: list[Pending]) -> list[str]:
        every = [o.name for o in self.spec.outputs]
        if any(not p.request.outputs for p in live):
            return every
        wanted = {o for p in live for o in p.request.outputs}
        return [n for n in every if n in wanted]


def _concatenated(requests: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One execution's inputs: the requests' along the batch dimension (one request's as they are)."""
    if len(requests) == 1:
        return requests[0]
    return {n: np.concatenate([r[n] for r in requests]) for n in requests[0]}


def _reshaped(reshape: Reshapes, out: dict[str, np.ndarray]) -> dict[str, np.ndarray] | DespinaError:
    """One request's outputs in the config's dims, or why they cannot be."""
    try:
        return reshape.from_model(out)
    except DespinaError as exc:
        return exc


def timed(execute: Callable[[dict[str, np.ndarray], list[str]], dict[str, np.ndarray]],
           inputs: dict[str, np.ndarray], names: list[str]) -> tuple[dict[str, np.ndarray], float]:
    """execute(inputs, names), and the seconds it took. On the loop's thread, the worker is working as long as
    this runs (workers/lifeline.py)."""
    t0 = time.perf_counter()
    out = execute(inputs, names)
    return out, time.perf_counter() - t0


def durations(marks: dict[str, int], end: int) -> tuple[int, int, int]:
    """(input, infer, output) nanoseconds of one execution: `marks` has its start, and when it has them,
    when its inputs were ready ("input") and when the model returned ("infer")."""
    start = marks["start"]
    ready = marks.get("input", start)
    ran = marks.get("infer", end)
    return ready - start, ran - ready, end - ran
