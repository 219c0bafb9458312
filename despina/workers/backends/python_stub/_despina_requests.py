"""pb_utils' requests and responses: InferenceRequest (as execute receives it, or a call of another
model), InferenceResponse, the response sender and iterator types, and the request and response flags.

Part of `triton_python_backend_utils`, which re-exports these names; a model imports them from there.
The state the stub sets (the running execute's model calls, a non-decoupled model's senders) lives in
that module, one object for the stub and the model alike: read it there, when it is needed.
"""
from __future__ import annotations

import enum
import json
from typing import Any, NoReturn

import triton_python_backend_utils as pb_utils
from _despina_errors import TritonError, TritonModelException
from _despina_tensor import Tensor

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


class MemoryType(enum.IntEnum):
    """Where a model call's outputs should arrive (PreferredMemory's first argument): Triton's enum, its
    values also in the module as they are there."""

    TRITONSERVER_MEMORY_CPU = 0
    TRITONSERVER_MEMORY_GPU = 2


TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU
TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU


class PreferredMemory:
    """Where a model call's outputs should arrive (`InferenceRequest(preferred_memory=...)`). Outputs reach
    this process as numpy arrays whichever is asked for: a GPU output comes back in CPU memory."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceTrace:
    """A request's trace, as `request.trace()` returns it to pass on to the models it calls. Despina does
    not hand a model its trace context: get_context() is None, as Triton's is for an untraced request."""

    def get_context(self) -> str | None:
        return None


class InferenceRequest:
    """One request of a batch, as `execute(requests)` receives it; or, made by a model inside execute, a
    call of another model: `exec()` runs it and returns its InferenceResponse (an error response when
    it failed), `await async_exec()` lets several run at once. `timeout` is in microseconds."""

    def __init__(self, request_id: str = "", correlation_id: int | str = 0,
                 inputs: list[Tensor] | None = None, requested_output_names: list[str] | None = None,
                 model_name: str = "", model_version: int = -1, flags: int = 0, timeout: int = 0,
                 preferred_memory: Any = None, trace: Any = None, parameters: Any = None) -> None:
        if model_name:  # a model's call of another model (the stub's own requests have no name: unchecked)
            _check_call(request_id, correlation_id, inputs, requested_output_names, model_name, model_version,
                        flags, timeout)
            model_version, flags, timeout = int(model_version), int(flags), int(timeout)  # (numpy's too)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._inputs = list(inputs or ())
        self._requested = list(requested_output_names or ())
        self._model_name = model_name
        self._model_version = model_version
        self._timeout = timeout
        self._flags = flags
        self._trace = trace if trace is not None else InferenceTrace()
        if isinstance(parameters, str):
            self._parameters = parameters
        else:  # a dict, as the stub passes the request's: compact JSON, as Triton's parameters() returns
            self._parameters = json.dumps(parameters, separators=(",", ":")) if parameters else "{}"

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def requested_output_names(self) -> set[str]:
        """A set, as Triton's: a model may not rely on their order. (A model's call of another
        model sends them as the model listed them: _requested.)"""
        return set(self._requested)

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def set_release_flags(self, flags: int) -> None:
        """How the request is released once executed: TRITONSERVER_REQUEST_RELEASE_ALL, as every request
        is. Rescheduling needs sequence_batching { iterative_sequence: true }, which Despina does not
        load, so TRITONSERVER_REQUEST_RELEASE_RESCHEDULE is an error here rather than a request that
        never gets its response."""
        if flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            raise TritonModelException("TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: rescheduling a request "
                                       "needs iterative sequence batching, which Despina does not support")

    def parameters(self) -> str:
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> InferenceTrace:
        return self._trace

    def is_cancelled(self) -> bool:
        """Whether the request's client went away (a decoupled model's request; False for the rest)."""
        return self._response_sender is not None and self._response_sender.is_cancelled()

    _response_sender: Any = None  # the stub sets one on each request of a decoupled model

    def get_response_sender(self) -> Any:
        """How the model answers this request other than in execute's list: `send(response=None,
        flags=0)`. A decoupled model sends any number of responses, the last with
        flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL; any other model exactly one, the flag with it or
        sent alone after it (execute returns None in its place)."""
        if self._response_sender is None:
            if pb_utils._default_senders is None:
                raise TritonModelException("this request has no response sender: only the requests "
                                           "execute receives have one")
            self._response_sender = pb_utils._default_senders.of(self)
        return self._response_sender

    def exec(self, decoupled: bool = False) -> Any:
        """The called model's response; with decoupled=True an iterator of its responses, each as it
        comes (a decoupled model's, the last one empty when it ended with the final flag alone)."""
        calls = _calls()
        return calls.stream(self) if decoupled else calls.call(self)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """exec() awaited; with decoupled=True, once the called model sent its last response, an iterator
        of them all."""
        return await _calls().call_async(self, decoupled)


class InferenceResponseSender:
    """What `request.get_response_sender()` returns: `send(response=None, flags=0)` and `is_cancelled()`.
    Triton's name for it, so that a model may name it (an annotation, an isinstance check); the stub's
    senders are its kinds."""

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        raise NotImplementedError

    def is_cancelled(self) -> bool:
        raise NotImplementedError


class ResponseIterator:
    """What `exec(decoupled=True)` returns: the called model's responses as they come, and `cancel()`.
    Triton's name for it, as InferenceResponseSender is; the stub's iterators are its kinds."""

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError


def _check_call(request_id: Any, correlation_id: Any, inputs: Any, requested_output_names: Any,
                model_name: Any, model_version: Any, flags: Any, timeout: Any) -> None:
    """The argument types Triton's binding takes, refused where the call is made as it refuses them (a
    model_version "1" failed inside the call, an output name "OUT" was asked as 'O', 'U' and 'T')."""
    def refuse(name: str, kind: str, value: Any) -> NoReturn:
        raise TypeError(f"InferenceRequest: {name} must be {kind}, not {type(value).__name__}")
    for name, value in (("model_name", model_name), ("request_id", request_id)):
        if not isinstance(value, str):
            refuse(name, "a str", value)
    for name, value in (("model_version", model_version), ("flags", flags), ("timeout", timeout)):
        if not hasattr(type(value), "__index__"):  # an int, numpy's included
            refuse(name, "an int", value)
    if not isinstance(correlation_id, str) and not hasattr(type(correlation_id), "__index__"):
        refuse("correlation_id", "an int or a str", correlation_id)
    if isinstance(requested_output_names, (str, bytes)) or not all(
            isinstance(n, str) for n in requested_output_names or ()):
        refuse("requested_output_names", "a list of str", requested_output_names)
    if not all(isinstance(t, Tensor) for t in inputs or ()):
        refuse("inputs", "a list of pb_utils.Tensor", inputs)


def _calls() -> Any:
    if pb_utils._model_calls is None:
        raise TritonModelException("BLS is only supported during the 'execute' function.")  # (Triton's words)
    return pb_utils._model_calls


class InferenceResponse:
    """The response to one request: output tensors, or an error that fails only that request."""

    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: Any = None) -> None:
        if output_tensors is None:
            output_tensors = []
        if not isinstance(output_tensors, (list, tuple)):  # Triton's binding takes any sequence of them
            raise TritonModelException('"output_tensors" must be a list.')
        for tensor in output_tensors:  # as Triton's binding: here, not when the stub reads it
            if not isinstance(tensor, Tensor):
                raise TypeError("InferenceResponse: output_tensors must be pb_utils.Tensor objects, not "
                                f"{type(tensor).__name__}")
        self._output_tensors = list(output_tensors)
        self._error = error
        self._parameters = _response_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


def _response_parameters(parameters: Any) -> str:
    """A response's parameters as Triton's Python backend takes them (a dict of str to bool, int or
    str; None: none), as JSON."""
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):
        raise TritonModelException(f"response parameters must be a dict, not {type(parameters).__name__}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"response parameter names must be str, not {type(key).__name__}")
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(f"response parameter '{key}' must be a bool, int or str, not "
                                       f"{type(value).__name__}")
        if isinstance(value, int) and not -2**63 <= value < 2**63:
            raise TritonModelException(f"response parameter '{key}' is out of the int64 range")
    return json.dumps(parameters) if parameters else "{}"


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)

