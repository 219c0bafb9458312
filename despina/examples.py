"""Builds the example models (and the test models) with onnx.helper: nothing is downloaded.

    python -m despina.examples [REPOSITORY]     # default ./model_repository
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

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


def _save(model: object, path: Path) -> None:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    model.ir_version = 8  # type: ignore[attr-defined]
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
        for a, b in zip(layers, layers[1:]):
            weights += [(rng.standard_normal((a, b)) * (1 / np.sqrt(a))).astype(np.float32),
                        (rng.standard_normal((b,)) * 0.01).astype(np.float32)]
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
    _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def build_add_sub(path: Path, dims: int = 4) -> None:
    """Two FP32 inputs a, b [N, dims] -> sum = a + b, diff = a - b (Triton's classic example)."""
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", dims]) for n in ("a", "b")]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", dims]) for n in ("sum", "diff")]
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Sub", ["a", "b"], ["diff"])]
    _save(helper.make_model(helper.make_graph(nodes, "add_sub", io, out),
                            opset_imports=[helper.make_opsetid("", 17)]), path)


def build_identity(path: Path, onnx_type: int, dims: int = 3) -> None:
    """One input 'in' [N, dims] of any type -> 'out', the same values (for datatype tests)."""
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["in"], ["out"])], "identity",
        [helper.make_tensor_value_info("in", onnx_type, ["N", dims])],
        [helper.make_tensor_value_info("out", onnx_type, ["N", dims])])
    _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def build_repository(root: Path) -> None:
    """The example repository: model files next to the committed config.pbtxt files."""
    build_mlp(root / "mlp" / "1" / "model.onnx")
    build_add_sub(root / "add_sub" / "1" / "model.onnx")


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "model_repository")
    build_repository(target)
    print(f"built example models in {target}")
