"""Triton's TensorFlow backend parameters for thread pools and sessions, with a real SavedModel.

TensorFlow sets its thread pools once per process, before its runtime starts: what the first load does
is seen in a fresh interpreter."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from despina.contract.errors import ConfigError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.workers.backends import Instance, backend_class

tf = pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def savedmodel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    class Double(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def serve(self, x: Any) -> dict[str, Any]:
            return {"y": x * 2}

    path = tmp_path_factory.mktemp("tfp") / "double"
    module = Double()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path


def model(root: Path, name: str, savedmodel: Path, parameters: dict[str, str]) -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.savedmodel").symlink_to(savedmodel)
    text = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    (folder / "config.pbtxt").write_text(f'platform: "tensorflow_savedmodel"\nmax_batch_size: 4\n{text}')
    return folder


@pytest.mark.parametrize(("key", "value", "message"), [
    ("TF_NUM_INTRA_THREADS", "two", "parameter TF_NUM_INTRA_THREADS must be an integer, got 'two'"),
    ("TF_NUM_INTER_THREADS", "-1", "parameter TF_NUM_INTER_THREADS must be >= 0, got -1"),
    ("MAX_SESSION_SHARE_COUNT", "0", "parameter MAX_SESSION_SHARE_COUNT must be >= 1, got 0"),
    ("TF_USE_PER_SESSION_THREADS", "sometimes", "parameter TF_USE_PER_SESSION_THREADS must be true or false"),
])
def test_a_parameter_triton_would_refuse_is_the_load_error(savedmodel: Path, tmp_path: Path, key: str,
                                                          value: str, message: str) -> None:
    folder = model(tmp_path, "bad", savedmodel, {key: value})
    backend = backend_class("tensorflow")(ModelSpec.from_config(load_model(folder).config), folder / "1",
                                          Instance("bad_0"))
    with pytest.raises(ConfigError, match=f"model 'bad': {message}"):
        backend.load()


def test_thread_counts_apply_at_the_first_load_and_later_ones_say_they_cannot(savedmodel: Path,
                                                                               tmp_path: Path) -> None:
    first = model(tmp_path, "first", savedmodel, {"TF_NUM_INTRA_THREADS": "2", "TF_NUM_INTER_THREADS": "3",
                                                  "TF_USE_PER_SESSION_THREADS": "true"})
    later = model(tmp_path, "later", savedmodel, {"TF_NUM_INTRA_THREADS": "1", "MAX_SESSION_SHARE_COUNT": "2"})
    script = textwrap.dedent(f"""
        import logging, sys
        from pathlib import Path
        import numpy as np
        from despina.contract.modelspec import ModelSpec
        from despina.control.repository import load_model
        from despina.workers.backends import Instance, backend_class
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        for folder in (Path({str(first)!r}), Path({str(later)!r})):
            b = backend_class("tensorflow")(ModelSpec.from_config(load_model(folder).config), folder / "1",
                                            Instance(folder.name + "_0", threads=1))
            b.load()
            print("y", b.execute({{"x": np.ones((1, 2), np.float32)}}, ["y"])["y"].tolist())
            if folder.name == "first":
                import tensorflow as tf
                print("threads", tf.config.threading.get_intra_op_parallelism_threads(),
                      tf.config.threading.get_inter_op_parallelism_threads())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=100)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "threads 2 3" in lines and lines.count("y [[2.0, 2.0]]") == 2
    warned = "\n".join(line for line in lines if line.startswith("model"))
    assert "model 'first': parameter TF_USE_PER_SESSION_THREADS has no effect" in warned
    assert ("model 'later': TF_NUM_INTRA_THREADS 1 has no effect: TensorFlow's thread pools are set once per "
            "process, and have 2 intra-op and 3 inter-op threads") in warned
    assert "model 'later': parameter MAX_SESSION_SHARE_COUNT has no effect" in warned
