"""A Python model's process (Triton's stub, python_stub/stub.py) and the connection to it, from the
worker's side: every call is a request and its answer, with the model's own calls to other models served
meanwhile; a decoupled model's process also sends responses of its own whenever the model does, so one
thread reads all it says (DecoupledStub)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import logs
from ...contract.errors import BackendError, Code, ConfigError, DespinaError
from ..bls import Cancel
from .base import Outputs
from .python_env import Interpreter
from .python_pipe import PatientConnection, dumps
from .python_stub import _despina_wire as wire

if TYPE_CHECKING:
    from ..bls import ModelCaller

log = logging.getLogger("despina.worker")

STUB = Path(__file__).parent / "python_stub" / "stub.py"
STARTUP_TIMEOUT_S = 30.0  # Triton's stub-timeout-seconds: the process must say hello within this
FINALIZE_TIMEOUT_S = 10.0
# a model call's error as a TritonError code; the rest are INTERNAL (1)
TRITON_CODES = {Code.NOT_FOUND: 2, Code.INVALID_ARGUMENT: 3, Code.UNAVAILABLE: 4,
                Code.DEADLINE_EXCEEDED: 4, Code.RESOURCE_EXHAUSTED: 4, Code.CANCELLED: 7}
CALL_MESSAGES = ("bls", "bls_cancel")  # the process's model calls, and their cancellations
NO_CALLS = "model calls are not available here"
CALLER_GONE = "the request that made this call was given up"


class StubDied(Exception):
    """The model's process ended while the worker waited for it."""


class Stub:
    """One model process and the connection to it; every call is a request and its answer."""

    def __init__(self, name: str, *, python: Interpreter | None = None) -> None:
        ours, theirs = Pipe()
        self._reports, reporter = Pipe(duplex=False)  # the model's custom metrics (metrics())
        self._metrics: list[dict[str, Any]] = []
        self.name = name
        python = python or Interpreter(sys.executable)
        self.conn: Connection = PatientConnection(os.dup(ours.fileno()))
        ours.close()
        self._owed = 0  # answers of cancelled calls still to read
        self._writing = threading.Lock()  # a model call's answer may go out while a thread reads
        self._calls: dict[int, Any] = {}  # call id -> the model call running it (a task, or a future)
        self._cancels: dict[int, Cancel] = {}  # call id -> how to cancel it (exec(decoupled=True)'s)
        self._logs_told: dict[str, Any] | None = None  # the log settings the process was last told
        try:
            self.process = subprocess.Popen([python.python, str(STUB), str(theirs.fileno()),
                                             str(reporter.fileno())],
                                            # its environment's hold too: kept from a trim while it runs
                                            pass_fds=(theirs.fileno(), reporter.fileno(), *python.pass_fds()),
                                            stdin=subprocess.DEVNULL, env=python.environ())
        finally:
            theirs.close()
            reporter.close()
        try:  # the stub's first message, once Python and numpy are up: ("hello", pid)
            if self.conn.poll(STARTUP_TIMEOUT_S):
                self.conn.recv()
                return
        except (EOFError, OSError):
            self._abandon()
            code = self.process.returncode
            raise StubDied(f"its process ended while starting (exit code {code})") from None
        self._abandon()
        raise StubDied(f"its process did not start within {STARTUP_TIMEOUT_S:.0f} s")

    @classmethod
    def start(cls, name: str, *args: Any, python: Interpreter | None = None) -> Stub:
        """A started model process; if the first never came up, a second; ConfigError if neither did.
        (A process that never said hello says nothing about the model.)"""
        try:
            return cls(name, *args, python=python)
        except StubDied as exc:
            log.warning("model %s: %s; starting it again", name, exc)
        try:
            return cls(name, *args, python=python)
        except StubDied as exc:
            own = f" (on {python.python}, EXECUTION_ENV_PATH's: it needs numpy)" if python and python.env \
                else ""
            raise ConfigError(f"model '{name}': {exc}{own}") from None

    def _abandon(self) -> None:
        self.process.kill()
        self.wait(5)
        self.conn.close()
        self._reports.close()

    def call(self, op: str, payload: Any, timeout: float | None = None,
             caller: ModelCaller | None = None) -> Any:
        """Send `op` and wait for its answer, on a thread; the model's calls meanwhile go to `caller`."""
        try:
            self._catch_up()
            self._tell_logs()
            self._send((op, payload))
            while True:
                if timeout is not None and not self.conn.poll(timeout):
                    raise StubDied(f"no answer to {op} within {timeout:.0f} s")
                message = self.conn.recv()
                if message[0] not in CALL_MESSAGES:
                    break
                self._serve(message, caller, None)
            status, answer = message
        except (EOFError, OSError) as exc:
            raise StubDied(f"its process ended (exit code {self.wait(5)})") from exc
        return self._answer(op, status, answer)

    async def call_async(self, op: str, payload: Any, caller: ModelCaller | None = None) -> Any:
        """call(), the answer awaited on the event loop (the process works while the loop goes on)."""
        loop = asyncio.get_running_loop()
        try:
            self._catch_up()
            self._tell_logs()
            self._send((op, payload))
            fd = self.conn.fileno()
            while True:
                readable = loop.create_future()
                loop.add_reader(fd, _resolve, readable)
                try:
                    await readable
                except asyncio.CancelledError:
                    self._owed += 1  # its answer will come: the next call reads it first
                    self._give_up_calls()
                    raise
                finally:
                    loop.remove_reader(fd)
                message = self.conn.recv()  # the stub writes a message whole: the rest follows at once
                if message[0] not in CALL_MESSAGES:
                    break
                self._serve(message, caller, loop)
            status, answer = message
        except (EOFError, OSError) as exc:
            raise StubDied(f"its process ended (exit code {self.wait(5)})") from exc
        return self._answer(op, status, answer)

    def _catch_up(self) -> None:
        """Read the answers of calls whose callers went away, so that the next answer is the next call's
        (their model calls meanwhile are refused: nobody waits for what they were for)."""
        while self._owed:
            message = self.conn.recv()
            if message[0] == "bls":
                self._send(("bls", (message[1][0], ("error", (CALLER_GONE, 4)))))
            elif message[0] not in CALL_MESSAGES:
                self._owed -= 1

    def _send(self, message: Any) -> None:
        with self._writing:
            self.conn.send_bytes(dumps(message))

    def _tell_logs(self) -> None:
        """Before a call: the log settings, when they changed since the process last heard them
        (("logging", settings), unanswered). Its pb_utils.Logger follows them, as Triton's does the
        server's: log_verbose shows only at a verbose level of 1 or more; its lines are JSON where the
        worker's are ("json"), and stamped as the log_format says."""
        settings = logs.current()
        if settings is not self._logs_told:
            self._send(("logging", {**settings, "json": logs.json_lines()}))
            self._logs_told = settings

    def _serve(self, message: tuple[str, Any], caller: ModelCaller | None,
               loop: asyncio.AbstractEventLoop | None) -> None:
        """Start a model call the process made: on the worker's event loop (`loop` when this runs on it,
        None from a thread). Or cancel one (("bls_cancel", call id): ResponseIterator.cancel())."""
        kind, request = message
        if kind == "bls_cancel":
            cancel = self._cancels.get(request)
            if cancel is not None:
                cancel.loop.call_soon_threadsafe(cancel.ask)
            return
        if caller is None:
            self._send(("bls", (request[0], ("error", (NO_CALLS, 4)))))
            return
        call_id = request[0]
        coroutine = self._model_call(caller, request)
        running: Any = (loop.create_task(coroutine) if loop is not None
                        else asyncio.run_coroutine_threadsafe(coroutine, caller.loop))
        self._calls[call_id] = running
        running.add_done_callback(lambda _: self._calls.pop(call_id, None))

    def _give_up_calls(self) -> None:
        """The awaited call was cancelled: its model calls are answered now, so that the process finishes
        the execute and the next call can read past its answer without waiting on the event loop."""
        for call_id, running in list(self._calls.items()):
            running.cancel()
            try:
                self._send(("bls", (call_id, ("error", (CALLER_GONE, 4)))))
            except (OSError, ValueError):
                return  # the process is gone
        self._calls.clear()

    async def _model_call(self, caller: ModelCaller, request: tuple[Any, ...]) -> None:
        """Run one model call and send its answer. The answer is written from a thread: the process may be
        writing a call of its own just then, and only the loop, reading, lets that write end. A call made
        with exec(decoupled=True) (its ninth field) gets each response before the last as ("more", answer),
        in order, then the last as any call's answer. The tenth is the request id the called model sees."""
        call_id, model, version, inputs, outputs, timeout_us, parameters, sequence, *more = request
        request_id = str(more[1]) if len(more) > 1 else ""
        sends: asyncio.Queue[Any] | None = None
        partial = cancel = None
        if more and more[0]:
            cancel = self._cancels[call_id] = Cancel()
            queue: asyncio.Queue[Any] = asyncio.Queue()
            sends = queue
            sender = asyncio.create_task(self._send_in_order(queue))

            def partial(part: dict[str, np.ndarray] | DespinaError) -> None:
                queue.put_nowait(("bls", (call_id, ("more", _answer_of(part)))))
        try:
            result = await caller.infer(model, None if version is None or version < 0 else int(version),
                                        wire.unpack_all(inputs), list(outputs), timeout_us / 1e6,
                                        parameters or {}, sequence, partial, request_id=request_id,
                                        cancel=cancel)
        except Exception as exc:  # whatever went wrong, the model must hear of it, not wait forever
            log.exception("model %s: its call of model %s failed", self.name, model)
            result = DespinaError(f"calling model '{model}' failed: {exc}", Code.INTERNAL)
        finally:
            self._cancels.pop(call_id, None)
        message = ("bls", (call_id, _answer_of(result)))
        if sends is not None:  # after the responses before it
            sends.put_nowait(message)
            sends.put_nowait(None)
            await sender
            return
        try:
            await asyncio.to_thread(self._send, message)
        except (OSError, ValueError):  # the process died, or was replaced: nobody waits for this answer
            pass

    async def _send_in_order(self, sends: asyncio.Queue[Any]) -> None:
        while (message := await sends.get()) is not None:
            try:
                await asyncio.to_thread(self._send, message)
            except (OSError, ValueError):  # the process is gone: nobody waits for the rest
                return

    def _answer(self, op: str, status: str, answer: Any) -> Any:
        if status == "error":
            shown = "auto_complete_config" if op == "auto_complete" else op  # (the model's function)
            raise BackendError(f"model '{self.name}': {shown} failed: {answer}")
        return answer

    def metrics(self) -> list[dict[str, Any]]:
        """The model's custom metrics as its process last reported them (python_stub/_despina_metrics.py:
        a family per dict); kept after the process ended. Quick: it reads only what has come."""
        try:
            while self._reports.poll():
                self._metrics = pickle.loads(self._reports.recv_bytes())
        except (EOFError, OSError, pickle.UnpicklingError):
            pass  # the process ended (or this one was stopped)
        return self._metrics

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Ask for finalize, then make sure the process is gone."""
        if self.alive():
            try:
                self.call("finalize", None, FINALIZE_TIMEOUT_S)
            except StubDied as exc:  # it ended, or it is stuck (in an execute, say): waiting more is no use
                log.warning("%s", exc)
                self.process.kill()
            except BackendError as exc:  # finalize raised: the process ends as after any finalize
                log.warning("%s", exc)
        if self.wait(5) is None:
            self.process.kill()
            self.process.wait()
        self.conn.close()
        self._reports.close()


# A decoupled model's word on one of its requests, on the reader's thread: (stream id, the response
# (outputs, or the error), or None for a bare final flag; final). Stream id None: the process ended.
OnResponse = Callable[[int | None, "dict[str, np.ndarray] | DespinaError | None", bool], None]


class DecoupledStub(Stub):
    """A decoupled model's process. It answers its requests whenever it likes, during an execute or long
    after it, so one thread reads all it says: a call's answer goes to the call that waits for it (calls
    are answered in the order they were made), a model call to the event loop, a response to
    `on_response`, and the end of the process to `on_response(None, ...)`."""

    def __init__(self, name: str, on_response: Callable[[Any], None], *, python: Interpreter | None = None
                 ) -> None:
        super().__init__(name, python=python)
        self._on_response = on_response
        self._asked: deque[concurrent.futures.Future[Any]] = deque()
        self._caller: ModelCaller | None = None
        threading.Thread(target=self._read_all, name=f"{name}-responses", daemon=True).start()

    def call(self, op: str, payload: Any, timeout: float | None = None,
             caller: ModelCaller | None = None) -> Any:
        try:
            status, answer = self._ask(op, payload, caller).result(timeout)
        except concurrent.futures.TimeoutError:
            raise StubDied(f"no answer to {op} within {timeout:.0f} s") from None
        return self._answer(op, status, answer)

    async def call_async(self, op: str, payload: Any, caller: ModelCaller | None = None) -> Any:
        status, answer = await asyncio.wrap_future(self._ask(op, payload, caller))
        return self._answer(op, status, answer)

    def _ask(self, op: str, payload: Any, caller: ModelCaller | None) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._caller = caller  # one call at a time: its model calls are served with its caller
        self._asked.append(future)
        try:
            self._tell_logs()
            self._send((op, payload))
        except (OSError, ValueError) as exc:
            self._asked.remove(future)
            raise StubDied(f"its process is gone ({exc})") from None
        return future

    def _read_all(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "response":
                self._on_response(message[1])
            elif message[0] in CALL_MESSAGES:
                self._serve(message, self._caller, None)
            elif self._asked:
                future = self._asked.popleft()
                if future.set_running_or_notify_cancel():  # else its caller went away
                    future.set_result(message)
        ended = StubDied(f"its process ended (exit code {self.process.poll()})")
        while self._asked:
            future = self._asked.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(ended)
        self._on_response(None)


def _answer_of(result: dict[str, np.ndarray] | DespinaError) -> tuple[Any, ...]:
    """A model call's outcome as the process reads it: ("ok", packed outputs), with the called model's
    response parameters after them when it set some, or ("error", (message, TritonError code))."""
    if isinstance(result, DespinaError):
        return ("error", (result.message, TRITON_CODES.get(result.code, 1)))
    if isinstance(result, Outputs) and result.parameters:
        return ("ok", wire.pack_all(result), dict(result.parameters))
    return ("ok", wire.pack_all(result))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
