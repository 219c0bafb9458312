"""Triton's `reshape` of an input or output: the shape the model itself takes or gives (without the batch
dimension), where the config's `dims` are what clients send and get back.

Triton reshapes every input before a backend sees it and hands every output back in `dims`; so does the
worker, around each call of a backend (the warmup samples' included). A config with no reshape costs
nothing: `Reshapes.of` is None.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..contract.errors import Code, DespinaError
from ..contract.modelspec import ModelSpec, reshaped

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (the shape as it comes, the shape it goes out as)


@dataclass(frozen=True, slots=True)
class Reshapes:
    model: str
    batched: bool
    inputs: dict[str, Layout]   # input name -> (dims, reshape)
    outputs: dict[str, Layout]  # output name -> (reshape, dims)

    @classmethod
    def of(cls, spec: ModelSpec) -> Reshapes | None:
        inputs = {t.name: (t.dims, t.reshape) for t in spec.inputs if t.reshape is not None}
        outputs = {t.name: (t.reshape, t.dims) for t in spec.outputs if t.reshape is not None}
        if not inputs and not outputs:
            return None
        return cls(spec.name, spec.batched, inputs, outputs)

    def to_model(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A request's or a batch's inputs, as the model takes them."""
        return self._apply(inputs, self.inputs, "input")

    def from_model(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs, as the config's `dims` say clients get them."""
        return self._apply(outputs, self.outputs, "output")

    def _apply(self, arrays: dict[str, np.ndarray], layouts: dict[str, Layout], kind: str
               ) -> dict[str, np.ndarray]:
        out = copy.copy(arrays)  # of its type: a Request or Outputs keeps its parameters (backends.base)
        for name, (source, target) in layouts.items():
            array = out.get(name)
            if array is None:
                continue
            lead = array.shape[:1] if self.batched else ()
            try:
                out[name] = array.reshape(lead + reshaped(array.shape[len(lead):], source, target))
            except ValueError:
                raise DespinaError(f"model '{self.model}': {kind} '{name}' of shape {list(array.shape)} "
                                   f"cannot take the shape {list(target)} its config gives it "
                                   f"(reshape)", Code.BACKEND if kind == "output" else Code.INVALID_ARGUMENT
                                   ) from None  # an input's is refused at the gateway (check_shape)
        return out

