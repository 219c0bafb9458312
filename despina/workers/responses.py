"""A decoupled model's requests between their execute and their final response.

Such a model answers each request through a response sender, any number of times and whenever it
likes: each response becomes a reply to the request's gateway at once, numbered from 0, and the final
one ends the request. Which requests are open, and what each response becomes, is kept here; the runner
sends the replies and, with a final one, acknowledges and counts the request. One the model has not
ended by its deadline ends then, DEADLINE_EXCEEDED (the model is told, as of a client gone).
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import clock
from ..contract.errors import Code, DespinaError
from ..contract.records import InferReply
from . import answers
from .reshape import Reshapes

if TYPE_CHECKING:
    from .runner import Pending

Result = dict[str, np.ndarray] | DespinaError | None  # outputs, an error, or None: the final flag alone
Send = Callable[[int, InferReply, "Pending"], None]  # (stream id, reply, its request)
CLIENT_GONE = "the client went away"
NOT_ENDED = "the model sent no final response within the request's timeout"


@dataclass(slots=True)
class Open:
    pending: Pending
    started: float            # wall-clock seconds when its batch started
    backend: Any              # the instance that runs it: it hears of a cancellation
    sent: int = 0             # responses so far: the next one's index
    cancelled: bool = False   # its client went away: what the model still sends goes nowhere
    expiry: asyncio.TimerHandle | None = None  # ends it at its deadline


class OpenRequests:
    def __init__(self, model: str, reshape: Reshapes | None, send: Send, finish: Send) -> None:
        self.model, self.reshape = model, reshape
        self._send, self._finish = send, finish  # a response before the last, and the last
        self._open: dict[int, Open] = {}
        self._ids = itertools.count(1)  # 0 is no request's: warmup samples answer on it

    def __len__(self) -> int:
        return len(self._open)

    def open(self, pending: list[Pending], started: float, backend: Any) -> list[int]:
        """The batch's requests open on `backend`; their stream ids, which the model's responses name."""
        ids = [next(self._ids) for _ in pending]
        loop = asyncio.get_running_loop()
        for stream, p in zip(ids, pending):
            state = self._open[stream] = Open(p, started, backend)
            state.expiry = loop.call_later(max(p.request.deadline - clock.now(), 0), self._expire, stream)
        return ids

    def _expire(self, stream: int) -> None:
        """Its deadline passed before the model's final response: it ends now, what comes later dropped."""
        state = self._open.get(stream)
        if state is None:
            return
        if not state.cancelled:  # (else it ends as CANCELLED: its client went away first)
            state.backend.cancel(stream)  # the model sees is_cancelled(), and may stop
        self.response(stream, DespinaError(f"model '{self.model}': {NOT_ENDED}", Code.DEADLINE_EXCEEDED),
                      True)

    def cancel(self, stream: int) -> None:
        """Its client went away: the model is told (request.is_cancelled()), and its responses but the
        last are dropped; the last one ends the request as CANCELLED."""
        state = self._open.get(stream)
        if state is None or state.cancelled:
            return
        state.cancelled = True
        state.backend.cancel(stream)

    def response(self, stream: int | None, result: Result, final: bool) -> None:
        """A response to request `stream` (ignored once it ended). Stream None: the model's process
        ended, and every request still open with it."""
        if stream is None:
            ended = DespinaError(f"model '{self.model}': its process ended before the final response",
                                 Code.BACKEND)
            for open_stream in list(self._open):
                self.response(open_stream, ended, True)
            return
        state = self._open.get(stream)
        if state is None:
            return  # ended already (a final response, then the error of a failed execute or process)
        p, index = state.pending, state.sent
        state.sent += 1
        if state.cancelled:
            if not final:
                return
            result = DespinaError(f"model '{self.model}': {CLIENT_GONE}", Code.CANCELLED)
        if self.reshape is not None and result is not None and not isinstance(result, DespinaError):
            try:
                result = self.reshape.from_model(result)
            except DespinaError as exc:
                result = exc
        if result is None:  # the final flag alone: the request's time is counted with it, as an answer's
            reply = answers.empty(p.request, state.started, int((clock.now() - state.started) * 1e6))
        elif isinstance(result, DespinaError):
            reply = answers.error(p.request, result.code, result.message)
        else:
            compute_us = int((clock.now() - state.started) * 1e6)
            reply = answers.answer(p.request, result, state.started, compute_us)
        reply.index, reply.final = index, final
        if final:
            del self._open[stream]
            if state.expiry is not None:
                state.expiry.cancel()
            self._finish(stream, reply, p)
        else:
            self._send(stream, reply, p)
