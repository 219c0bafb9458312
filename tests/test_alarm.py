"""The batcher's sub-millisecond alarm (a timerfd on the event loop), on asyncio's loop and uvloop."""
from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from despina.alarm import Alarm
from despina.workers.batcher import BatchPolicy, DynamicBatcher, Item

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(make_loop: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, None]) -> None:
    loop = make_loop()
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_fires_at_the_instant_not_before(loop: str) -> None:
    async def main() -> None:
        fired = asyncio.Event()
        alarm = Alarm.create(fired.set)
        assert alarm is not None
        for delay in (0.0003, 0.002):
            fired.clear()
            deadline = time.monotonic() + delay
            alarm.arm(deadline)
            await asyncio.wait_for(fired.wait(), 5)
            assert time.monotonic() >= deadline
        alarm.close()

    run(LOOPS[loop], main())


@pytest.mark.parametrize("loop", LOOPS)
def test_the_same_instant_again_is_one_alarm_and_after_it_fired_a_new_one(loop: str) -> None:
    async def main() -> None:
        fired: list[float] = []
        alarm = Alarm.create(lambda: fired.append(time.monotonic()))
        assert alarm is not None
        calls = 0
        settime = alarm._settime

        def counted(flags: int) -> None:
            nonlocal calls
            calls += 1
            settime(flags)

        alarm._settime = counted  # type: ignore[method-assign]
        when = time.monotonic() + 0.002
        for _ in range(5):  # a batcher planning again and again before its delay ends
            alarm.arm(when)
        assert calls == 1
        await asyncio.sleep(0.05)
        assert len(fired) == 1 and fired[0] >= when
        alarm.arm(when)  # in the past now: armed again, it fires at once
        await asyncio.sleep(0.02)
        assert calls == 2 and len(fired) == 2
        alarm.close()

    run(LOOPS[loop], main())


@pytest.mark.parametrize("loop", LOOPS)
def test_arming_again_moves_it(loop: str) -> None:
    async def main() -> None:
        fired: list[float] = []
        alarm = Alarm.create(lambda: fired.append(time.monotonic()))
        assert alarm is not None
        start = time.monotonic()
        alarm.arm(start + 0.001)
        alarm.arm(start + 0.08)           # moved later: nothing at 1 ms
        await asyncio.sleep(0.04)
        assert fired == []
        await asyncio.sleep(0.1)
        assert len(fired) == 1 and fired[0] >= start + 0.08
        await asyncio.sleep(0.05)
        assert len(fired) == 1            # fired once, quiet since
        alarm.arm(time.monotonic() - 1)   # already past: fires at once
        await asyncio.sleep(0.01)
        assert len(fired) == 2
        alarm.close()

    run(LOOPS[loop], main())


class CountingBatcher(DynamicBatcher):
    plans = 0

    def _plan(self, now: float) -> tuple[int, float]:
        self.plans += 1
        return super()._plan(now)


def test_waiting_out_a_short_delay_does_not_spin_on_uvloop() -> None:
    """uvloop's timers count whole milliseconds: without the alarm, waiting out 500 µs replans on every
    loop iteration until the deadline (hundreds of times); with it, a batch is planned about twice."""
    async def main() -> None:
        batches: list[tuple[float, float]] = []   # (oldest arrival, sent)

        async def execute(batch: list[Item]) -> None:
            batches.append((batch[0].arrived, time.monotonic()))

        batcher = CountingBatcher(BatchPolicy(max_batch_size=8, max_queue_delay_us=500, dynamic=True),
                                  execute)
        task = asyncio.create_task(batcher.run())
        for _ in range(20):
            batcher.put(Item(1, "k", None))
            await asyncio.sleep(0.003)
        batcher.close()
        await asyncio.wait_for(task, 5)
        assert len(batches) == 20
        assert all(sent - arrived >= 0.0005 for arrived, sent in batches)   # each waited its delay
        assert batcher.plans <= 20 * 4, batcher.plans

    run(uvloop.new_event_loop, main())
