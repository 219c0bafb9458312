"""The process a Python model runs in (Triton's "stub"): `python stub.py <fd> <metrics fd>`.

It says ("hello", pid) on the connection on <fd> once it is up, then answers its worker one message at a
time: ("auto_complete", ...), ("initialize", ...), ("execute", requests), ("finalize", None); before one
of them, when they changed, come the server's log settings ("logging", settings: pb_utils.Logger follows
them), unanswered. Inside execute the model may call other models (_despina_calls.py): those messages go
both ways until the execute's answer. A decoupled model answers through each request's response sender
instead, from any thread and whenever it likes: ("response", (stream id, answer or None, final)); its
`async def execute`, as in Triton, runs on an event loop of its own thread while the next requests come.
Any other model may answer a request through its sender too, once: that answer takes its place in
execute's (_despina_senders.py). Whatever the model does, the worst it can do is end this process; the
worker then fails the requests in flight and starts another. The stub also ends when its worker does
(the connection closes, or the parent changes).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import importlib
import inspect
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Collection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import _despina_wire as wire  # this folder is first on sys.path: a name no model's module would have
import numpy as np
import triton_python_backend_utils as pb_utils
from _despina_calls import ModelCalls
from _despina_metrics import start_reporting
from _despina_senders import CLOSED, NO_RESPONSE, UNSUPPORTED_FLAG, DefaultSenders, wrong_return

PARENT_CHECK_S = 1.0
HERE = Path(__file__).resolve().parent  # the stub's and pb_utils' folder
OPERATIONS = ("auto_complete", "initialize", "execute", "finalize")
RETURNED = "a decoupled model's execute must return None: it answers through each request's response sender"


def main() -> None:
    sys.dont_write_bytecode = True  # leave the model repository as it was: no __pycache__ in it
    conn = Connection(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when this process stops
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: the model's stacks to the log
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    start_reporting(int(sys.argv[2]))  # the model's custom metrics, on a pipe of their own
    stub = Stub(ModelCalls(conn))
    conn.send(("hello", os.getpid()))
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):
            break
        # the answer to a call of a model's thread or background coroutine (else dropped); a decoupled
        # model's request whose client went away; the server's log settings: nothing to answer
        if op in ("bls", "cancel", "logging"):
            try:
                stub.calls.deliver(op, payload)
            except Exception as exc:  # (the model's cancel handling, say) this process goes on serving
                print(f"delivering the worker's {op!r} message failed: {_describe(exc)}", file=sys.stderr)
            continue
        try:
            if op not in OPERATIONS:
                raise pb_utils.TritonModelException(f"unknown operation {op!r}")
            with stub.calls.running():
                answer: tuple[str, Any] = ("ok", getattr(stub, op)(payload))
        except BaseException as exc:  # the model's failure goes back to the worker, not up here
            answer = ("error", _describe(exc))
        try:  # plain pickle (Connection.send's ForkingPickler costs several times more), one write at a
            stub.calls.send(answer)  # time: a decoupled model's threads send responses meanwhile
        except OSError:  # the worker is gone (killed): no one to answer, and this process ends with it
            break
        except Exception as exc:  # e.g. an output that cannot be pickled
            stub.calls.send(("error", f"cannot send the answer of {op}: {exc}"))
        if op == "finalize":
            break
    stub.calls.close()  # a model's thread still waiting for a call's answer gets an error, not a wait forever


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(1)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, pb_utils.TritonModelException):
        return exc.message()
    if isinstance(exc, SyntaxError):  # its text names the file and line; the frames are the importer's
        return f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    # the innermost frame of the model's code: a mistake pb_utils raised on is shown at the model's call,
    # and one in a module model.py imports at that module's line, not in Python's import machinery
    models = [f for f in frames
              if not f.filename.startswith("<") and Path(f.filename).resolve().parent != HERE]
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(models or frames)), "")
    return f"{type(exc).__name__}: {exc}" + (f" ({where})" if where else "")


def _load_module(model_file: str) -> Any:
    """model.py imported as Triton's stub imports it: as `<version>.model`, its version folder and the
    model's folder on sys.path, so that it may import the modules beside it (`import helper`, or
    `from .helper import ...`) and those beside its version folder."""
    path = Path(model_file)
    for folder in (str(path.parent.parent), str(path.parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    module = importlib.import_module(f"{path.parent.name}.{path.stem}")
    if not hasattr(module, "TritonPythonModel"):
        raise pb_utils.TritonModelException(f"{model_file} defines no class TritonPythonModel")
    return module


class Stub:
    def __init__(self, calls: ModelCalls) -> None:
        self.model: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.calls = calls
        calls.on_cancel = self.cancel  # a cancellation may come while execute waits for a model call
        self.decoupled = False
        self.senders: dict[int, ResponseSender] = {}  # a decoupled model's requests not yet finished
        self.default_senders = DefaultSenders(_answer)  # any other model's, for requests that ask

    def cancel(self, stream: int) -> None:
        sender = self.senders.get(stream)
        if sender is not None:
            sender.cancelled = True

    def auto_complete(self, payload: dict[str, Any]) -> str | None:
        """The config JSON after the model's auto_complete_config, or None when it has none."""
        pb_utils._model_dir = str(Path(payload["model_file"]).parent)
        cls = _load_module(payload["model_file"]).TritonPythonModel
        if not hasattr(cls, "auto_complete_config"):
            return None
        config = pb_utils.ModelConfig(payload["config"])
        pb_utils._model_name = config._name()  # (Logger prefixes it)
        result = cls.auto_complete_config(config)
        if not isinstance(result, pb_utils.ModelConfig):  # (Triton's words)
            raise pb_utils.TritonModelException(f"auto_complete_config function in model '{config._name()}' "
                                                "must return a valid pb.ModelConfig object.")
        return json.dumps(result.as_dict())

    def initialize(self, payload: dict[str, Any]) -> None:
        pb_utils._model_name = payload["args"]["model_name"]
        pb_utils._model_dir = str(Path(payload["model_file"]).parent)
        config = json.loads(payload["args"]["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        pb_utils._default_senders = None if self.decoupled else self.default_senders
        model = _load_module(payload["model_file"]).TritonPythonModel()
        if hasattr(model, "initialize"):
            self._await(model.initialize(payload["args"]))
        self.model = model  # (only once initialized: as in Triton, a failed initialize has no finalize)

    def execute(self, payload: list[tuple[Any, ...]]) -> list[tuple[str, Any, Any]] | None:
        """Run one batch of (inputs, asked outputs, parameters, request id, (correlation ID, flags) or
        None, timeout in µs, and for a decoupled model its stream id); one ("ok", outputs, response
        parameters or None) or ("error", (message, code), None) per request, in order, whether execute
        returned it or the request's response sender sent it (_despina_senders.py). A decoupled model
        answers through its response senders instead: None."""
        requests = []
        for inputs, asked, parameters, request_id, sequence, timeout, *stream in payload:
            request = pb_utils.InferenceRequest(
                request_id=request_id, timeout=timeout,
                correlation_id=sequence[0] if sequence else 0, flags=sequence[1] if sequence else 0,
                inputs=[pb_utils.Tensor(n, wire.unpack(a)) for n, a in inputs.items()],
                requested_output_names=asked, parameters=parameters)
            if self.decoupled:
                request._response_sender = ResponseSender(stream[0], asked, self.calls, self.senders)
            requests.append(request)
        self.default_senders.start(requests)  # (before: a sender is made only while _model_calls is set)
        pb_utils._model_calls = self.calls  # exec() works from execute on, as in Triton
        try:
            return self._execute(requests, payload)
        finally:  # a decoupled model's threads, and its coroutines in the background, call models whenever
            if not self.decoupled:  # they like, as Triton's stub lets them until finalize; any other model's
                pb_utils._model_calls = None  # until its requests are answered (by its senders' threads too)

    def _execute(self, requests: list[Any], payload: list[tuple[Any, ...]]
                 ) -> list[tuple[str, Any, Any]] | None:
        try:
            responses = self.model.execute(requests)
            if self.decoupled and inspect.isawaitable(responses):
                self._in_background(responses, requests)
                return None
            responses = self._await(responses)
        except BaseException as exc:
            if self.default_senders.batch is None:
                raise
            return self.default_senders.batch.answers(None, f"execute failed: {_describe(exc)}", self.loop)
        if self.decoupled:
            if responses is not None:
                raise pb_utils.TritonModelException(RETURNED)
            return None
        if self.default_senders.batch is not None:  # some requests answered through their senders
            return self.default_senders.batch.answers(responses, None, self.loop)
        wrong = wrong_return(responses, len(requests))
        if wrong is not None:
            raise pb_utils.TritonModelException(wrong)
        return [_answer(r, asked) for r, (_, asked, *_) in zip(responses, payload)]

    def finalize(self, payload: Any) -> None:
        pb_utils._model_calls = None  # (Triton's stub refuses calls once finalize begins)
        if self.model is not None and hasattr(self.model, "finalize"):
            self._await(self.model.finalize())

    def _in_background(self, execute: Any, requests: list[Any]) -> None:
        """A decoupled model's coroutine execute, as Triton (24.04 and later) runs it: on the event loop
        of its own thread, the next requests coming meanwhile. If it raises, or returns a value, its
        requests not yet finished end with that error, as they do when a plain execute fails."""
        self.calls.read_by_stub = True  # this thread reads, and the coroutines wait for it
        running = asyncio.run_coroutine_threadsafe(_awaited(execute), self._background_loop())

        def ended(done: concurrent.futures.Future[Any]) -> None:
            try:
                if done.result() is not None:
                    raise pb_utils.TritonModelException(RETURNED)
            except BaseException as exc:
                failed = pb_utils.TritonError(pb_utils._named(f"execute failed: {_describe(exc)}"))
                for request in requests:
                    try:
                        request.get_response_sender().send(pb_utils.InferenceResponse(error=failed),
                                                           pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    except pb_utils.TritonModelException:
                        pass  # it had ended
        running.add_done_callback(ended)

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="execute-loop", daemon=True).start()
        return self.loop

    def _await(self, result: Any) -> Any:
        if not inspect.isawaitable(result):
            return result
        if self.decoupled:  # its loop runs on a thread of its own (_in_background)
            return asyncio.run_coroutine_threadsafe(_awaited(result), self._background_loop()).result()
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(result)


class ResponseSender(pb_utils.InferenceResponseSender):
    """How a decoupled model answers one request (Triton's InferenceResponseSender): any number of
    responses, from any thread, the last one flagged TRITONSERVER_RESPONSE_COMPLETE_FINAL."""

    def __init__(self, stream: int, asked: list[str], calls: ModelCalls, open_: dict[int, ResponseSender]
                 ) -> None:
        self._stream, self._asked, self._calls, self._open = stream, asked, calls, open_
        self._closed = False
        self._lock = threading.Lock()
        self.cancelled = False  # its client went away (the worker said so)
        if stream:  # (0: a warmup sample's, nobody's to cancel)
            open_[stream] = self

    def send(self, response: Any = None, flags: int = 0) -> None:
        """Triton's checks, with its messages: flags 0 or the final one; a response unless the flag is
        final; nothing once the final flag went."""
        if flags not in (0, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise pb_utils.TritonModelException(UNSUPPORTED_FLAG)
        final = bool(flags)
        if response is None and not final:
            raise pb_utils.TritonModelException(NO_RESPONSE)
        answer = None if response is None else _answer(response, self._asked)
        with self._lock:  # responses go in the order they were sent, none after the final one
            if self._closed:
                raise pb_utils.TritonModelException(CLOSED)
            self._closed = final
            if final:
                self._open.pop(self._stream, None)
            try:
                self._calls.send(("response", (self._stream, answer, final)))
            except OSError:  # the worker is gone (killed): this thread ends quietly (SystemExit does), and
                raise SystemExit(1) from None  # the process soon after, with its worker, as the loop does

    def is_cancelled(self) -> bool:
        """Whether the request's client went away (or the model that called it cancelled the call): the
        model may stop, and send its final flag. Asked inside execute, it reads what the worker said."""
        if not self.cancelled:
            self._calls.poll()
        return self.cancelled


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _answer(response: Any, asked: Collection[str]) -> tuple[str, Any, Any]:
    if not isinstance(response, pb_utils.InferenceResponse):
        return ("error", (pb_utils._named("Expected an 'InferenceResponse' object in the execute function "
                                          f"return list, found type '{type(response)}'."),
                          pb_utils.TritonError.INTERNAL), None)
    if response.has_error():
        error = response.error()
        return ("error", (str(error.message() if hasattr(error, "message") else error),
                          error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL), None)
    # as Triton's stub does: the outputs asked for that the response has (one it lacks is not an error)
    outputs = {t.name(): t.as_numpy() for t in response.output_tensors() if t.name() in asked}
    parameters = response.parameters()
    return ("ok", {n: wire.pack(np.asarray(a)) for n, a in outputs.items()},
            json.loads(parameters) if parameters != "{}" else None)


if __name__ == "__main__":
    main()
