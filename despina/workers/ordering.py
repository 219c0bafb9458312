"""Triton's `dynamic_batching { preserve_ordering: true }`: a model's replies go out in the order its
batches were formed. With several instances a later batch may finish first; its replies then wait for
those of the batch before it. A batch takes its turn when it starts (before any await, so in the
batcher's order) and ends it once its replies went out, or when they never will (its execution failed).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass


@dataclass(slots=True)
class Turn:
    previous: asyncio.Future[None] | None  # the batch before it: its replies sent (None: the first)
    mine: asyncio.Future[None]

    async def send(self, replies: Awaitable[None]) -> None:
        """Send the batch's replies (await `replies`) once the batch before it sent its own."""
        try:
            if self.previous is not None:
                await asyncio.shield(self.previous)
            await replies
        finally:
            self.end()

    def end(self) -> None:
        if not self.mine.done():
            self.mine.set_result(None)


class ReplyOrder:
    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    def take(self) -> Turn:
        turn = Turn(self._last, asyncio.get_running_loop().create_future())
        self._last = turn.mine
        return turn
