"""Builds the example models (and the test models) in code: nothing is downloaded.

    python -m despina.examples [REPOSITORY]     # default ./model_repository, every installed framework

ONNX models are built with onnx.helper; the TorchScript, torch.export and TensorFlow examples are the
same reference MLP, built when torch / tensorflow is installed and skipped with a note otherwise.
The Python example needs no building: its model.py is committed next to its config.pbtxt.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Collection
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from onnx import ModelProto

D_IN, D_HIDDEN, D_OUT = 256, 1024, 10


def mlp_weights(seed: int = 0) -> tuple[np.ndarray, ...]:
    """The reference MLP's weights: the same as the peers' benchmark model (numpy seed 0)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((D_IN, D_HIDDEN)) * 0.05).astype(np.float32)
    b1 = (rng.standard_normal((D_HIDDEN,)) * 0.01).astype(np.float32)
    w2 = (rng.standard_normal((D_HIDDEN, D_OUT)) * 0.05).astype(np.float32)
    b2 = (rng.standard_normal((D_OUT,)) * 0.01).astype(np.float32)
    return w1, b1, w2, b2


def mlp_numpy(x: np.ndarray) -> np.ndarray:
    w1, b1, w2, b2 = mlp_weights()
    return (np.maximum(x @ w1 + b1, 0.0) @ w2 + b2).astype(np.float32)


def save_onnx(model: ModelProto, path: Path) -> None:
    """Check an ONNX model and write it to `path` (its folders made), at IR version 8."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build_mlp(path: Path, layers: tuple[int, ...] = (D_IN, D_HIDDEN, D_OUT), seed: int = 0) -> None:
    """float32 [N, 256] -> 1024 relu -> 10 (input x, output y); other layer sizes for heavier models."""
    from onnx import TensorProto, helper, numpy_helper

    if layers == (D_IN, D_HIDDEN, D_OUT) and seed == 0:
        weights = list(mlp_weights())
    else:
        rng = np.random.default_rng(seed)
        weights = []
        for n_in, n_out in zip(layers, layers[1:]):
            weights += [(rng.standard_normal((n_in, n_out)) * (1 / np.sqrt(n_in))).astype(np.float32),
                        (rng.standard_normal((n_out,)) * 0.01).astype(np.float32)]
    inits, nodes, prev = [], [], "x"
    for i in range(len(layers) - 1):
        w, b = weights[2 * i], weights[2 * i + 1]
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(layers) - 2
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], ["y" if last else f"a{i}"])]
        if not last:
            nodes.append(helper.make_node("Relu", [f"a{i}"], [f"h{i}"]))
            prev = f"h{i}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", layers[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", layers[-1]])], inits)
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def build_add_sub(path: Path, dims: int = 4) -> None:
    """Two FP32 inputs a, b [N, dims] -> sum = a + b, diff = a - b (Triton's classic example)."""
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", dims]) for n in ("a", "b")]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", dims]) for n in ("sum", "diff")]
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Sub", ["a", "b"], ["diff"])]
    save_onnx(helper.make_model(helper.make_graph(nodes, "add_sub", io, out),
                            opset_imports=[helper.make_opsetid("", 17)]), path)


def build_identity(path: Path, onnx_type: int, dims: int = 3) -> None:
    """One input 'in' [N, dims] of any type -> 'out', the same values (for datatype tests)."""
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["in"], ["out"])], "identity",
        [helper.make_tensor_value_info("in", onnx_type, ["N", dims])],
        [helper.make_tensor_value_info("out", onnx_type, ["N", dims])])
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _torch_mlp() -> Any:
    """The reference MLP as a torch module (forward(x) -> y), in eval mode, without gradients."""
    import torch

    w1, b1, w2, b2 = (torch.from_numpy(w) for w in mlp_weights())

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = torch.nn.Linear(D_IN, D_HIDDEN)
            self.out = torch.nn.Linear(D_HIDDEN, D_OUT)
            with torch.no_grad():
                self.hidden.weight.copy_(w1.T)
                self.hidden.bias.copy_(b1)
                self.out.weight.copy_(w2.T)
                self.out.bias.copy_(b2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.hidden(x)))

    return MLP().eval().requires_grad_(False)


def build_torchscript_mlp(path: Path) -> None:
    """The reference MLP as TorchScript (model.pt): INPUT__0 [N, 256] -> OUTPUT__0 [N, 10]."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # torch.jit is deprecated upstream; Triton users still ship it
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(_torch_mlp(), torch.zeros(2, D_IN))
        traced.save(str(path))


def build_torch_export_mlp(path: Path) -> None:
    """The reference MLP as a torch.export program (model.pt2) with a dynamic batch dimension."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(_torch_mlp(), (torch.zeros(2, D_IN),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(path))


def build_tf_mlp(path: Path) -> None:
    """The reference MLP as a TF SavedModel: serving_default takes x [N, 256] and returns y [N, 10]."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    weights = [tf.Variable(w) for w in mlp_weights()]

    class MLP(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.params = weights

        @tf.function(input_signature=[tf.TensorSpec([None, D_IN], tf.float32, name="x")])
        def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            w1, b1, w2, b2 = self.params
            return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2}

    module = MLP()
    path.parent.mkdir(parents=True, exist_ok=True)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


FRAMEWORKS = {"onnx": "onnx", "torch": "torch", "tensorflow": "tensorflow"}  # name -> module to find


def build_repository(root: Path, frameworks: Collection[str] = ("onnx",)) -> list[str]:
    """Build the example models of `frameworks` next to the committed config.pbtxt files.

    The default builds only the ONNX models (fast: the tests' repository). A framework that is not
    installed is skipped with a note; its models then show as UNAVAILABLE. Returns what was built.
    """
    built = []
    for framework in frameworks:
        if find_spec(FRAMEWORKS[framework]) is None:
            print(f"note: {framework} is not installed; skipping its example models "
                  f"(pip install despina[{'examples' if framework == 'onnx' else framework}])")
            continue
        if framework == "onnx":
            build_mlp(root / "mlp" / "1" / "model.onnx")
            build_add_sub(root / "add_sub" / "1" / "model.onnx")
        elif framework == "torch":
            build_torchscript_mlp(root / "mlp_torchscript" / "1" / "model.pt")
            build_torch_export_mlp(root / "mlp_torch_export" / "1" / "model.pt2")
        elif framework == "tensorflow":
            build_tf_mlp(root / "mlp_savedmodel" / "1" / "model.savedmodel")
        built.append(framework)
    return built


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m despina.examples",
        description="Build the example models' files (model.onnx, model.pt, ...) into a model repository; "
                    "their config.pbtxt files are the repository's own (model_repository/ in the source).")
    parser.add_argument("repository", nargs="?", default="model_repository", type=Path,
                        help="the folder to build into (default ./model_repository)")
    args = parser.parse_args(argv)
    done = build_repository(args.repository, tuple(FRAMEWORKS))
    print(f"built the {', '.join(done) or 'no'} example models in {args.repository}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
