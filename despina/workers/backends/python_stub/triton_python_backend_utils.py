"""Triton's `triton_python_backend_utils` for models served by Despina's Python backend.

The documented API of Triton's Python backend, so that a Triton `model.py` runs unchanged: Tensor,
InferenceRequest, InferenceResponse, TritonError, TritonModelException, the tensor helpers, the
datatype tables, ModelConfig for `auto_complete_config`, MetricFamily and Logger. Only numpy and the
standard library are used: this module runs in the model's process, not in Despina's.

Each concept lives in a private module beside this one, named `_despina_*` so that no model's own
module has its name: the stub imports them all, through this module, before a model's folders go on
sys.path, and a model's file cannot shadow them. Every name is re-exported here, the same object, so
`isinstance` and identity hold. The state the stub sets and reads stays here, one object for the stub
and the model alike: those modules import this one and read it when they need it (not at import).
"""
from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from _despina_config import (
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    is_model_ready,
    load_model,
    unload_model,
    using_decoupled_model_transaction_policy,
)
from _despina_errors import TritonError, TritonModelException
from _despina_logger import Logger
from _despina_metric_family import COUNTER, GAUGE, HISTOGRAM, Metric, MetricFamily, MetricKind
from _despina_metric_family import _metrics_report as _metrics_report  # (the stub's reporter sends it)
from _despina_requests import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_MEMORY_GPU,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceRequest,
    InferenceResponse,
    InferenceResponseSender,
    InferenceTrace,
    MemoryType,
    PreferredMemory,
    ResponseIterator,
    get_input_tensor_by_name,
    get_output_tensor_by_name,
)
from _despina_tensor import (
    TRITON_STRING_TO_NUMPY,
    Tensor,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)

# What `from triton_python_backend_utils import *` gives: the API, and the three modules Triton's own
# triton_python_backend_utils.py imports (json, struct, np), which a model may have relied on.
__all__ = [
    "COUNTER", "GAUGE", "HISTOGRAM", "TRITONSERVER_MEMORY_CPU", "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL", "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "TRITON_STRING_TO_NUMPY", "InferenceRequest",
    "InferenceResponse", "InferenceResponseSender", "InferenceTrace", "Logger", "MemoryType", "Metric",
    "MetricFamily", "MetricKind", "ModelConfig", "PreferredMemory", "ResponseIterator", "Tensor",
    "TritonError", "TritonModelException", "deserialize_bytes_tensor", "get_input_config_by_name",
    "get_input_tensor_by_name", "get_model_dir", "get_output_config_by_name", "get_output_tensor_by_name",
    "is_model_ready", "json", "load_model", "np", "numpy_to_triton_type", "serialize_byte_tensor",
    "struct", "triton_string_to_numpy", "triton_to_numpy_type", "unload_model",
    "using_decoupled_model_transaction_policy",
]

# -- the stub's state: set and read as pb_utils.<name>, by the stub and by the modules above -----------
_model_name = ""  # set by the stub; Logger prefixes it
_model_dir = ""  # set by the stub: the folder of the model's model.py
# set by the stub while execute runs and its requests wait for their senders (a decoupled model's: from its
# first execute until finalize) (_despina_calls.ModelCalls): exec() uses it
_model_calls: Any = None
# set by the stub of a model that is not decoupled (_despina_senders.DefaultSenders): its requests' senders
_default_senders: Any = None
# the server's log settings (Triton's names: log_info, log_verbose_level, ...) as the worker last told the
# stub; Logger follows them. Until it is told, Triton's defaults: every level but VERBOSE.
_log_settings: dict[str, Any] = {}
# the model's custom metrics: name -> (kind, description, its Metrics by their labels)
_metric_families: dict[str, tuple[int, str, dict[tuple[tuple[str, str], ...], Metric]]] = {}
_metrics_changed = False  # set by every update; the stub's reporter clears it (_despina_metrics.py)


def _named(failure: str) -> str:
    """A failure of the stub's own making, for a request's answer: named with its model, as the worker
    names its failures. (A model's own TritonError goes to the client as it is, as in Triton.)"""
    return f"model '{_model_name}': {failure}"


def get_model_dir() -> str:
    """The folder of the model's model.py (its version folder), as Triton's stub gives it."""
    return _model_dir
