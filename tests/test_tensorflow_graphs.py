"""Which MetaGraph and which signature of a SavedModel are served, as in Triton's TensorFlow backend: the
MetaGraph tagged exactly "serve" (parameter TF_GRAPH_TAG another), its "serving_default" signature
(TF_SIGNATURE_DEF another; with neither, the one serving signature it has). The SavedModels are built here
the way TensorFlow 1 exported them (SavedModelBuilder), the kind with several MetaGraphs; both the
control plane's auto-complete (no TensorFlow) and the backend's load read the same choice."""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from despina.contract.errors import ConfigError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.workers.backends import Instance, backend_class

tf = pytest.importorskip("tensorflow")

# (tags, {signature: (output key, factor)}): each MetaGraph and signature multiplies x by its own factor
GRAPHS = [(["serve"], {"serving_default": ("y", 2.0), "triple": ("y", 3.0)}),
          (["serve", "gpu"], {"serving_default": ("y", 7.0)}),
          (["train"], {"serving_default": ("z", 5.0)})]
ONLY_PREDICT = [(["serve"], {"predict": ("scores", 11.0)})]
TWO_NAMED = [(["serve"], {"predict": ("scores", 11.0), "classify": ("classes", 13.0)})]


def build(path: Path, graphs: list[tuple[list[str], dict[str, tuple[str, float]]]]) -> Path:
    v1 = tf.compat.v1
    with warnings.catch_warnings():  # TensorFlow 1's API warns that it is TensorFlow 1's
        warnings.simplefilter("ignore")
        builder = v1.saved_model.Builder(str(path))
        for i, (tags, signatures) in enumerate(graphs):
            with tf.Graph().as_default() as graph, v1.Session(graph=graph) as session:
                x = v1.placeholder(tf.float32, [None, 2], name="x")
                defs = {name: v1.saved_model.signature_def_utils.predict_signature_def(
                    {"x": x}, {key: tf.multiply(x, factor)}) for name, (key, factor) in signatures.items()}
                if i == 0:
                    builder.add_meta_graph_and_variables(session, tags, signature_def_map=defs)
                else:
                    builder.add_meta_graph(tags, signature_def_map=defs)
        builder.save()
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tf1")
    return {name: build(root / name, graphs) for name, graphs in
            (("graphs", GRAPHS), ("only_predict", ONLY_PREDICT), ("two_named", TWO_NAMED))}


def model(tmp_path: Path, savedmodel: Path, parameters: dict[str, str], tensors: str = "") -> Path:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.savedmodel").unlink(missing_ok=True)
    (folder / "1" / "model.savedmodel").symlink_to(savedmodel)
    text = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    (folder / "config.pbtxt").write_text(f'platform: "tensorflow_savedmodel"\nmax_batch_size: 4\n{text}{tensors}')
    return folder


def served(folder: Path) -> tuple[list[str], dict[str, Any]]:
    """The outputs auto-complete found, and what the backend answers for x = [[1, 1]]."""
    config = load_model(folder).config
    backend = backend_class("tensorflow")(ModelSpec.from_config(config), folder / "1", Instance("m_0"))
    backend.load()
    names = [t["name"] for t in config["output"]]
    out = backend.execute({"x": np.ones((1, 2), np.float32)}, names)
    backend.unload()
    return names, {k: v.tolist() for k, v in out.items()}


def test_several_metagraphs_serve_the_one_tagged_serve(saved: dict[str, Path], tmp_path: Path) -> None:
    """tf.saved_model.load alone refuses such a SavedModel ("requires a tags= argument")."""
    assert served(model(tmp_path, saved["graphs"], {})) == (["y"], {"y": [[2.0, 2.0]]})


def test_tf_graph_tag_picks_the_metagraph(saved: dict[str, Path], tmp_path: Path) -> None:
    assert served(model(tmp_path, saved["graphs"], {"TF_GRAPH_TAG": "train"})) == (["z"], {"z": [[5.0, 5.0]]})
    assert served(model(tmp_path, saved["graphs"], {"TF_GRAPH_TAG": "serve", "TF_SIGNATURE_DEF": "triple"})
                  ) == (["y"], {"y": [[3.0, 3.0]]})


def test_a_tag_no_metagraph_has_is_the_load_error(saved: dict[str, Path], tmp_path: Path) -> None:
    message = re.escape("no MetaGraph tagged exactly 'gpu' (its tag sets: [serve], [serve, gpu], [train])")
    with pytest.raises(ConfigError, match=message):
        load_model(model(tmp_path, saved["graphs"], {"TF_GRAPH_TAG": "gpu"}))
    folder = model(tmp_path, saved["graphs"], {"TF_GRAPH_TAG": "gpu"}, 'input [ { name: "x", data_type: TYPE_FP32, '
                   'dims: [ 2 ] } ]\noutput [ { name: "y", data_type: TYPE_FP32, dims: [ 2 ] } ]\n')
    backend = backend_class("tensorflow")(ModelSpec.from_config(load_model(folder).config), folder / "1",
                                          Instance("m_0"))
    with pytest.raises(ConfigError, match=message):
        backend.load()


def test_without_serving_default_its_one_serving_signature_is_served(saved: dict[str, Path], tmp_path: Path
                                                                      ) -> None:
    """As in Triton: a SavedModel exported with only, say, "predict" is served by it."""
    assert served(model(tmp_path, saved["only_predict"], {})) == (["scores"], {"scores": [[11.0, 11.0]]})
    assert served(model(tmp_path, saved["only_predict"], {"TF_SIGNATURE_DEF": ""})) == (
        ["scores"], {"scores": [[11.0, 11.0]]})


def test_without_serving_default_several_signatures_are_the_load_error(saved: dict[str, Path], tmp_path: Path
                                                                       ) -> None:
    """Triton would take whichever its map gives first; Despina says which there are."""
    with pytest.raises(ConfigError, match=re.escape("no signature 'serving_default' (it has: classify, predict); "
                                                    "name one with the parameter TF_SIGNATURE_DEF")):
        load_model(model(tmp_path, saved["two_named"], {}))
    assert served(model(tmp_path, saved["two_named"], {"TF_SIGNATURE_DEF": "classify"})) == (
        ["classes"], {"classes": [[13.0, 13.0]]})
