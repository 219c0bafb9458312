"""Triton Python-backend models: `<version>/model.py` with `class TritonPythonModel`.

Each instance runs the model in its own process (the stub, python_stub/stub.py), as Triton does, so
user code cannot take the worker down. `execute` receives the requests of a batch and answers each
one; an error in one response fails only that request. If the process dies, the requests it was
running get errors and a new process is started (initialize runs again) for the next batch.

While an execute is outstanding, the model may call other models (`InferenceRequest.exec()`, Triton's
business logic scripting): the process sends ("bls", (call id, model, version, inputs, asked outputs,
timeout µs, parameters, (correlation ID, flags) or None, decoupled, request id)) as often as it likes,
and the worker runs each call on its event loop (workers/bls.py) and answers ("bls", (call id, ("ok",
outputs[, response parameters]) | ("error", (message, code)))) whenever it is done, in any order; the
execute's own answer ends the exchange as before. A decoupled model's execute answers nothing: its
responses come as ("response", (stream id, answer, final)) whenever the model sends them
(python_process.DecoupledStub), and go to `on_response`. The process and the connection to it are
python_process.py's.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from ...contract.errors import BackendError, Code, ConfigError, DespinaError
from ...contract.instance_groups import completed_config
from ...contract.modelconfig import ModelConfig, complete, to_dict
from .base import Backend, Marks, Outputs, visible_gpus
from .python_env import interpreter
from .python_process import DecoupledStub, OnResponse, Stub, StubDied, log
from .python_stub import _despina_wire as wire

AUTO_COMPLETE_TIMEOUT_S = 60.0
# TritonError codes -> Despina codes, for the HTTP status Triton gives them: UNKNOWN, ALREADY_EXISTS and
# CANCELLED are a 400 there, as INVALID_ARG is, UNSUPPORTED a 501; INTERNAL is a backend error (500).
ERROR_CODES = {0: Code.INVALID_ARGUMENT, 2: Code.NOT_FOUND, 3: Code.INVALID_ARGUMENT, 4: Code.UNAVAILABLE,
               5: Code.UNIMPLEMENTED, 6: Code.INVALID_ARGUMENT, 7: Code.INVALID_ARGUMENT}


# What Triton 2.51 takes from auto_complete_config's answer (seen on GET .../config): a model's writes to
# as_dict() beyond these (parameters, instance groups, version policy, warmup, ...) are dropped
TAKEN_FROM_AUTO_COMPLETE = ("max_batch_size", "input", "output", "dynamic_batching", "sequence_batching",
                            "model_transaction_policy")


class PythonBackend(Backend):
    per_request = True
    awaitable = True

    @classmethod
    def default_filename(cls) -> str:
        return "model.py"

    @classmethod
    def gpu_available(cls) -> bool:
        return visible_gpus() > 0

    _unloaded = False  # set by unload: a process that ends then is not one to start again

    def load(self) -> None:
        self._lock = threading.Lock()
        self._restart: threading.Thread | None = None
        self._restart_error = ""
        self.stub = self._start()

    #: A decoupled model's responses go here (set by the worker before load; called on a thread).
    on_response: OnResponse | None = None

    def _start(self) -> Stub:
        with interpreter(self.spec.name, self.spec.config.get("parameters") or {}, self.version_dir.parent,
                         sys.executable) as python:  # the process keeps its environment's hold
            if self.spec.decoupled:
                stub: Stub = DecoupledStub.start(self.spec.name, self._response, python=python)
            else:
                stub = Stub.start(self.spec.name, python=python)
        try:
            stub.call("initialize", {"model_file": str(self.model_path()), "args": self._args()})
        except BackendError as exc:  # the stub's error names the model and the call already
            stub.stop()
            raise ConfigError(exc.message) from None
        except StubDied as exc:
            stub.stop()
            raise ConfigError(f"model '{self.spec.name}': initialize failed: {exc}") from None
        return stub

    def _args(self) -> dict[str, str]:
        """initialize()'s args, as Triton's Python backend passes them: every value a string."""
        return {
            # the instance groups as they run here: KIND_AUTO is KIND_CPU or KIND_GPU by now, as in Triton
            "model_config": json.dumps(completed_config(self.spec, self.gpu_count())),
            "model_instance_kind": self.instance.kind,
            "model_instance_name": self.instance.name,
            "model_instance_device_id": str(self.instance.device),
            "model_repository": str(self.version_dir.parent),
            "model_version": self.version_dir.name,
            "model_name": self.spec.name,
        }

    def execute_requests(self, requests: Sequence[Mapping[str, np.ndarray]],
                         outputs: Sequence[Sequence[str]], marks: Marks | None = None
                         ) -> list[dict[str, np.ndarray] | DespinaError]:
        answers = self._execute(_payload(requests, outputs), marks)
        return [answers] * len(requests) if isinstance(answers, DespinaError) else self._results(answers)

    async def execute_requests_async(self, requests: Sequence[Mapping[str, np.ndarray]],
                                     outputs: Sequence[Sequence[str]], marks: Marks | None = None
                                     ) -> list[dict[str, np.ndarray] | DespinaError]:
        """The same, the process's answer awaited on the event loop; only when quick() (no restart)."""
        answers = await self._execute_async(_payload(requests, outputs), marks)
        return [answers] * len(requests) if isinstance(answers, DespinaError) else self._results(answers)

    def execute_streams(self, requests: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Sequence[str]],
                        streams: Sequence[int], marks: Marks | None = None) -> list[DespinaError | None]:
        """A decoupled model's execute: its answers come to on_response by stream id; here, per request,
        None or the error that ended it (execute raised, the process died)."""
        failed = self._execute(_payload(requests, outputs, streams), marks)
        return [failed if isinstance(failed, DespinaError) else None] * len(requests)

    async def execute_streams_async(self, requests: Sequence[Mapping[str, np.ndarray]],
                                    outputs: Sequence[Sequence[str]], streams: Sequence[int],
                                    marks: Marks | None = None) -> list[DespinaError | None]:
        """The same, awaited on the event loop; only when quick() (no restart)."""
        failed = await self._execute_async(_payload(requests, outputs, streams), marks)
        return [failed if isinstance(failed, DespinaError) else None] * len(requests)

    def _execute(self, payload: list[Any], marks: Marks | None) -> Any:
        """The process's answer to one execute, or the error that takes its place for the whole batch (a
        restart that failed, the process dying under it, execute raising, as in Triton). `marks` gets
        "input" now, the requests packed for the process, and "infer" at its answer, as Triton's Python
        backend times its requests put in the stub's shared memory and the stub's round trip."""
        _stamp(marks, "input")
        try:
            with self._lock:
                failure = self._ready()
                if failure is not None:
                    return failure
                try:
                    return self.stub.call("execute", payload, caller=self.caller)
                except StubDied as exc:
                    return self._died(exc)
                except BackendError as exc:
                    return exc
        finally:
            _stamp(marks, "infer")

    async def _execute_async(self, payload: list[Any], marks: Marks | None) -> Any:
        _stamp(marks, "input")
        try:
            return await self.stub.call_async("execute", payload, self.caller)
        except StubDied as exc:
            return self._died(exc)
        except BackendError as exc:
            return exc
        finally:
            _stamp(marks, "infer")

    def cancel(self, stream: int) -> None:
        """A decoupled model's request whose client went away: its response sender says is_cancelled()."""
        try:
            self.stub._send(("cancel", stream))
        except (OSError, ValueError):
            pass  # the process is gone, and the request with it

    def _response(self, message: tuple[int, Any, bool] | None) -> None:
        """On the reader's thread: a decoupled model's response (or the end of its process), passed on."""
        if self.on_response is None:
            return
        if message is None:
            self.on_response(None, None, True)
            return
        stream, answer, final = message
        self.on_response(stream, None if answer is None else self._result(*answer), final)

    def _results(self, answers: list[tuple[str, Any, Any]]) -> list[dict[str, np.ndarray] | DespinaError]:
        return [self._result(*a) for a in answers]

    def _result(self, status: str, out: Any, parameters: Any) -> dict[str, np.ndarray] | DespinaError:
        """One request's answer from the stub: ("ok", outputs, response parameters or None), or
        ("error", (message, code), None): the message as it came, the model's own as Triton passes it on
        (the stub names the model in the failures it makes itself)."""
        if status != "ok":
            return DespinaError(out[0], ERROR_CODES.get(out[1], Code.BACKEND))
        outputs = wire.unpack_all(out)
        return Outputs(outputs, parameters) if parameters else outputs

    def _died(self, exc: StubDied) -> BackendError:
        """The process died under a batch: restart it on a thread; the batch's error."""
        if self._unloaded:  # unload stopped it under this batch (a warmup that hangs, say)
            return BackendError(f"model '{self.spec.name}' instance {self.instance.name} was unloaded while "
                                "executing this request")
        log.error("model %s: instance %s died while executing (%s); restarting it",
                  self.spec.name, self.instance.name, exc)
        self._restart = threading.Thread(target=self._restart_stub, daemon=True)
        self._restart.start()
        return BackendError(f"model '{self.spec.name}' instance {self.instance.name} "
                            f"crashed while executing this request ({exc}); it is restarting")

    def quick(self) -> bool:
        return self._restart is None and self.stub.alive()

    def _ready(self) -> DespinaError | None:
        """Wait for a restart in progress; start the process again if it died while idle."""
        if self._unloaded:
            return BackendError(f"model '{self.spec.name}' instance {self.instance.name} is unloaded")
        if self._restart is not None:
            self._restart.join()
            self._restart = None
        elif not self.stub.alive():
            log.error("model %s: instance %s exited (code %s); restarting it", self.spec.name,
                      self.instance.name, self.stub.wait(0))
            self._restart_stub()
        if not self.stub.alive():
            return BackendError(f"model '{self.spec.name}' instance {self.instance.name} could not be "
                                f"restarted: {self._restart_error}")
        return None

    def _restart_stub(self) -> None:
        self.stub.stop()
        try:
            self.stub = self._start()
            self._restart_error = ""
        except ConfigError as exc:
            self._restart_error = exc.message
            log.error("%s", exc.message)
        if self._unloaded:  # unloaded while it started again
            self.stub.stop()

    def custom_metrics(self) -> list[dict[str, Any]]:
        stub = getattr(self, "stub", None)
        return stub.metrics() if stub is not None else []

    def unload(self) -> None:
        self._unloaded = True
        if getattr(self, "_restart", None) is not None:
            self._restart.join()  # type: ignore[union-attr]
        if getattr(self, "stub", None) is not None:
            self.stub.stop()

    @classmethod
    def auto_complete(cls, config: Any, version_dir: Path) -> None:
        """Run the model's auto_complete_config, in a process of its own, when model.py defines one."""
        path = version_dir / (config.default_model_filename or cls.default_filename())
        if not path.exists():
            raise ConfigError(f"model '{config.name}': model file {path} does not exist")
        if not path.is_file():
            raise ConfigError(f"model '{config.name}': model file {path} is not a file")
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:  # one the server may not read: the model's fault, said as such
            raise ConfigError(f"model '{config.name}': model file {path} cannot be read: "
                              f"{exc.strerror}") from None
        if "auto_complete_config" not in text:
            return
        parameters = {k: {"string_value": v.string_value} for k, v in config.parameters.items()}
        with interpreter(config.name, parameters, version_dir.parent, sys.executable) as python:
            stub = Stub.start(config.name, python=python)
        handed = ModelConfig()  # as Triton hands it over: completed first (a preferred batch size of the
        handed.CopyFrom(config)  # config's max_batch_size, pinned memory, the instance group's name, ...)
        try:
            answer = stub.call("auto_complete", {"model_file": str(path),
                                                 "config": json.dumps(to_dict(complete(handed)))},
                               AUTO_COMPLETE_TIMEOUT_S)
        except BackendError as exc:  # the stub's error names the model and the call already
            raise ConfigError(exc.message) from None
        except StubDied as exc:
            raise ConfigError(f"model '{config.name}': auto_complete_config failed: {exc}") from None
        finally:
            stub.stop()
        if answer is None:
            return
        try:
            completed = json_format.ParseDict(json.loads(answer), ModelConfig())
        except json_format.ParseError as exc:
            raise ConfigError(f"model '{config.name}': auto_complete_config returned an invalid "
                              f"config: {exc}") from None
        for field in TAKEN_FROM_AUTO_COMPLETE:  # (the rest stays as config.pbtxt gave it, as in Triton)
            config.ClearField(field)
        config.MergeFrom(_only(completed, TAKEN_FROM_AUTO_COMPLETE))


def _only(config: Any, fields: tuple[str, ...]) -> Any:
    kept = ModelConfig()
    for field in fields:
        value = getattr(config, field)
        if field == "max_batch_size":
            kept.max_batch_size = value
        elif field in ("input", "output"):
            getattr(kept, field).extend(value)
        elif config.HasField(field):
            getattr(kept, field).CopyFrom(value)
    return kept


def _payload(requests: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Sequence[str]],
             streams: Sequence[int] = ()) -> list[Any]:
    """Per request: its inputs, the outputs asked for, its parameters, its V2 id, its sequence and its
    timeout in µs (base.Request), and a decoupled model's stream id."""
    payload = [(wire.pack_all(r), list(o), getattr(r, "parameters", None), getattr(r, "request_id", ""),
                getattr(r, "sequence", None), getattr(r, "timeout_us", 0)) for r, o in zip(requests, outputs)]
    return [(*p, s) for p, s in zip(payload, streams)] if streams else payload


def _stamp(marks: Marks | None, name: str) -> None:
    if marks is not None:
        marks[name] = time.perf_counter_ns()
