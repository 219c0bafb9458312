"""TensorFlow SavedModels through a real `despina serve` (one server for the module: TensorFlow is slow
to import), and the signature reader that auto-completes configs without TensorFlow."""
from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from despina.contract.errors import ConfigError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.examples import build_tf_mlp, mlp_numpy
from despina.workers.backends import Instance, backend_class
from despina.workers.backends.tensorflow import check_accelerators

from .conftest import FULL_QUEUE_DELAY, Server, module_server, settled_stats
from .test_ragged import answers_of_one_batch

tf = pytest.importorskip("tensorflow")

MLP = '''
name: "mlp_savedmodel"
platform: "tensorflow_savedmodel"
max_batch_size: 64
dynamic_batching { max_queue_delay_microseconds: 50000 }
'''
# Inputs and outputs left out: a string and a float input, completed from the signature.
TEXT = '''
name: "text"
platform: "tensorflow_savedmodel"
default_model_filename: "exported"
max_batch_size: 8
'''

# Ragged batching (workers/ragged.py): x comes flat, the requests end to end, and `counts` (a batch input
# in the signature, not in the config's inputs) says how many elements each has; each request gets its sum.
RAGGED = '''
name: "ragged_tf"
platform: "tensorflow_savedmodel"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 2000000 }
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true } ]
batch_input [ { kind: BATCH_ELEMENT_COUNT, target_name: "counts", data_type: TYPE_INT32, source_input: "x" } ]
output [ { name: "sums", data_type: TYPE_FP32, dims: [ 1 ] } ]
'''


def build_ragged(path: Path) -> None:
    class Ragged(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x"),
                                      tf.TensorSpec([None], tf.int32, name="counts")])
        def serve(self, x: Any, counts: Any) -> dict[str, Any]:
            owners = tf.repeat(tf.range(tf.shape(counts)[0]), counts)
            return {"sums": tf.expand_dims(tf.math.segment_sum(x, owners), 1)}

    module = Ragged()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def build_text(path: Path) -> None:
    class Text(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.string, name="words"),
                                      tf.TensorSpec([None, 1], tf.float32, name="scale")])
        def serve(self, words: Any, scale: Any) -> dict[str, Any]:
            return {"upper": tf.strings.upper(words),
                    "lengths": tf.cast(tf.strings.length(words), tf.float32) * scale}

    module = Text()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tf-repo")
    for name, config in (("mlp_savedmodel", MLP), ("text", TEXT), ("ragged_tf", RAGGED)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    build_tf_mlp(root / "mlp_savedmodel" / "1" / "model.savedmodel")
    build_text(root / "text" / "1" / "exported")
    build_ragged(root / "ragged_tf" / "1" / "model.savedmodel")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, repo: Path) -> Iterator[Server]:
    yield from module_server(repo, tmp_path_factory, redis_url, ("mlp_savedmodel", "text", "ragged_tf"),
                             env=FULL_QUEUE_DELAY)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"), concurrency=16)
    yield c
    c.close()


@functools.cache
def signature(folder: Path) -> Any:
    return tf.saved_model.load(str(folder)).signatures["serving_default"]


def tf_output(folder: Path, **inputs: np.ndarray) -> dict[str, np.ndarray]:
    function = signature(folder)
    return {k: v.numpy() for k, v in function(**{k: tf.constant(v) for k, v in inputs.items()}).items()}


def test_signature_fills_the_config(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("mlp_savedmodel")
    assert meta["platform"] == "tensorflow_savedmodel"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}]
    text = client.get_model_metadata("text")
    assert text["inputs"] == [{"name": "scale", "datatype": "FP32", "shape": [-1, 1]},
                              {"name": "words", "datatype": "BYTES", "shape": [-1, 2]}]
    assert {o["name"]: o["datatype"] for o in text["outputs"]} == {"lengths": "FP32", "upper": "BYTES"}


def test_mlp_with_dynamic_batching(client: httpclient.InferenceServerClient, server: Server, repo: Path
                                   ) -> None:
    rows = [np.random.default_rng(i).standard_normal((1 + i % 2, 256)).astype(np.float32) for i in range(10)]
    before = client.get_inference_statistics("mlp_savedmodel")["model_stats"][0]["execution_count"]
    pending = []
    for x in rows:
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        pending.append(client.async_infer("mlp_savedmodel", [tensor]))
    folder = repo / "mlp_savedmodel" / "1" / "model.savedmodel"
    for x, p in zip(rows, pending):
        y = p.get_result().as_numpy("y")
        np.testing.assert_allclose(y, tf_output(folder, x=x)["y"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y, mlp_numpy(x), rtol=1e-4, atol=1e-5)
    stats = settled_stats(server.url, "mlp_savedmodel")
    assert stats["inference_count"] >= sum(len(x) for x in rows)
    assert stats["execution_count"] - before < len(rows)


def test_bytes_tensors(client: httpclient.InferenceServerClient, server: Server, repo: Path) -> None:
    words = np.array([[b"ab", b"cde"], [b"", b"xyz!"]], dtype=object)
    scale = np.array([[1.0], [2.0]], dtype=np.float32)
    inputs = [httpclient.InferInput("words", [2, 2], "BYTES"), httpclient.InferInput("scale", [2, 1], "FP32")]
    inputs[0].set_data_from_numpy(words, binary_data=True)
    inputs[1].set_data_from_numpy(scale, binary_data=True)
    result = client.infer("text", inputs)
    expected = tf_output(repo / "text" / "1" / "exported", words=words, scale=scale)
    assert result.as_numpy("upper").tolist() == expected["upper"].tolist()
    assert expected["upper"].tolist() == [[b"AB", b"CDE"], [b"", b"XYZ!"]]
    np.testing.assert_array_equal(result.as_numpy("lengths"), expected["lengths"])
    r = httpx.post(f"{server.url}/fn/text", json={"words": ["hi", "there"], "scale": [0.5]})
    assert r.status_code == 200, r.text
    assert r.json() == {"upper": ["HI", "THERE"], "lengths": [1.0, 2.5]}


def test_ragged_requests_share_a_batch_and_the_batch_input_is_fed(server: Server) -> None:
    assert answers_of_one_batch(server, "ragged_tf", [[1.0, 2.0, 3.0], [10.0, 20.0]]) == [[6.0], [30.0]]


def test_auto_complete_needs_no_tensorflow(repo: Path) -> None:
    code = ("import sys; from pathlib import Path; from despina.control.repository import load_model; "
            f"e = load_model(Path({str(repo / 'text')!r})); "
            "print([i['name'] for i in e.config['input']], 'tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['scale', 'words'] False"


def test_missing_savedmodel_or_signature_is_a_config_error(repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('platform: "tensorflow_savedmodel"\n')
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(folder)
    (folder / "config.pbtxt").write_text('platform: "tensorflow_savedmodel"\ndefault_model_filename: '
                                         '"exported"\nparameters { key: "TF_SIGNATURE_DEF" value: '
                                         '{ string_value: "nope" } }\n')
    (folder / "1" / "exported").symlink_to(repo / "text" / "1" / "exported")
    with pytest.raises(ConfigError, match="signature 'nope'"):
        load_model(folder)


def test_dims_without_the_batch_dimension_say_the_model_batches(repo: Path, tmp_path: Path) -> None:
    """Triton's auto-complete reads max_batch_size 0 as "not said" when the signature batches: the config's
    dims one shorter than the signature's shapes say it batches (max_batch_size 4), of its rank that it
    does not; dims that disagree are the load error."""
    folder = tmp_path / "listed"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.savedmodel").symlink_to(repo / "mlp_savedmodel" / "1" / "model.savedmodel")
    def config(x: str, y: str) -> dict[str, Any]:
        (folder / "config.pbtxt").write_text(f'platform: "tensorflow_savedmodel"\ninput [ {{ name: "x", '
                                             f'data_type: TYPE_FP32, dims: {x} }} ]\noutput [ {{ name: "y", '
                                             f'data_type: TYPE_FP32, dims: {y} }} ]\n')
        return load_model(folder).config

    assert config("[ 256 ]", "[ 10 ]")["max_batch_size"] == 4
    assert config("[ -1, 256 ]", "[ -1, 10 ]").get("max_batch_size", 0) == 0
    with pytest.raises(ConfigError, match="contradict each other"):
        config("[ 256 ]", "[ -1, 10 ]")


@pytest.mark.parametrize(("tensors", "message"), [
    ('input [ { name: "words", data_type: TYPE_FP32, dims: [ 2 ] }, '
     '{ name: "scale", data_type: TYPE_FP32, dims: [ 1 ] } ]', "input 'words': the config says TYPE_FP32, "
     "the model TYPE_STRING"),
    ('input [ { name: "word", data_type: TYPE_STRING, dims: [ 2 ] }, '
     '{ name: "scale", data_type: TYPE_FP32, dims: [ 1 ] } ]', "input 'word' is not one of the model's; "
     "allowed inputs are: scale, words"),
    ('input [ { name: "words", data_type: TYPE_STRING, dims: [ 3 ] }, '
     '{ name: "scale", data_type: TYPE_FP32, dims: [ 1 ] } ]', "the model's shape [-1, 2] does not match "
     "the config's [-1, 3]"),
    ('input [ { name: "words", data_type: TYPE_STRING, dims: [ 2 ] } ]', "the model's input scale is not "
     "in the config"),
])
def test_a_config_that_disagrees_with_the_signature_is_a_config_error(repo: Path, tmp_path: Path,
                                                                       tensors: str, message: str) -> None:
    # as for ONNX, and Triton: it used to load READY, and every request failed in the signature's call
    folder = tmp_path / "text"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "exported").symlink_to(repo / "text" / "1" / "exported")
    outputs = ('output [ { name: "upper", data_type: TYPE_STRING, dims: [ 2 ] }, '
               '{ name: "lengths", data_type: TYPE_FP32, dims: [ 2 ] } ]')
    (folder / "config.pbtxt").write_text(TEXT + tensors + "\n" + outputs + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_model(folder)
    good = ('input [ { name: "words", data_type: TYPE_STRING, dims: [ 2 ] }, '
            '{ name: "scale", data_type: TYPE_FP32, dims: [ 1 ] } ]')
    (folder / "config.pbtxt").write_text(TEXT + good + "\n" + outputs + "\n")
    assert [t["name"] for t in load_model(folder).config["input"]] == ["words", "scale"]


@pytest.mark.parametrize(("kind", "accelerators", "message"), [
    ("GPU", 'gpu_execution_accelerator [ { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ]',
     "execution accelerator 'tensorrt' is not applied by Despina's tensorflow backend"),
    ("GPU", 'gpu_execution_accelerator [ { name: "gpu_io" }, { name: "auto_mixed_precision" } ]',
     "execution accelerator 'auto_mixed_precision' is not applied"),
    ("GPU", 'gpu_execution_accelerator [ { name: "openvino" } ]', "unknown Execution Accelerator 'openvino'"),
    ("CPU", 'cpu_execution_accelerator [ { name: "openvino" } ]', "unknown Execution Accelerator 'openvino'"),
    ("CPU", 'gpu_execution_accelerator [ { name: "tensorrt" } ] cpu_execution_accelerator [ { name: "gpu_io" } ]',
     "unknown Execution Accelerator 'gpu_io'"),
])
def test_an_accelerator_it_does_not_apply_is_the_load_error(repo: Path, tmp_path: Path, kind: str,
                                                            accelerators: str, message: str) -> None:
    """Through the control plane's reading of the config and a real load on this machine's CPU where the
    instance is one; a GPU instance's check runs before TensorFlow would look for the GPU."""
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.savedmodel").symlink_to(repo / "mlp_savedmodel" / "1" / "model.savedmodel")
    (folder / "config.pbtxt").write_text(MLP.replace('"mlp_savedmodel"', '"m"')
                                         + f"optimization {{ execution_accelerators {{ {accelerators} }} }}\n")
    spec = ModelSpec.from_config(load_model(folder).config)
    with pytest.raises(ConfigError, match=f"model 'm': {message}"):
        backend_class("tensorflow")(spec, folder / "1", Instance("m_0", kind)).load()


def test_gpu_io_and_gpu_accelerators_on_a_cpu_instance_are_taken(repo: Path, tmp_path: Path) -> None:
    config = {"optimization": {"execution_accelerators": {"gpu_execution_accelerator": [
        {"name": "gpu_io"}, {"name": "tensorrt"}]}}}
    check_accelerators("m", config, "CPU")  # not consulted there, as in Triton
    check_accelerators("m", {"optimization": {"execution_accelerators": {"gpu_execution_accelerator": [
        {"name": "gpu_io"}]}}}, "GPU")
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.savedmodel").symlink_to(repo / "mlp_savedmodel" / "1" / "model.savedmodel")
    (folder / "config.pbtxt").write_text(MLP.replace('"mlp_savedmodel"', '"m"') + 'optimization { '
                                         'execution_accelerators { gpu_execution_accelerator [ { name: '
                                         '"tensorrt" } ] } }\n')
    backend = backend_class("tensorflow")(ModelSpec.from_config(load_model(folder).config), folder / "1",
                                          Instance("m_0"))
    backend.load()
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_allclose(backend.execute({"x": x}, ["y"])["y"], mlp_numpy(x), rtol=1e-4, atol=1e-5)
    backend.unload()


def test_tensors_listed_by_name_alone_are_filled_from_the_signature(repo: Path, tmp_path: Path) -> None:
    """Triton's auto-complete: the outputs a config lists are completed (datatype, dims) and the others
    left out; it used to be the load error "the config says TYPE_INVALID", and an output listed without
    dims was served with none, which Triton refuses."""
    folder = tmp_path / "text"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "exported").symlink_to(repo / "text" / "1" / "exported")
    (folder / "config.pbtxt").write_text(TEXT + 'input [ { name: "words" }, { name: "scale", data_type: TYPE_FP32 '
                                         '} ]\noutput [ { name: "lengths" } ]\n')
    config = load_model(folder).config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("words", "TYPE_STRING", [2]), ("scale", "TYPE_FP32", [1])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("lengths", "TYPE_FP32", [2])]
    backend = backend_class("tensorflow")(ModelSpec.from_config(config), folder / "1", Instance("text_0"))
    backend.load()
    out = backend.execute({"words": np.array([[b"ab", b"c"]], dtype=object),
                           "scale": np.array([[2.0]], dtype=np.float32)}, ["lengths"])
    assert out["lengths"].tolist() == [[4.0, 2.0]]
    backend.unload()
