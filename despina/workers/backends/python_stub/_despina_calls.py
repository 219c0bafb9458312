"""Model calls from inside execute (Triton's business logic scripting), over the stub's connection.

`InferenceRequest.exec()` sends ("bls", (call id, model, version, inputs, asked outputs, timeout µs,
parameters, (correlation ID, flags) or None, decoupled, request id)) and reads the worker's messages
until its own answer comes; answers to other calls read meanwhile are kept for them.
exec(decoupled=True) returns an iterator at once: each response of the called model comes as ("more",
answer) but the last, which is any call's answer; the iterator reads them as it is iterated.
`async_exec()` sends the same and awaits a future that a reader on the stub's event loop resolves, so
that several calls are in flight at once. The worker answers every call, by its deadline at the latest:
a call waits as long as that, and no longer. While a decoupled model's coroutine executes run in the
background (`read_by_stub`), the stub's main thread is the one reader of the connection, and hands each
call its answers (`deliver`).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import pickle
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import _despina_wire as wire
import numpy as np
import triton_python_backend_utils as pb_utils

# ("ok", packed outputs[, response parameters]) or ("error", (message, TritonError code))
Answer = tuple[Any, ...]
HANDOVER_S = 0.05  # how often a call the stub's loop answers looks whether it must read for itself
READ_S = 0.005  # how long a call reading for itself waits for a message, holding the connection


class ModelCalls:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._ids = itertools.count(1)
        self._waiting: set[int] = set()          # exec() calls not yet answered
        self._answers: dict[int, list[Answer]] = {}  # their answers, read by whoever was reading
        self._futures: dict[int, asyncio.Future[Answer]] = {}  # async_exec() calls not yet answered
        self._parts: dict[int, list[Answer]] = {}  # async_exec(decoupled=True): the responses before the last
        self._reading = threading.Lock()         # one reader of the connection at a time
        self._writing = threading.Lock()
        self.read_by_stub = False  # the stub's main thread reads every message: calls wait for deliver()
        self._arrived = threading.Condition()  # an answer for an exec() call came (read_by_stub)
        self.on_cancel: Any = None  # the stub's: a decoupled model's request whose client went away
        self._running = False  # the stub's loop runs an operation, and reads nothing meanwhile (poll())
        self._ending = False  # the operation ended: the loop waits for the connection (threads let it go)
        self._closed = False  # the loop stopped reading (finalized, or the worker is gone): no more answers

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around an operation of the stub's loop: meanwhile the worker sends no other, and poll() may
        read what it does send."""
        self._running = True
        try:
            yield
        finally:
            # threads reading for their calls let go of the connection at their next slice and take it no
            # more (else, taking it back within microseconds, they kept the loop waiting slice after slice)
            self._ending = True
            with self._reading:  # (a poll() reading just then ends first: the loop reads next)
                self._running = False
                self._ending = False

    def close(self) -> None:
        """The stub's loop reads no more: calls still waiting for answers get an error, not a wait forever."""
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()

    def poll(self) -> None:
        """Read what the worker sent while the stub's loop runs an operation, when nobody else reads:
        a decoupled model's request.is_cancelled() asks in the middle of its execute, as Triton's asks
        its server, and sees a cancellation that came meanwhile."""
        if self.read_by_stub or not self._reading.acquire(blocking=False):
            return  # the reader delivers it
        try:
            while self._running and self.conn.poll():
                self._read()
        except (EOFError, OSError):
            pass  # the worker is gone: this process ends soon too
        finally:
            self._reading.release()

    def call(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        call_id = next(self._ids)
        self._waiting.add(call_id)  # before it goes: another reader may get its answer first
        try:
            self._send(call_id, request)
            answer = self._next(call_id)[1]
        finally:
            self.forget(call_id)
        return _response(answer)

    def stream(self, request: pb_utils.InferenceRequest) -> Any:
        """exec(decoupled=True): the called model's responses, read as the iterator is iterated."""
        call_id = next(self._ids)
        self._waiting.add(call_id)
        try:
            self._send(call_id, request, decoupled=True)
        except BaseException:
            self._waiting.discard(call_id)
            raise
        return Responses(self, call_id)

    def forget(self, call_id: int) -> None:
        """The call's answers are no longer wanted: those that come later are dropped."""
        self._waiting.discard(call_id)
        self._answers.pop(call_id, None)

    def _next(self, call_id: int) -> tuple[str, Answer]:
        """The call's next answer: ("more", answer) for a response before the last, else ("last", answer).
        While the stub's loop runs an operation, it reads nothing: the call reads, and hands on what is
        not its own. Otherwise (a decoupled model's thread after its execute returned) the loop reads and
        delivers it."""
        while True:
            with self._arrived:
                answers = self._answers.get(call_id)
                if answers:
                    return answers.pop(0)
                if self._closed:
                    return "last", ("error", ("the model's process no longer reads the worker's answers (it "
                                              "was finalized, or the worker is gone)",
                                              pb_utils.TritonError.UNAVAILABLE))
                if self.read_by_stub or not self._running or self._ending:
                    self._arrived.wait(HANDOVER_S)  # (then looks again: an operation may have begun)
                    continue
            if self._reading.acquire(timeout=HANDOVER_S):
                try:  # read only what has come: the loop waits for this lock when its operation ends
                    if self._running and not self._ending and not self._answers.get(call_id) \
                            and self.conn.poll(READ_S):
                        self._read()
                finally:
                    self._reading.release()

    async def call_async(self, request: pb_utils.InferenceRequest, decoupled: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        future: asyncio.Future[Answer] = loop.create_future()
        self._futures[call_id] = future
        if decoupled:
            self._parts[call_id] = []
        if len(self._futures) == 1 and not self.read_by_stub:
            loop.add_reader(self.conn.fileno(), self._readable)
        try:
            self._send(call_id, request, decoupled)
            answer = await future
        finally:
            del self._futures[call_id]
            parts = self._parts.pop(call_id, [])
            if not self._futures and not self.read_by_stub:
                loop.remove_reader(self.conn.fileno())
        if decoupled:
            return Collected([*map(_response, parts), _response(answer)])
        return _response(answer)

    def _readable(self) -> None:
        if not self._reading.acquire(blocking=False):
            return  # a thread's exec() is reading: it hands the answers on
        try:
            if self._running:  # (else the stub's loop reads, and delivers it)
                self._read()
        except (EOFError, OSError) as exc:  # the worker is gone: this process ends soon too
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(pb_utils.TritonModelException(f"lost the worker: {exc}"))
        finally:
            self._reading.release()

    def _read(self) -> None:
        self.deliver(*self.conn.recv())

    def deliver(self, kind: str, payload: Any) -> None:
        """A message read from the worker, to the call it answers."""
        if kind == "cancel" and self.on_cancel is not None:
            self.on_cancel(payload)
            return
        if kind == "logging":  # the server's log settings, which pb_utils.Logger follows
            pb_utils._log_settings = payload
            return
        if kind != "bls":
            raise pb_utils.TritonModelException(f"unexpected message {kind!r} from the worker in execute")
        call_id, answer = payload
        more = answer[0] == "more"  # a decoupled model's response before its last: ("more", answer)
        future = self._futures.get(call_id)
        if future is not None:
            if more:
                if (parts := self._parts.get(call_id)) is not None:  # (its caller may have just gone)
                    parts.append(answer[1])
            else:
                future.get_loop().call_soon_threadsafe(_settle, future, answer)
        elif call_id in self._waiting:
            with self._arrived:
                answers = self._answers.setdefault(call_id, [])
                answers.append(("more", answer[1]) if more else ("last", answer))
                self._arrived.notify_all()
        # else: a call whose caller went away (a task the model did not await, an iterator let go)

    def _send(self, call_id: int, request: pb_utils.InferenceRequest, decoupled: bool = False) -> None:
        if not request.model_name():
            raise pb_utils.TritonModelException("InferenceRequest needs a model_name to be executed")
        inputs = {t.name(): wire.pack(np.asarray(t.as_numpy())) for t in request.inputs()}
        correlation = request.correlation_id()
        sequence = (correlation, request.flags()) if correlation not in (0, "") else None
        message = ("bls", (call_id, request.model_name(), request.model_version(), inputs,
                           request._requested, request.timeout(),
                           _parameters(request.parameters()), sequence, decoupled, str(request.request_id())))
        self.send(message)

    def send(self, message: Any) -> None:
        """Send a message to the worker, from any thread: one write at a time."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._writing:
            self.conn.send_bytes(data)


class Responses(pb_utils.ResponseIterator):
    """exec(decoupled=True)'s iterator (Triton's ResponseIterator): each response of the called model as
    it comes, the last one included. Let go before the end (or never iterated), it stops keeping what
    comes later."""

    def __init__(self, calls: ModelCalls, call_id: int) -> None:
        self._calls, self._id = calls, call_id
        self._ended = self._cancelled = False

    def cancel(self) -> None:
        """Cancel the call, as Triton's ResponseIterator.cancel() does: the called model's
        request.is_cancelled() turns True (with its next response), and the iteration ends with an error
        response, CANCELLED, in place of what it would still have sent. Nothing once the last came."""
        if not self._ended and not self._cancelled:
            self._cancelled = True
            self._calls.send(("bls_cancel", self._id))

    def __iter__(self) -> Responses:
        return self

    def __next__(self) -> pb_utils.InferenceResponse:
        if self._ended:
            raise StopIteration
        try:
            kind, answer = self._calls._next(self._id)
        except BaseException:
            self._end()
            raise
        if kind != "more":
            self._end()
        return _response(answer)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._calls.forget(self._id)

    def __del__(self) -> None:
        self._end()


class Collected(pb_utils.ResponseIterator):
    """async_exec(decoupled=True)'s iterator: the responses, all come by the time it is returned (so
    cancel() has nothing left to cancel)."""

    def __init__(self, responses: list[pb_utils.InferenceResponse]) -> None:
        self._responses = iter(responses)

    def __iter__(self) -> Collected:
        return self

    def __next__(self) -> pb_utils.InferenceResponse:
        return next(self._responses)

    def cancel(self) -> None:
        pass


def _parameters(raw: str) -> dict[str, Any]:
    parameters = json.loads(raw) if raw else {}
    if not isinstance(parameters, dict):
        raise pb_utils.TritonModelException("request parameters must be a dict")
    for key, value in parameters.items():
        if not isinstance(value, (bool, int, float, str)):
            raise pb_utils.TritonModelException(f"request parameter '{key}' must be a bool, int, float or "
                                                f"str, not {type(value).__name__}")
    return parameters


def _settle(future: asyncio.Future[Answer], answer: Answer) -> None:
    if not future.done():
        future.set_result(answer)


def _response(answer: Answer) -> pb_utils.InferenceResponse:
    status, value, *parameters = answer
    if status == "ok":  # (the called model's response parameters, as Triton's BLS response has them)
        return pb_utils.InferenceResponse([pb_utils.Tensor(n, wire.unpack(a)) for n, a in value.items()],
                                          parameters=parameters[0] if parameters else None)
    message, code = value
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
