"""Triton's dynamic batching rules, in pure asyncio: no Redis, no HTTP, no model.

Requests are taken in arrival order. A batch stops growing when the next request would exceed
max_batch_size or its non-batch shapes differ. If the batch reached a preferred size it is sent at
the largest preferred size it contains; if it cannot grow it is sent now; otherwise it waits until
the oldest request has waited max_queue_delay, then sends what is there. With a delay of 0, batches
form only while every instance is busy.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 0                 # 0: the model has no batch dimension; never batch
    preferred: tuple[int, ...] = ()         # empty: (max_batch_size,)
    max_queue_delay_us: int = 0
    dynamic: bool = False                   # False: each request runs alone

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError("max_batch_size must be >= 0")
        if any(p <= 0 or p > self.max_batch_size for p in self.preferred):
            raise ValueError("preferred batch sizes must be within 1..max_batch_size")
        if self.max_queue_delay_us < 0:
            raise ValueError("max_queue_delay_us must be >= 0")

    @property
    def batching(self) -> bool:
        return self.dynamic and self.max_batch_size > 0

    @property
    def preferred_sizes(self) -> frozenset[int]:
        return frozenset(self.preferred or (self.max_batch_size,))


@dataclass
class Item:
    """One queued request: `rows` is its batch-dimension size, `shape_key` its non-batch shapes."""

    rows: int
    shape_key: Hashable
    payload: Any
    arrived: float = field(default_factory=time.monotonic)


Execute = Callable[[list[Item]], Awaitable[None]]


class DynamicBatcher:
    """Forms batches from put() items and hands each to `execute`, at most `instances` at a time."""

    def __init__(self, policy: BatchPolicy, execute: Execute, instances: int = 1) -> None:
        if instances < 1:
            raise ValueError("instances must be >= 1")
        self.policy = policy
        self._execute = execute
        self._queue: deque[Item] = deque()
        self._wake = asyncio.Event()
        self._free = asyncio.Semaphore(instances)
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False
        self._preferred = policy.preferred_sizes
        self._max_preferred = max(self._preferred) if policy.batching else 0

    def put(self, item: Item) -> None:
        if self._closed:
            raise RuntimeError("batcher is closed")
        self._queue.append(item)
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    @property
    def executing(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Stop taking items; run() returns once everything queued has been executed."""
        self._closed = True
        self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                await self._free.acquire()
                batch = await self._next_batch()
                if batch is None:
                    self._free.release()
                    break
                task = asyncio.create_task(self._run_one(batch))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
        finally:
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    async def _run_one(self, batch: list[Item]) -> None:
        try:
            await self._execute(batch)
        finally:
            self._free.release()

    async def _next_batch(self) -> list[Item] | None:
        while True:
            if not self._queue:
                if self._closed:
                    return None
                self._wake.clear()
                await self._wake.wait()
                continue
            size, wait = self._plan(time.monotonic())
            if size:
                return [self._queue.popleft() for _ in range(size)]
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass

    def _plan(self, now: float) -> tuple[int, float]:
        """(how many queued items to send now, 0 = none) and how long to wait otherwise."""
        policy = self.policy
        if not policy.batching:
            return 1, 0.0
        first = self._queue[0]
        rows = count = best_preferred = 0
        cannot_grow = False
        for item in self._queue:
            if item.shape_key != first.shape_key or rows + item.rows > policy.max_batch_size:
                cannot_grow = True
                break
            rows += item.rows
            count += 1
            if rows in self._preferred:
                best_preferred = count
            if rows >= self._max_preferred:
                cannot_grow = True
                break
        if count == 0:  # a single item larger than max_batch_size: gateways refuse these, run it alone
            return 1, 0.0
        waited = now - first.arrived
        delay = policy.max_queue_delay_us / 1e6
        delay_exceeded = waited >= delay or self._closed
        if best_preferred and not delay_exceeded:
            return best_preferred, 0.0
        if cannot_grow or delay_exceeded:
            return count, 0.0
        return 0, delay - waited
