"""Triton's `triton_python_backend_utils` for models served by Despina's Python backend.

The documented API of Triton's Python backend, so that a Triton `model.py` runs unchanged: Tensor,
InferenceRequest, InferenceResponse, TritonError, TritonModelException, the tensor helpers, the
datatype tables, ModelConfig for `auto_complete_config`, and Logger. Only numpy and the standard
library are used: this module runs in the model's process, not in Despina's.
"""
from __future__ import annotations

import enum
import json
import os
import re
import struct
import sys
import time
from typing import Any, NoReturn

import numpy as np

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
# Triton's DataType enum numbers (model_config.proto), as triton_to_numpy_type takes them.
_TRITON_TO_NUMPY: dict[int, Any] = {
    1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8, 7: np.int16,
    8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64, 13: np.object_,
}
# and back: every Tensor a model makes asks this, a dict lookup instead of a dtype built per candidate
_NUMPY_TO_TRITON: dict[np.dtype[Any], int] = {np.dtype(t): n for n, t in _TRITON_TO_NUMPY.items() if n != 13}

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

_model_name = ""  # set by the stub; Logger prefixes it
_model_calls: Any = None  # set by the stub while execute runs (_despina_calls.ModelCalls): exec() uses it
# set by the stub of a model that is not decoupled (_despina_senders.DefaultSenders): its requests' senders
_default_senders: Any = None
# the server's log settings (Triton's names: log_info, log_verbose_level, ...) as the worker last told the
# stub; Logger follows them. Until it is told, Triton's defaults: every level but VERBOSE.
_log_settings: dict[str, Any] = {}


def triton_to_numpy_type(data_type: int) -> Any:
    return _TRITON_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type is bytes or data_type is np.bytes_:
        return 13
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind in "OS":
        return 13
    return _NUMPY_TO_TRITON.get(dtype)


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | None:
    """A BYTES tensor as Triton's wire form: each element as a 4-byte LE length and its bytes, C order.

    None when the tensor does not hold bytes or objects.
    """
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.reshape(-1, order="C"):
        raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += [struct.pack("<I", len(raw)), raw]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Triton's BYTES wire form -> a flat numpy array of bytes objects (dtype object)."""
    items = []
    offset = 0
    view = memoryview(encoded_tensor)
    while offset < len(view):
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        items.append(bytes(view[offset:offset + length]))
        offset += length
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


class TritonModelException(Exception):
    """Raised by a model (or by this module) for an error in initialize, execute or finalize."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


class TritonError:
    """The error of one response: `InferenceResponse(error=TritonError("..."))` fails that request."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        self._msg = msg
        self._code = code

    def __str__(self) -> str:
        return self._msg

    def __repr__(self) -> str:
        return f"TritonError({self._msg!r}, {self._code})"

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code


class Tensor:
    """A named tensor of a request or a response, backed by a numpy array in this process."""

    def __init__(self, name: str, numpy_array: Any = None, triton_dtype: int | None = None) -> None:
        array = np.asarray(numpy_array) if not isinstance(numpy_array, np.ndarray) else numpy_array
        if array.dtype.type is np.str_ or array.dtype.type is np.void:
            raise TritonModelException("Tensor dtype used for numpy_array is not supported by the "
                                       "Python backend; use np.object_ instead")
        if triton_dtype is not None:
            wanted = triton_to_numpy_type(triton_dtype)
            if wanted is not None and wanted is not np.object_ and array.dtype != wanted:
                array = array.view(wanted)
        else:
            triton_dtype = numpy_to_triton_type(array.dtype)
        self._name = name
        self._array = array
        self._triton_dtype = triton_dtype

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int | None:
        return self._triton_dtype

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        """The DLPack protocol, as Triton's Tensor has it: torch.from_dlpack(tensor) takes it as it is."""
        return self._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    @staticmethod
    def from_dlpack(name: str, dlpack: Any) -> Tensor:
        """A Tensor from an object with __dlpack__ (a CPU torch tensor, say) or a DLPack capsule."""
        if not hasattr(dlpack, "__dlpack__"):
            dlpack = _Capsule(dlpack)
        return Tensor(name, np.from_dlpack(dlpack))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


class _Capsule:
    """Lets numpy take a bare DLPack capsule (as torch.utils.dlpack.to_dlpack makes)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: the Python backend hands models CPU tensors


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
        else:  # a dict, as the stub passes the request's: JSON, as Triton's parameters() returns
            self._parameters = json.dumps(parameters) if parameters else "{}"

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        return self._requested

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
            if _default_senders is None:
                raise TritonModelException("this request has no response sender: only the requests "
                                           "execute receives have one")
            self._response_sender = _default_senders.of(self)
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


def _calls() -> Any:
    if _model_calls is None:
        raise TritonModelException("InferenceRequest.exec and async_exec work only inside execute")
    return _model_calls


class InferenceResponse:
    """The response to one request: output tensors, or an error that fails only that request."""

    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: Any = None) -> None:
        if output_tensors is None:
            output_tensors = []
        if not isinstance(output_tensors, (list, tuple)):  # Triton's binding takes any sequence of them
            raise TritonModelException('"output_tensors" must be a list.')
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


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", ()) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", ()) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def load_model(model_name: str, config: str = "", files: Any = None) -> None:
    _no_model_loading("load_model")


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    _no_model_loading("unload_model")


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    _no_model_loading("is_model_ready")


def _no_model_loading(function: str) -> NoReturn:
    """Triton's model loading API (load_model, unload_model, is_model_ready) is not Despina's: a model
    that uses it fails with this reason rather than an AttributeError."""
    raise TritonModelException(f"pb_utils.{function}: Despina does not let a Python model load, unload or "
                               "check models; load the models it calls through the repository API or "
                               "--load-model")


class ModelConfig:
    """The configuration handed to `auto_complete_config`; what it returns is the model's config."""

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        config = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        config.setdefault("input", [])
        config.setdefault("output", [])
        config.setdefault("max_batch_size", 0)
        self._model_config = config

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {current}, but "
                             f"auto_complete_config of model '{self._name()}' sets {max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"configuration of model '{self._name()}' uses {other}; "
                                 "auto_complete_config cannot set dynamic_batching")
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        extra = set(transaction_policy_dict) - {"decoupled"}
        if extra:
            raise ValueError(f"model transaction policy of model '{self._name()}' has properties "
                             f"other than 'decoupled': {sorted(extra)}")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            if "decoupled" in policy and policy["decoupled"] != transaction_policy_dict["decoupled"]:
                raise ValueError(f"model '{self._name()}': decoupled is already {policy['decoupled']}")
            policy["decoupled"] = transaction_policy_dict["decoupled"]

    def _add(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        extra = set(tensor) - set(allowed)
        if extra:
            raise ValueError(f"{kind} '{tensor.get('name')}' of model '{self._name()}' has properties "
                             f"other than {', '.join(allowed)}: {sorted(extra)}")
        for required in ("name", "data_type", "dims"):
            if required not in tensor:
                raise ValueError(f"{kind} of model '{self._name()}' is missing property '{required}'")
        for current in self._model_config[kind]:
            if current["name"] != tensor["name"]:
                continue
            declared = current.get("data_type", "TYPE_INVALID")
            if declared not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(f"model '{self._name()}': configuration expects datatype {declared} "
                                 f"for {kind} '{tensor['name']}', model provides {tensor['data_type']}")
            dims = [int(d) for d in current.get("dims", [])]
            if dims and dims != [int(d) for d in tensor["dims"]]:
                raise ValueError(f"model '{self._name()}', tensor '{tensor['name']}': the model "
                                 f"expects dims {tensor['dims']} but the configuration specifies {dims}")
            # (the config Triton hands over prints every field: an input of config.pbtxt says false)
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(f"model '{self._name()}', tensor '{tensor['name']}': the model expects "
                                 f"optional {tensor['optional']} but the configuration specifies optional "
                                 f"{current['optional']}")
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))


class Metric:
    """One metric of a MetricFamily (Triton's custom metrics): a counter, gauge or histogram with its
    labels. Its process reports it to its worker, and the control plane's /metrics shows it."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        self._family = family
        self._value = 0.0
        self._changed_at = 0.0  # when a gauge was last set or incremented: the last one shows
        self._buckets = buckets
        self._counts = [0] * (len(buckets) + 1) if buckets is not None else []
        self._sum = 0.0

    def increment(self, value: float) -> None:
        global _metrics_changed
        if self._family._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("increment() is not supported by a HISTOGRAM metric: use observe()")
        if self._family._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a COUNTER metric cannot be incremented by a negative value")
        self._value += value
        self._changed_at = time.time()
        _metrics_changed = True  # after the change: a report taken meanwhile is followed by another

    def set(self, value: float) -> None:
        global _metrics_changed
        if self._family._kind != MetricFamily.GAUGE:
            raise TritonModelException("set() is supported by a GAUGE metric only")
        self._value = float(value)
        self._changed_at = time.time()
        _metrics_changed = True

    def observe(self, value: float) -> None:
        global _metrics_changed
        if self._buckets is None:
            raise TritonModelException("observe() is supported by a HISTOGRAM metric only")
        self._counts[next((i for i, bound in enumerate(self._buckets) if value <= bound),
                          len(self._buckets))] += 1
        self._sum += value
        _metrics_changed = True

    def value(self) -> float:
        if self._buckets is not None:
            raise TritonModelException("value() is not supported by a HISTOGRAM metric")
        return self._value

    def _report(self, labels: dict[str, str]) -> dict[str, Any]:
        if self._buckets is not None:
            return {"labels": labels, "buckets": list(self._buckets), "counts": list(self._counts),
                    "sum": float(self._sum)}
        return {"labels": labels, "value": float(self._value), "at": self._changed_at}


class MetricFamily:
    """Triton's custom metrics: `MetricFamily(name, description, kind)`, then `.Metric(labels)` (and
    `buckets` for a histogram). Metrics of one family with the same labels are one metric."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in (MetricFamily.COUNTER, MetricFamily.GAUGE, MetricFamily.HISTOGRAM):
            raise TritonModelException(f"metric family '{name}': kind must be MetricFamily.COUNTER, GAUGE "
                                       "or HISTOGRAM")
        if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
            raise TritonModelException(f"metric family {name!r}: a metric name is letters, digits, '_' and "
                                       "':', not starting with a digit (Prometheus's rule)")
        known_kind, _, self._metrics = _metric_families.setdefault(name, (kind, str(description), {}))
        if known_kind != kind:  # the same name is the same family (and its metrics), as in Triton
            raise TritonModelException(f"metric family '{name}' already exists with another kind")
        self._name, self._description, self._kind = name, description, kind

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        if self._kind == MetricFamily.HISTOGRAM and buckets is None:
            raise TritonModelException(f"metric family '{self._name}': a HISTOGRAM metric needs buckets")
        if self._kind != MetricFamily.HISTOGRAM and buckets is not None:
            raise TritonModelException(f"metric family '{self._name}': only a HISTOGRAM metric has buckets")
        key = tuple(sorted((str(k), str(v)) for k, v in (labels or {}).items()))
        for label, _ in key:
            if not _LABEL_NAME.fullmatch(label) or label.startswith("__") or \
                    (label == "le" and self._kind == MetricFamily.HISTOGRAM):
                raise TritonModelException(f"metric family '{self._name}': {label!r} cannot be a label name "
                                           "(letters, digits and '_', not starting with a digit or '__'; "
                                           "'le' is a histogram's own)")
        if key not in self._metrics:
            self._metrics[key] = Metric(self, dict(key), sorted(buckets) if buckets is not None else None)
        return self._metrics[key]


MetricKind = MetricFamily  # Triton's enum of the kinds, its values in the module too
COUNTER, GAUGE, HISTOGRAM = MetricFamily.COUNTER, MetricFamily.GAUGE, MetricFamily.HISTOGRAM
_KIND_NAMES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# name -> (kind, description, metrics by their labels)
_metric_families: dict[str, tuple[int, str, dict[tuple[tuple[str, str], ...], Metric]]] = {}
_metrics_changed = False  # set by every update; the stub's reporter clears it (_despina_metrics.py)


def _metrics_report() -> list[dict[str, Any]]:
    """Every metric family with its metrics' values, as the worker publishes them (despina/custom_metrics.py).
    Safe while the model's threads update them: list() copies a dict without letting another thread in."""
    return [{"name": name, "help": description, "type": _KIND_NAMES[kind],
             "metrics": [metric._report(dict(labels)) for labels, metric in list(metrics.items())]}
            for name, (kind, description, metrics) in list(_metric_families.items())]


class Logger:
    """Log lines from a model; they land in the worker's log with the model's name. As in Triton, each
    level follows the server's log settings (`/v2/logging`): log_info, log_warning and log_error switch
    theirs, and VERBOSE lines show only at a log_verbose_level of 1 or more."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        if type(level) is bool or not isinstance(level, int) or level not in _LOG_SWITCHES:
            raise TypeError(f"Logger.log: level must be a pb_utils.Logger.LogLevel (INFO, WARNING, ERROR or "
                            f"VERBOSE), not {level!r}")
        if not _shows(level):
            return
        print(_log_line(Logger.LogLevel(level).name, str(message)), file=sys.stderr, flush=True)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.VERBOSE)


# which of the server's log settings lets each level's lines through (a count for VERBOSE, else a switch)
_LOG_SWITCHES: dict[int, str] = {Logger.INFO: "log_info", Logger.WARNING: "log_warning",
                                 Logger.ERROR: "log_error", Logger.VERBOSE: "log_verbose_level"}


def _log_line(label: str, message: str) -> str:
    """A line as the worker's own look (despina/logs.py): the time (ISO8601 in UTC, or local with
    milliseconds), the process, the level, the model, the message; a JSON object where the worker writes
    JSON lines (--log-format json), so that a log shipper reads the model's lines as the server's."""
    now = time.time()
    if _log_settings.get("log_format") == "ISO8601":
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
    if _log_settings.get("json"):
        return json.dumps({"time": stamp, "level": label, "role": "model", "pid": os.getpid(),
                           "logger": f"model.{_model_name}", "model": _model_name, "message": message})
    return f"{stamp} model[{os.getpid()}] {label} model '{_model_name}': {message}"


def _shows(level: int) -> bool:
    switch = _LOG_SWITCHES[level]
    if level == Logger.VERBOSE:
        return int(_log_settings.get(switch, 0)) >= 1
    return bool(_log_settings.get(switch, True))
