"""Triton's dynamic batching rules, in pure asyncio: no Redis, no HTTP, no model.

Requests are taken in priority order (level 1 first), arrival order within a level. A batch stops
growing when the next request would exceed max_batch_size or its non-batch shapes differ. Until the
oldest request has waited max_queue_delay (a delay of 0 never runs out), a batch that reached a
preferred size is sent at the largest preferred size it contains, and one that cannot grow is sent
now; otherwise it waits. Once the delay ran out, the batch takes all it can, up to max_batch_size,
and goes. With a delay of 0, batches form only while every instance is busy. A batch
also goes at once when `nothing_coming()` says that no request that could join it is on its way
(the runner knows when every request its gateways have in flight is already queued here): a
wait that nobody can end early would only add its delay to every request's latency.

Queue policy, per priority level: a request past its queue timeout is rejected (REJECT) or moved
behind every request of its level that has not timed out (DELAY), still ahead of the levels below;
a level holding max_queue_size requests refuses more.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..alarm import Alarm
from ..contract.policy import BatchPolicy, QueuePolicy

__all__ = ["BatchPolicy", "DynamicBatcher", "Item", "QueueFull", "QueuePolicy"]


@dataclass(slots=True)
class Item:
    """One queued request: `rows` is its batch-dimension size, `shape_key` its non-batch shapes."""

    rows: int
    shape_key: Hashable
    payload: Any
    arrived: float = field(default_factory=time.monotonic)   # its max_queue_delay counts from here
    priority: int = 0
    timeout_us: int = 0                     # as the request asked; the level's policy decides
    since: float | None = None              # its queue timeout counts from here (default: arrived)
    expires: float | None = None            # set by the batcher


class QueueFull(Exception):
    """The request's priority level already holds max_queue_size requests."""


Execute = Callable[[list[Item]], Awaitable[None]]
Reject = Callable[[Item], None]


class DynamicBatcher:
    """Forms batches from put() items and hands each to `execute`, at most `instances` at a time.

    `reject` receives the items whose queue timeout passed under a REJECT policy; `nothing_coming`,
    when given, is asked before a batch waits for more requests, and True sends it now.
    """

    def __init__(self, policy: BatchPolicy, execute: Execute, instances: int = 1,
                 reject: Reject | None = None, nothing_coming: Callable[[], bool] | None = None) -> None:
        if instances < 1:
            raise ValueError("instances must be >= 1")
        self.policy = policy
        self._execute = execute
        self._reject = reject or (lambda item: None)
        self._nothing_coming = nothing_coming
        levels = max(policy.priority_levels, 1)
        self._queues: list[deque[Item]] = [deque() for _ in range(levels)]
        self._delayed: list[deque[Item]] = [deque() for _ in range(levels)]  # each level's, after it
        self._timed = 0                     # queued items that carry a timeout
        self._pending = 0                   # queued items in all queues (`pending`: asked 5 times a batch)
        self._wake = asyncio.Event()
        self._instances = self._idle = instances
        # each batch handed to `execute` and not yet returned, by its task: what in_hand() names
        self._running: dict[asyncio.Task[None], list[Item]] = {}
        self._closed = False
        self._preferred = policy.preferred_sizes
        self._max_preferred = max(self._preferred) if policy.batching else 0
        self._alarm: Alarm | None = None    # made in run(): it needs the running loop
        # each level's queue policy, looked up once: put() runs for every request
        self._policies = tuple(policy.queue_policy(level) for level in range(1, levels + 1))

    def put(self, item: Item) -> None:
        if self._closed:
            raise RuntimeError("batcher is closed")
        level = self.policy.level(item.priority) if len(self._queues) > 1 else 1
        queue_policy = self._policies[level - 1]
        queue = self._queues[level - 1]
        # its timed-out requests (DELAY) still wait in it: Triton counts them too
        limit = queue_policy.max_queue_size
        if limit and len(queue) + len(self._delayed[level - 1]) >= limit:
            raise QueueFull(f"Exceeds maximum queue size: the queue of priority level {level} is full "
                            f"({queue_policy.max_queue_size} requests)")
        # without a default timeout a request's own is ignored (QueuePolicy.timeout_us): no call for it
        if queue_policy.default_timeout_us and (timeout := queue_policy.timeout_us(item.timeout_us)):
            item.expires = (item.arrived if item.since is None else item.since) + timeout / 1e6
            self._timed += 1
        queue.append(item)
        self._pending += 1
        self._wake.set()

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def executing(self) -> int:
        """Batches handed to `execute` and not yet returned from it (their instance still taken)."""
        return self._instances - self._idle

    def resize(self, instances: int) -> None:
        """Run at most `instances` batches at once from now on (Triton's in-place instance update): with
        fewer, no batch starts until those running are fewer than that."""
        self._idle += instances - self._instances
        self._instances = instances
        self._wake.set()

    def close(self) -> None:
        """Stop taking items; run() returns once everything queued has been executed."""
        self._closed = True
        self._wake.set()

    async def run(self) -> None:
        self._alarm = Alarm.create(self._wake.set)
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = await self._next_batch()
                if batch is None:
                    break
                self._idle -= 1
                task = loop.create_task(self._run_one(batch))  # (asyncio.create_task: two Python calls more)
                self._running[task] = batch
                task.add_done_callback(self._ran)
                # not held here while the next batch forms (which may take long): its requests' inputs
                # stay in memory only as long as its run needs them (_running lets go when it ends)
                del batch
        finally:
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)
            if self._alarm is not None:
                self._alarm.close()

    def _ran(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)

    def in_hand(self) -> Iterator[Item]:
        """Every item queued or in a batch that is executing: what a worker still has to answer."""
        yield from self._ordered()
        for batch in list(self._running.values()):
            yield from batch

    async def _run_one(self, batch: list[Item]) -> None:
        try:
            await self._execute(batch)
        finally:
            self._idle += 1
            self._wake.set()

    async def _next_batch(self) -> list[Item] | None:
        """Wait for a free instance and a batch; apply queue timeouts all the while."""
        while True:
            now = time.monotonic()
            next_timeout = self._expire(now) if self._timed else None
            if not self.pending:
                if self._closed:
                    return None
            elif self._idle > 0:
                size, wait = self._plan(now)
                if size:
                    return self._take(size)
                next_timeout = now + wait if next_timeout is None else min(now + wait, next_timeout)
            self._wake.clear()
            await self._wait(next_timeout, now)

    async def _wait(self, until: float | None, now: float) -> None:
        if until is None:
            await self._wake.wait()
            return
        if self._alarm is not None:  # left armed when a put() wakes us first: a spare wake-up is harmless
            self._alarm.arm(until)
            await self._wake.wait()
            return
        # a timer that sets the event, not wait_for: no task, no cancellation (a third of the cost)
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + max(0.0, until - now), self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()

    def _levels(self) -> Iterator[deque[Item]]:
        """The queues in the order they are served: each level's, then its timed-out requests (DELAY)."""
        for queue, delayed in zip(self._queues, self._delayed):
            yield queue
            yield delayed

    def _ordered(self) -> Iterator[Item]:
        return itertools.chain.from_iterable(self._levels())

    def _take(self, count: int) -> list[Item]:
        taken: list[Item] = []
        for queue in self._levels():
            while queue and len(taken) < count:
                item = queue.popleft()
                if item.expires is not None:  # (a delayed one's is cleared)
                    self._timed -= 1
                taken.append(item)
        self._pending -= len(taken)
        return taken

    def _expire(self, now: float) -> float | None:
        """Apply queue timeouts; return when the next one falls due."""
        nearest: float | None = None
        for level, queue in enumerate(self._queues, start=1):
            if not any(i.expires is not None for i in queue):
                continue
            action = self.policy.queue_policy(level).timeout_action
            keep: deque[Item] = deque()
            for item in queue:
                if item.expires is None:
                    keep.append(item)
                elif item.expires <= now:
                    self._timed -= 1
                    if action == "DELAY":
                        item.expires = None
                        self._delayed[level - 1].append(item)
                    else:
                        self._pending -= 1
                        self._reject(item)
                else:
                    keep.append(item)
                    nearest = item.expires if nearest is None else min(nearest, item.expires)
            queue.clear()
            queue.extend(keep)
        return nearest

    def _plan(self, now: float) -> tuple[int, float]:
        """(how many queued items to send now, 0 = none) and how long to wait otherwise."""
        policy = self.policy
        if not policy.batching:
            return 1, 0.0
        ordered = self._ordered()
        first = next(ordered)
        if first.rows > policy.max_batch_size:  # gateways refuse these; run it alone rather than never
            return 1, 0.0
        oldest = min([first.arrived, *(q[0].arrived for q in self._queues if q)])
        waited = now - oldest
        delay = policy.max_queue_delay_us / 1e6
        # as Triton's: a delay of 0 never runs out, so the preferred sizes still shape each batch; one that
        # ran out lets the batch take all it can, up to max_batch_size
        delay_exceeded = (delay > 0 and waited >= delay) or self._closed
        rows, count = first.rows, 1
        best_preferred = 1 if rows in self._preferred else 0
        cannot_grow = False
        for item in ordered:
            if rows + item.rows > self._max_preferred and not delay_exceeded:
                best_preferred = best_preferred or count  # the batch short of the largest preferred size
                break
            if item.shape_key != first.shape_key or rows + item.rows > policy.max_batch_size:
                cannot_grow = True
                break
            rows += item.rows
            count += 1
            if rows in self._preferred:
                best_preferred = count
        if best_preferred and not delay_exceeded:
            return best_preferred, 0.0
        if cannot_grow or delay_exceeded or not delay or rows >= self._max_preferred \
                or (self._nothing_coming is not None and self._nothing_coming()):
            return count, 0.0
        return 0, delay - waited
