"""How a config's inputs bind to a TorchScript model's forward() arguments, as Triton's PyTorch backend
rules them (src/model_instance_state.cc, GetNamingConvention and AddInputToMap):
1. every config input is a forward() argument name: bind by name;
2. else every name is `<name>__<index>`, the index being all that follows the first "__" and all
   digits: bind by index;
3. else the config order is the argument order (a mix of the two conventions ends here).
The same index rule places outputs. Models are built here with torch and loaded by the real backend.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from despina.contract.errors import ConfigError
from despina.contract.modelspec import ModelSpec
from despina.control.repository import load_model
from despina.workers.backends import Instance, backend_class

torch = pytest.importorskip("torch")


class Pair(torch.nn.Module):
    def forward(self, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return first * 10 + second, first - second


def pair(tmp_path: Path, name: str, inputs: tuple[str, str], outputs: tuple[str, str] = ("OUTPUT__0", "OUTPUT__1")
         ) -> Any:
    """The Pair model with the config listing `inputs` and `outputs` in this order."""
    folder = tmp_path / name
    (folder / "1").mkdir(parents=True)
    tensors = "input [ {} ]\noutput [ {} ]\n".format(*(
        ", ".join(f'{{ name: "{n}", data_type: TYPE_INT64, dims: [ 1 ] }}' for n in names)
        for names in (inputs, outputs)))
    (folder / "config.pbtxt").write_text(f'platform: "pytorch_libtorch"\nmax_batch_size: 4\n{tensors}')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Pair()).save(str(folder / "1" / "model.pt"))
    spec = ModelSpec.from_config(load_model(folder).config)
    backend = backend_class("pytorch")(spec, folder / "1", Instance(f"{name}_0"))
    backend.load()
    return backend


def run(backend: Any, values: dict[str, int], outputs: tuple[str, str] = ("OUTPUT__0", "OUTPUT__1")
        ) -> list[int]:
    out = backend.execute({k: np.array([[v]], np.int64) for k, v in values.items()}, list(outputs))
    backend.unload()
    return [int(out[name][0, 0]) for name in outputs]


def test_forward_argument_names_bind_by_name(tmp_path: Path) -> None:
    assert run(pair(tmp_path, "named", ("second", "first")), {"first": 1, "second": 2}) == [12, -1]


def test_indexed_names_bind_by_index(tmp_path: Path) -> None:
    assert run(pair(tmp_path, "indexed", ("x__1", "y__0")), {"y__0": 1, "x__1": 2}) == [12, -1]


def test_a_mix_of_conventions_binds_in_config_order(tmp_path: Path) -> None:
    """An argument name beside an indexed one: neither rule holds for every input, so Triton enforces the
    config order, whatever the names say ("second" listed first is forward()'s first argument)."""
    assert run(pair(tmp_path, "mixed", ("second", "INPUT__0")), {"second": 1, "INPUT__0": 2}) == [12, -1]


def test_the_index_is_what_follows_the_first_double_underscore(tmp_path: Path) -> None:
    """Triton reads the index after the first "__": in `a__x__1` that is `x__1`, not a number, so these
    names bind in config order (and outputs named so are placed in config order)."""
    backend = pair(tmp_path, "doubled", ("a__x__1", "b__x__0"), ("p__y__1", "q__y__0"))
    assert run(backend, {"a__x__1": 1, "b__x__0": 2}, ("p__y__1", "q__y__0")) == [12, -1]


def test_indexes_that_do_not_number_the_arguments_are_a_load_error(tmp_path: Path) -> None:
    """Triton would index past its argument vector (or leave an argument unset) with INPUT__0 and INPUT__2
    for two arguments; Despina refuses the load instead."""
    with pytest.raises(ConfigError, match=r"input names ending in __<i> must number 0..1"):
        pair(tmp_path, "gap", ("INPUT__0", "INPUT__2"))
