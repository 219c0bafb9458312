"""uvicorn's server without its tenth-of-a-second tick.

uvicorn's main loop wakes ten times a second to see whether it should stop and, once a second, to
renew the Date header. An idle gateway or control plane then spends most of its wake-ups on that
loop: a platform that scales models to zero still runs both, and on a shared core every wake-up
costs. Here the loop sleeps until it is told to stop (a signal, or the role setting `should_exit`),
and wakes once a second only where a Date header is sent.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

DATE_S = 1.0  # how often the Date header is renewed, as uvicorn does
LAST_WORD_S = 1.0  # how long before its drain's end a server gives up on what is still waiting (at most)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, give_up: Callable[[], None] | None = None,
                 stopping: Callable[[], None] | None = None,
                 started: Callable[[], None] | None = None) -> None:
        """`give_up` answers what still waits, shortly before the drain's time (the config's
        timeout_graceful_shutdown) is spent: the supervisor kills the process then, and a client whose
        connection is cut gets no status to retry on. `stopping` is called on each stop signal, `started`
        once the server serves (its app's lifespan started)."""
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._give_up = give_up
        self._stopping = stopping
        self._started = started
        self.exit_code = 0  # what the role exits with once served (leave)
        super().__init__(config)

    def leave(self, code: int) -> None:
        """Stop as a stop signal does, with the same drain, and have the role exit with `code` after (the
        role reads exit_code): uvicorn raises a signal it caught again once drained, and a process that
        SIGTERM ended cannot say why it stopped (embedded.START_FAILED)."""
        self.exit_code = code
        if self._stopping is not None:
            self._stopping()
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._stopping is not None:
            self._stopping()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        budget = self.config.timeout_graceful_shutdown
        handle = None
        if self._give_up is not None and budget is not None:
            ahead = min(LAST_WORD_S, budget / 4)
            handle = asyncio.get_running_loop().call_later(max(budget - ahead, 0.0), self._give_up)
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()

    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        # set from a signal handler, or from the loop's own code: either way the loop wakes through
        # call_soon_threadsafe, which only queues the call and writes to the loop's wake-up pipe
        self._should_exit = value
        if value and self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing waits any more
                self._loop.call_soon_threadsafe(self._stop.set)

    async def main_loop(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._started is not None:  # (uvicorn runs the main loop only after a start that succeeded)
            self._started()
        every = DATE_S if self.config.date_header else None
        # on_tick renews the headers when its counter is a multiple of 10 (uvicorn's tenths of a second)
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864_000
            if self._should_exit:  # set between the tick and this wait's start
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), every)


class _InLoopServer(Server):
    """uvicorn inside a loop that already handles signals: the role stops it, not a signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def serve_in_loop(app: ASGIApp, sock: socket.socket, stop: asyncio.Event) -> None:
    """Serve a role's side port (the control plane's metrics, a worker's health) on `sock` until `stop`."""
    config = uvicorn.Config(app, lifespan="on", access_log=False, log_config=None, log_level="warning")
    server = _InLoopServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await stop.wait()
    server.should_exit = True
    await task
