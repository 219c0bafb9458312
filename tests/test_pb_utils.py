"""Despina's `triton_python_backend_utils` on its own: the module a Triton `model.py` imports, loaded
as the model's process loads it (it needs numpy only)."""
from __future__ import annotations

import importlib
import json
import sys
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from .conftest import ROOT

STUB_FOLDER = ROOT / "despina" / "workers" / "backends" / "python_stub"


def load_pb_utils() -> ModuleType:
    """The module as the stub imports it: its folder first on sys.path (the private modules beside it
    come with it), then taken off again, so that nothing else here imports from that folder."""
    sys.path.insert(0, str(STUB_FOLDER))
    try:
        return importlib.import_module("triton_python_backend_utils")
    finally:
        sys.path.remove(str(STUB_FOLDER))


@pytest.fixture(scope="module")
def pb_utils() -> ModuleType:
    return load_pb_utils()


def test_pb_utils_bytes_codec_and_type_tables(pb_utils: ModuleType) -> None:
    array = np.array([b"a", b"", "é".encode(), 7], dtype=object)
    wire = pb_utils.serialize_byte_tensor(array)
    assert wire == b"\x01\x00\x00\x00a\x00\x00\x00\x00\x02\x00\x00\x00\xc3\xa9\x01\x00\x00\x007"
    assert pb_utils.deserialize_bytes_tensor(wire).tolist() == [b"a", b"", "é".encode(), b"7"]
    assert pb_utils.serialize_byte_tensor(np.zeros(2, np.float32)) is None
    assert pb_utils.triton_string_to_numpy("TYPE_FP16") is np.float16
    assert pb_utils.triton_to_numpy_type(11) is np.float32 and pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.numpy_to_triton_type(np.float32) == 11 and pb_utils.numpy_to_triton_type(np.bool_) == 1
    assert pb_utils.numpy_to_triton_type(np.object_) == 13 and pb_utils.numpy_to_triton_type(np.bytes_) == 13
    for number in range(1, 13):  # every numeric type there and back, by type or by dtype
        numpy_type = pb_utils.triton_to_numpy_type(number)
        assert pb_utils.numpy_to_triton_type(numpy_type) == number
        assert pb_utils.numpy_to_triton_type(np.dtype(numpy_type)) == number
    assert pb_utils.numpy_to_triton_type(np.dtype(">f4")) is None and pb_utils.numpy_to_triton_type(np.str_) is None
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.Tensor("s", np.array(["no unicode arrays"]))
    error = pb_utils.TritonError("gone", pb_utils.TritonError.NOT_FOUND)
    assert error.message() == "gone" and error.code() == pb_utils.TritonError.NOT_FOUND
    response = pb_utils.InferenceResponse(error=error)
    assert response.has_error() and response.output_tensors() == []


def test_pb_utils_inference_response_takes_a_list_or_tuple_of_tensors(pb_utils: ModuleType) -> None:
    """Triton's binding takes output_tensors as a std::vector, which pybind11 fills from any sequence."""
    tensor = pb_utils.Tensor("t", np.zeros(1))
    assert pb_utils.InferenceResponse(output_tensors=(tensor,)).output_tensors() == [tensor]
    assert pb_utils.InferenceResponse([tensor]).output_tensors() == [tensor]
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(output_tensors=tensor)
    # Triton's binding refuses anything but Tensors there (a TypeError), not the stub later on
    with pytest.raises(TypeError, match="output_tensors must be pb_utils.Tensor objects, not ndarray"):
        pb_utils.InferenceResponse([tensor, np.zeros(2)])


def test_pb_utils_tensor_name_must_be_a_str(pb_utils: ModuleType) -> None:
    """Triton's binding refuses another name (a TypeError); a Tensor named 5 was made, and its output
    dropped as one nobody asked for."""
    with pytest.raises(TypeError, match="Tensor: name must be a str, not int"):
        pb_utils.Tensor(5, np.zeros(1))


def test_pb_utils_model_config_checks_conflicts(pb_utils: ModuleType) -> None:
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 8, "input": [
        {"name": "IN", "data_type": "TYPE_FP32", "dims": [4]}], "output": []}))
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
    with pytest.raises(ValueError, match="datatype"):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match="dims"):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="max_batch_size"):
        config.set_max_batch_size(4)
    config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
    assert [o["name"] for o in config.as_dict()["output"]] == ["OUT"]


# What each ModelConfig call raises, word for word as Triton 2.51's pb_utils raises it for a model "m" whose
# config.pbtxt declares max_batch_size 8, input IN (FP32 [4]) and sequence_batching (seen on Triton's load
# answers: a user who searches the message finds Triton's issues and docs).
MODEL_CONFIG_ERRORS = [
    (lambda c: c.set_max_batch_size(4),
     "configuration specified max_batch_size 8, but in auto-complete-config function for model 'm' specified "
     "max_batch_size 4"),
    (lambda c: c.set_dynamic_batching(),
     "Configuration specified scheduling_choice as 'sequence_batching', but auto-complete-config function for "
     "model 'm' tries to set scheduling_choice as 'dynamic_batching'"),
    (lambda c: c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "format": "FORMAT_NHWC"}),
     "input 'IN' in auto-complete-config function for model 'm' contains property other than 'name', "
     "'data_type', 'dims' and 'optional'."),
    (lambda c: c.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4], "optional": True}),
     "output 'OUT' in auto-complete-config function for model 'm' contains property other than 'name', "
     "'data_type' and 'dims'."),
    (lambda c: c.add_input({"data_type": "TYPE_FP32", "dims": [4]}),
     "input in auto-complete-config function for model 'm' is missing 'name' property."),
    (lambda c: c.add_input({"name": "IN", "dims": [4]}),
     "input 'IN' in auto-complete-config function for model 'm' is missing 'data_type' property."),
    (lambda c: c.add_output({"name": "OUT", "data_type": "TYPE_FP32"}),
     "output 'OUT' in auto-complete-config function for model 'm' is missing 'dims' property."),
    (lambda c: c.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [4]}),
     "unable to load model 'm', configuration expects datatype TYPE_FP32 for input 'IN', model provides "
     "TYPE_INT32"),
    (lambda c: c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [5]}),
     "model 'm', tensor 'IN': the model expects dims [5] but the model configuration specifies dims [4]"),
    (lambda c: c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True}),
     "model 'm', tensor 'IN': the model expects optional True but the model configuration specifies optional "
     "False"),
    (lambda c: c.set_model_transaction_policy({"decoupled": True, "x": 1}),
     "model transaction property in auto-complete-config function for model 'm' contains property other than "
     "'decoupled'."),
    (lambda c: c.set_model_transaction_policy({"decoupled": True}),
     "trying to change decoupled property in auto-complete-config for model 'm', which is already set to "
     "'False'."),
]


@pytest.mark.parametrize("call, message", MODEL_CONFIG_ERRORS)
def test_pb_utils_model_config_raises_tritons_messages(pb_utils: ModuleType, call: Any, message: str) -> None:
    """Each refusal said the same thing in Despina's words ("... but auto_complete_config of model 'm' sets
    4"), so a load error read differently from Triton's for the same model.py."""
    config = pb_utils.ModelConfig(json.dumps({
        "name": "m", "max_batch_size": 8, "sequence_batching": {}, "model_transaction_policy": {"decoupled": False},
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": False}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}]}))
    with pytest.raises(ValueError) as raised:
        call(config)
    assert str(raised.value) == message


def test_pb_utils_a_model_call_takes_every_argument_tritons_readme_shows(pb_utils: ModuleType) -> None:
    """Triton's BLS example passes preferred_memory=pb_utils.PreferredMemory(...), and a model passes its
    request's trace on with trace=request.trace(): both were AttributeErrors."""
    request = pb_utils.InferenceRequest(request_id="r", inputs=[], requested_output_names=["Y"])
    assert request.trace().get_context() is None
    call = pb_utils.InferenceRequest(
        model_name="m", requested_output_names=["Y"], inputs=[pb_utils.Tensor("X", np.zeros(2))],
        request_id="1", correlation_id=4, model_version=1, flags=0, timeout=5,
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
        trace=request.trace(), parameters={"k": "v"})
    assert call.model_name() == "m" and call.trace() is request.trace()
    assert pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU).preferred_device_id == 0


def test_pb_utils_a_call_outside_execute_is_refused_in_tritons_words(pb_utils: ModuleType) -> None:
    """A model call from initialize (or anywhere outside execute) raised Despina's own words
    ("InferenceRequest.exec and async_exec work only inside execute"); Triton 2.51 says this."""
    call = pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[])
    with pytest.raises(pb_utils.TritonModelException) as refused:
        call.exec()
    assert refused.value.message() == "BLS is only supported during the 'execute' function."


@pytest.mark.parametrize("argument, value, expected", [
    ("model_version", "1", "model_version must be an int, not str"),
    ("timeout", 1.5, "timeout must be an int, not float"),
    ("flags", None, "flags must be an int, not NoneType"),
    ("model_name", 3, "model_name must be a str, not int"),
    ("request_id", 7, "request_id must be a str, not int"),
    ("requested_output_names", "OUT", "requested_output_names must be a list of str, not str"),
    ("requested_output_names", ["OUT", 2], "requested_output_names must be a list of str, not list"),
    ("inputs", [np.zeros(2)], "inputs must be a list of pb_utils.Tensor, not list"),
    ("correlation_id", 1.5, "correlation_id must be an int or a str, not float"),
])
def test_pb_utils_a_model_call_with_an_argument_of_the_wrong_type_is_a_type_error(
        pb_utils: ModuleType, argument: str, value: Any, expected: str) -> None:
    """Triton's binding refuses such a call where it is made (TypeError: "__init__(): incompatible
    constructor arguments"). Despina took model_version="1" and failed inside the call with "calling model
    'add' failed: '<' not supported between instances of 'str' and 'int'" (an INTERNAL error response), and
    took requested_output_names="OUT" as the outputs 'O', 'U' and 'T'."""
    arguments: dict[str, Any] = {"model_name": "add", "inputs": [pb_utils.Tensor("IN", np.zeros(2))],
                                 "requested_output_names": ["OUT"], argument: value}
    with pytest.raises(TypeError) as refused:
        pb_utils.InferenceRequest(**arguments)
    assert str(refused.value) == f"InferenceRequest: {expected}"
    call = pb_utils.InferenceRequest(model_name="add", inputs=[], requested_output_names=[],
                                     model_version=np.int64(1), correlation_id="c", request_id="r", timeout=5)
    assert type(call.model_version()) is int and call.model_version() == 1


def test_pb_utils_tensor_speaks_the_dlpack_protocol(pb_utils: ModuleType) -> None:
    """Triton's Tensor has __dlpack__ and __dlpack_device__, so that torch.from_dlpack(tensor) (or numpy's)
    takes a request's tensor as it is, without to_dlpack()."""
    tensor = pb_utils.Tensor("X", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert tensor.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(tensor), tensor.as_numpy())
    # Triton's error (numpy's was a BufferError, which a model catching TritonModelException missed)
    text = pb_utils.Tensor("T", np.array([b"a"], dtype=np.object_))
    for way in (text.to_dlpack, text.__dlpack__):
        with pytest.raises(pb_utils.TritonModelException, match="DLPack does not have support for string tensors"):
            way()
    assert pb_utils.Tensor.from_dlpack("Y", tensor).as_numpy().shape == (2, 3)


def test_pb_utils_request_release_flags(pb_utils: ModuleType) -> None:
    """set_release_flags was missing: RELEASE_ALL is what every request gets, and RESCHEDULE (which needs
    the iterative sequence batching Despina refuses to load) is an error that says so."""
    request = pb_utils.InferenceRequest(inputs=[], requested_output_names=[])
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
    with pytest.raises(pb_utils.TritonModelException, match="iterative sequence"):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    request.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    assert request.flags() == pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


def test_pb_utils_custom_metrics_count_in_the_models_process(pb_utils: ModuleType) -> None:
    """Triton's custom metrics API, as its README's example uses it from initialize: pb_utils had no
    MetricFamily, so such a model failed to load. Its metrics now count (and its process reports them:
    test_metrics.py shows them on /metrics)."""
    family = pb_utils.MetricFamily(name="preprocess_latency_ns", description="Cumulative time spent",
                                   kind=pb_utils.MetricFamily.COUNTER)
    metric = family.Metric(labels={"model": "m", "version": "1"})
    metric.increment(5)
    metric.increment(2)
    assert metric.value() == 7
    with pytest.raises(pb_utils.TritonModelException):
        metric.set(1)  # a counter only goes up
    again = pb_utils.MetricFamily("preprocess_latency_ns", "Cumulative time spent", pb_utils.COUNTER)
    assert again.Metric(labels={"version": "1", "model": "m"}).value() == 7  # the same name, the same metric
    gauge = pb_utils.MetricFamily("queue", "q", pb_utils.MetricFamily.GAUGE).Metric(labels={"a": "b"})
    gauge.set(4)
    gauge.increment(-1)
    assert gauge.value() == 3
    histogram = pb_utils.MetricFamily("sizes", "s", pb_utils.MetricFamily.HISTOGRAM)
    with pytest.raises(pb_utils.TritonModelException, match="buckets"):
        histogram.Metric(labels={})
    histogram.Metric(labels={}, buckets=[1.0, 10.0]).observe(3.5)
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.MetricFamily("queue", "q", pb_utils.MetricFamily.COUNTER)


def test_pb_utils_model_loading_api_fails_with_its_reason(pb_utils: ModuleType) -> None:
    """Triton's load_model, unload_model and is_model_ready were AttributeErrors: Despina does not offer
    them to a model, and a model that calls them now fails saying so."""
    for call in (lambda: pb_utils.is_model_ready(model_name="m", model_version="1"),
                 lambda: pb_utils.load_model(model_name="m"), lambda: pb_utils.unload_model("m")):
        with pytest.raises(pb_utils.TritonModelException, match="repository API"):
            call()


def test_pb_utils_custom_metrics_names_are_prometheus_names(pb_utils: ModuleType) -> None:
    """A family or label name the Prometheus text format cannot carry is refused where it is made, as
    Triton's core refuses it: it would have broken the whole of /metrics, not just its own series."""
    for name in ("with space", "9lives", "dash-ed", ""):
        with pytest.raises(pb_utils.TritonModelException, match="metric name"):
            pb_utils.MetricFamily(name, "d", pb_utils.MetricFamily.COUNTER)
    family = pb_utils.MetricFamily("ns:requests_total", "d", pb_utils.MetricFamily.COUNTER)
    for label in ("a-b", "__reserved", "1st"):
        with pytest.raises(pb_utils.TritonModelException, match="label name"):
            family.Metric(labels={label: "v"})
    with pytest.raises(pb_utils.TritonModelException, match="label name"):
        pb_utils.MetricFamily("latency", "d", pb_utils.MetricFamily.HISTOGRAM).Metric(labels={"le": "1"},
                                                                                     buckets=[1.0])
    family.Metric(labels={"model": 'any "value"\n at all'}).increment(2)
    reported = {f["name"]: f for f in pb_utils._metrics_report()}["ns:requests_total"]
    assert reported["type"] == "counter" and reported["help"] == "d"
    assert reported["metrics"][0]["labels"] == {"model": 'any "value"\n at all'}
    assert reported["metrics"][0]["value"] == 2


# Every public name of Triton's module as a model sees it (python_backend, r24.xx and later): those of
# src/resources/triton_python_backend_utils.py, and those of the c_python_backend_utils module that
# src/pb_stub.cc binds (PYBIND11_EMBEDDED_MODULE) and sets on it. (get_model_dir, which Triton's stub
# adds to the module at initialize, is not one of Despina's.)
TRITON_PY_NAMES = (
    "TRITON_STRING_TO_NUMPY", "serialize_byte_tensor", "deserialize_bytes_tensor", "get_input_tensor_by_name",
    "get_output_tensor_by_name", "get_input_config_by_name", "get_output_config_by_name",
    "using_decoupled_model_transaction_policy", "triton_to_numpy_type", "numpy_to_triton_type",
    "triton_string_to_numpy", "ModelConfig", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END", "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITONSERVER_REQUEST_RELEASE_ALL", "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE", "json", "struct", "np",
)
TRITON_C_NAMES = (
    "TritonError", "TritonModelException", "PreferredMemory", "MemoryType", "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_MEMORY_CPU", "InferenceTrace", "InferenceRequest", "Tensor", "InferenceResponse",
    "InferenceResponseSender", "ResponseIterator", "Logger", "Metric", "MetricKind", "COUNTER", "GAUGE",
    "HISTOGRAM", "MetricFamily", "load_model", "unload_model", "is_model_ready", "get_model_dir",
)


def test_pb_utils_has_every_public_name_of_tritons_module(pb_utils: ModuleType) -> None:
    """Each name importable from the module (and brought by a star import), the class-level names too;
    a name the module's split into private modules left behind would fail here."""
    star: dict[str, object] = {}
    exec("from triton_python_backend_utils import *", star)  # the module loaded above, from sys.modules
    for name in TRITON_PY_NAMES + TRITON_C_NAMES:
        imported: dict[str, object] = {}
        exec(f"from triton_python_backend_utils import {name}", imported)
        assert imported[name] is getattr(pb_utils, name) is star[name], name
    for code in ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                 "ALREADY_EXISTS", "CANCELLED"):
        assert isinstance(getattr(pb_utils.TritonError, code), int), code
    for level in ("INFO", "WARNING", "ERROR", "VERBOSE"):
        assert getattr(pb_utils.Logger, level) == getattr(pb_utils.Logger.LogLevel, level), level
    for kind in ("COUNTER", "GAUGE", "HISTOGRAM"):
        assert getattr(pb_utils.MetricFamily, kind) == getattr(pb_utils, kind), kind


def test_pb_utils_state_is_one_object_for_the_stub_and_its_private_modules(
        pb_utils: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The stub sets pb_utils._model_name, _log_settings and _metrics_changed (and the model's calls and
    senders); the classes that read them live in private modules, and must see what was set on this
    module, not a copy of their own."""
    tensor = pb_utils.Tensor("x", np.zeros(2, np.float32))
    assert isinstance(tensor, sys.modules["_despina_tensor"].Tensor) and isinstance(tensor, pb_utils.Tensor)
    name, settings = pb_utils._model_name, pb_utils._log_settings
    try:
        pb_utils._model_name, pb_utils._log_settings = "shared", {"log_verbose_level": 1}
        pb_utils.Logger.log_verbose("seen")
        assert "VERBOSE model 'shared': seen" in capsys.readouterr().err
    finally:
        pb_utils._model_name, pb_utils._log_settings = name, settings
    pb_utils._metrics_changed = False
    pb_utils.MetricFamily("state_shared", "d", pb_utils.GAUGE).Metric().set(1)
    assert pb_utils._metrics_changed is True
    assert "state_shared" in pb_utils._metric_families


def test_a_call_waiting_when_the_stub_stops_reading_gets_an_error(pb_utils: ModuleType) -> None:
    """A model's thread waiting for a call's answer when the stub's loop stopped reading (finalize, the
    worker gone) waited forever: nothing read the pipe any more, and the call's deadline is the worker's.
    Such a thread kept the model's process up until the worker killed it, 5 s into each unload."""
    import threading
    from multiprocessing import Pipe

    sys.path.insert(0, str(STUB_FOLDER))
    try:
        calls_module = importlib.import_module("_despina_calls")
    finally:
        sys.path.remove(str(STUB_FOLDER))
    ours, theirs = Pipe()
    calls = calls_module.ModelCalls(ours)
    calls.read_by_stub = True  # between operations: the loop reads (and here, reads nothing)
    got: list[Any] = []
    request = pb_utils.InferenceRequest(model_name="m", requested_output_names=["y"],
                                        inputs=[pb_utils.Tensor("x", np.zeros(1, np.float32))])
    thread = threading.Thread(target=lambda: got.append(calls.call(request)), daemon=True)
    thread.start()
    assert theirs.poll(5)  # the call went out, and waits for its answer
    calls.close()
    thread.join(5)
    assert not thread.is_alive()
    assert got[0].has_error() and "no longer reads" in got[0].error().message()
    assert got[0].error().code() == pb_utils.TritonError.UNAVAILABLE
