"""The pool of a model's free instances (instances.Free): first put, first taken; a batch that finds none
free waits its turn, and one cancelled while it waits neither loses an instance nor keeps the next waiting."""
from __future__ import annotations

import asyncio

import pytest

from despina.workers.instances import Free


async def test_instances_are_taken_in_the_order_they_were_freed() -> None:
    free: Free[str] = Free()
    assert free.empty()
    for name in ("a", "b"):
        free.put_nowait(name)
    assert not free.empty()
    assert await free.get() == "a"
    assert free.get_nowait() == "b"
    assert free.empty()
    with pytest.raises(IndexError):
        free.get_nowait()


async def test_waiting_batches_get_instances_in_the_order_they_asked() -> None:
    free: Free[str] = Free()
    got: list[tuple[int, str]] = []

    async def batch(n: int) -> None:
        got.append((n, await free.get()))

    tasks = [asyncio.create_task(batch(n)) for n in range(3)]
    await asyncio.sleep(0)
    assert got == []  # none free: all three wait
    for name in ("x", "y", "z"):
        free.put_nowait(name)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert got == [(0, "x"), (1, "y"), (2, "z")]
    assert free.empty()


async def test_a_waiter_cancelled_after_it_was_woken_hands_the_instance_to_the_next() -> None:
    free: Free[str] = Free()
    first = asyncio.create_task(free.get())
    second = asyncio.create_task(free.get())
    await asyncio.sleep(0)
    free.put_nowait("only")  # wakes the first, which is cancelled before it runs
    first.cancel()
    assert await asyncio.wait_for(second, 1) == "only"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert free.empty()


async def test_a_waiter_cancelled_before_any_instance_came_leaves_no_trace() -> None:
    free: Free[str] = Free()
    gone = asyncio.create_task(free.get())
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    free.put_nowait("back")
    assert await asyncio.wait_for(free.get(), 1) == "back"
