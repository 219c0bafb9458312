"""torch.export programs (model.pt2) as auto-complete fills their config and as they run: the outputs are
named from what forward() returns (a dict's keys; otherwise OUTPUT__<i> for each tensor of it, nested tuples
and lists flattened in order), and the batch dimension's bound in the program caps max_batch_size. Models
are built here with torch."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from despina.contract.errors import ConfigError, InvalidArgument
from despina.control.repository import load_model

from .test_pytorch_parameters import load_backend

torch = pytest.importorskip("torch")


class AsDict(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"plus": x + 1, "times": x * 2}


class Nested(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return x + 1, (x * 2, x * 3)


def exported(tmp_path: Path, module: torch.nn.Module, config: str = "", batch: Any = None,
             dims: dict[int, Any] | None = None) -> Path:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    batch = torch.export.Dim("batch", max=64) if batch is None else batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, (torch.ones(2, 3),), dynamic_shapes=({0: batch, **(dims or {})},))
        torch.export.save(program, str(folder / "1" / "model.pt2"))
    (folder / "config.pbtxt").write_text('name: "m"\nplatform: "pytorch_libtorch"\n' + config)
    return folder


X = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_a_program_returning_a_dict_is_completed_with_its_keys(tmp_path: Path) -> None:
    folder = exported(tmp_path, AsDict())
    assert [t["name"] for t in load_model(folder).config["output"]] == ["plus", "times"]
    out = load_backend(folder).execute({"x": X}, ["times", "plus"])
    np.testing.assert_array_equal(out["plus"], X + 1)
    np.testing.assert_array_equal(out["times"], X * 2)


def test_nested_results_are_flattened_in_order(tmp_path: Path) -> None:
    folder = exported(tmp_path, Nested())
    names = ["OUTPUT__0", "OUTPUT__1", "OUTPUT__2"]
    assert [t["name"] for t in load_model(folder).config["output"]] == names
    out = load_backend(folder).execute({"x": X}, names)
    for name, expected in zip(names, (X + 1, X * 2, X * 3)):
        np.testing.assert_array_equal(out[name], expected)


def test_the_programs_batch_bound_caps_max_batch_size(tmp_path: Path) -> None:
    """A program exported with Dim("batch", max=2) fails a batch of 3 ("Guard failed"): auto-complete
    chooses max_batch_size 2 rather than Triton's default 4, and a config asking for more is a load error."""
    folder = exported(tmp_path / "auto", AsDict(), batch=torch.export.Dim("batch", max=2))
    assert load_model(folder).config["max_batch_size"] == 2
    folder = exported(tmp_path / "more", AsDict(), "max_batch_size: 8\n", torch.export.Dim("batch", max=2))
    with pytest.raises(ConfigError, match="max_batch_size 8 .* at most 2"):
        load_backend(folder)


class Total(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


def test_a_scalar_output_is_completed_as_dims_1_and_served_in_them(tmp_path: Path) -> None:
    """A program returning a scalar (rank 0) is completed as onnxruntime's is (Triton's way): dims [1],
    without batching; its answer then comes back in the shape [1] the model's metadata gives, not []."""
    folder = exported(tmp_path, Total())
    config = load_model(folder).config
    assert not config.get("max_batch_size") and [t["dims"] for t in config["output"]] == [[1]]
    out = load_backend(folder).execute({"x": X}, ["OUTPUT__0"])["OUTPUT__0"]
    assert out.shape == (1,) and out.tolist() == [15.0]


def test_a_shape_outside_the_programs_ranges_is_the_requests_error(tmp_path: Path) -> None:
    """The config's -1 lets any size through to the program; one outside the range it was exported for
    fails its guard before it runs: the request's error (400), saying so, not the model's (500)."""
    folder = exported(tmp_path, Total(), dims={1: torch.export.Dim("width", max=16)})
    assert [t["dims"] for t in load_model(folder).config["input"]] == [[-1, -1]]
    backend = load_backend(folder)
    assert backend.execute({"x": np.ones((2, 16), np.float32)}, ["OUTPUT__0"])["OUTPUT__0"].tolist() == [32.0]
    with pytest.raises(InvalidArgument, match=r"outside the shapes .* exported for: Guard failed: x.size\(\)\[1\] <= 16"):
        backend.execute({"x": np.ones((2, 17), np.float32)}, ["OUTPUT__0"])


class DictIn(torch.nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["a"] - inputs["b"]


class TupleIn(torch.nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] - pair[1]


class KeywordIn(torch.nn.Module):
    def forward(self, a: torch.Tensor, *, b: torch.Tensor) -> torch.Tensor:
        return a - b


@pytest.mark.parametrize(("module", "args", "kwargs", "names"), [
    (DictIn(), ({"a": "A", "b": "B"},), {}, ["inputs_a", "inputs_b"]),
    (TupleIn(), (("A", "B"),), {}, ["pair_0", "pair_1"]),
    (KeywordIn(), ("A",), {"b": "B"}, ["a", "b"]),
])
def test_inputs_in_a_dict_a_tuple_or_a_keyword_are_the_programs_flat_inputs(
        tmp_path: Path, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
        names: list[str]) -> None:
    """A program's inputs are its graph's, one per tensor (a dict's or tuple's flattened, as torch names
    them, keyword-only arguments by name): auto-complete lists those, and a request's go back into the
    structure forward() takes."""
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    batch = torch.export.Dim("batch", max=64)
    tensors = {"A": torch.ones(2, 3), "B": torch.ones(2, 3)}
    build = torch.utils._pytree.tree_map
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, build(tensors.get, args), build(tensors.get, kwargs),
                                      dynamic_shapes=build(lambda _: {0: batch}, (*args, *kwargs.values())))
        torch.export.save(program, str(folder / "1" / "model.pt2"))
    (folder / "config.pbtxt").write_text('name: "m"\nplatform: "pytorch_libtorch"\n')
    assert [t["name"] for t in load_model(folder).config["input"]] == names
    out = load_backend(folder).execute({names[0]: X, names[1]: X * 3}, ["OUTPUT__0"])["OUTPUT__0"]
    np.testing.assert_array_equal(out, X - X * 3)


class TwoArgs(torch.nn.Module):
    def forward(self, X: torch.Tensor, Mask: torch.Tensor) -> torch.Tensor:  # noqa: N803
        return X * Mask + 10 * Mask


class AsOrderedDict(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        from collections import OrderedDict

        return OrderedDict(plus=x + 1, times=x * 2)


class WithConstant(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale


def test_inputs_bind_by_forwards_own_names_whatever_the_configs_order(tmp_path: Path) -> None:
    """torch names the graph's inputs in lower case (`x`, `mask`): a config naming forward()'s `X` and
    `Mask` in another order was bound by its order, each tensor going in as the other, silently."""
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(TwoArgs(), (torch.ones(2, 3), torch.ones(2, 3)))
        torch.export.save(program, str(folder / "1" / "model.pt2"))
    tensor = 'data_type: TYPE_FP32 dims: [ 2, 3 ]'
    (folder / "config.pbtxt").write_text(
        f'name: "m"\nplatform: "pytorch_libtorch"\nmax_batch_size: 0\ninput [ {{ name: "Mask" {tensor} }}, '
        f'{{ name: "X" {tensor} }} ]\noutput [ {{ name: "OUTPUT__0" {tensor} }} ]\n')
    mask = np.array([[1, 0, 1], [0, 1, 0]], np.float32)
    out = load_backend(folder).execute({"X": X, "Mask": mask}, ["OUTPUT__0"])
    np.testing.assert_array_equal(out["OUTPUT__0"], X * mask + 10 * mask)


def test_a_program_returning_an_ordered_dict_serves_its_flattened_outputs(tmp_path: Path) -> None:
    """An OrderedDict is named OUTPUT__<i> (not a plain dict), but its results were looked up by its keys:
    every request failed ("returned no OUTPUT__0")."""
    folder = exported(tmp_path, AsOrderedDict())
    assert [t["name"] for t in load_model(folder).config["output"]] == ["OUTPUT__0", "OUTPUT__1"]
    out = load_backend(folder).execute({"x": X}, ["OUTPUT__0", "OUTPUT__1"])
    np.testing.assert_array_equal(out["OUTPUT__0"], X + 1)
    np.testing.assert_array_equal(out["OUTPUT__1"], X * 2)


def test_a_program_exported_with_a_constant_argument_is_a_clear_load_error(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(WithConstant(), (torch.ones(2, 3), 3.0))
        torch.export.save(program, str(folder / "1" / "model.pt2"))
    (folder / "config.pbtxt").write_text('name: "m"\nplatform: "pytorch_libtorch"\n')
    with pytest.raises(ConfigError, match="constant argument"):
        load_model(folder)
