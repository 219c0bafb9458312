"""Despina's `triton_python_backend_utils` on its own: the module a Triton `model.py` imports, loaded
from its file as the model's process loads it (it needs numpy only)."""
from __future__ import annotations

import importlib.util
import json
from types import ModuleType

import numpy as np
import pytest

from .conftest import ROOT


@pytest.fixture(scope="module")
def pb_utils() -> ModuleType:
    path = ROOT / "despina" / "workers" / "backends" / "python_stub" / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("triton_python_backend_utils", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_pb_utils_tensor_speaks_the_dlpack_protocol(pb_utils: ModuleType) -> None:
    """Triton's Tensor has __dlpack__ and __dlpack_device__, so that torch.from_dlpack(tensor) (or numpy's)
    takes a request's tensor as it is, without to_dlpack()."""
    tensor = pb_utils.Tensor("X", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert tensor.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(tensor), tensor.as_numpy())
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
