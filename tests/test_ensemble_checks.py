"""A worker that runs an ensemble checks each step's inputs against the step's model once per shape
(workers/ensembles.py _HostRun.check): what that check refuses is still refused, whatever passed before."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from despina.contract.ensemble import Ensemble
from despina.contract.errors import InvalidArgument
from despina.contract.keys import Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.records import InferRequest, Tensor
from despina.workers.ensembles import EnsembleHost, _HostRun
from despina.workers.redelivery import DeliveryPolicy


def config(name: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"name": name, "max_batch_size": 8, "input": inputs, "output": outputs, **more}


def tensor(name: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "data_type": "TYPE_FP32", "dims": dims}


ENSEMBLE = config("pair", [tensor("x", [4])], [tensor("y", [4])], platform="ensemble", ensemble_scheduling={
    "step": [{"model_name": "add", "model_version": -1, "input_map": {"a": "x"}, "output_map": {"b": "y"}}]})


def rows(n: int, width: int = 4) -> Tensor:
    return Tensor("x", "FP32", (n, width), np.zeros((n, width), np.float32).tobytes())


@pytest.mark.parametrize("dims", [[4], [-1]])
def test_a_step_input_that_does_not_fit_is_refused_after_ones_that_did(dims: list[int]) -> None:
    """The same step's inputs of another shape, or against a reloaded model's spec, are checked anew."""
    spec = ModelSpec.from_config(ENSEMBLE)
    ensemble = Ensemble.from_config(ENSEMBLE)
    host = EnsembleHost(None, Keys("checks"), spec, ensemble, 1, lambda step: None,  # type: ignore[arg-type]
                        "consumer", DeliveryPolicy())
    step = ensemble.steps[0]
    model = ModelSpec.from_config(config("add", [tensor("a", dims)], [tensor("b", [4])]))

    def inputs(x: Tensor, spec: ModelSpec = model) -> list[Tensor]:
        run = _HostRun(host, InferRequest("r", "gw", 1e12, (x,)), ("s", b"1-0"), 0.0)
        run.tensors = {"x": x}
        return run.step_inputs(step, spec)

    assert [t.name for t in inputs(rows(2))] == ["a"]
    assert [t.shape for t in inputs(rows(2))] == [(2, 4)]
    with pytest.raises(InvalidArgument, match="batch size 9 is outside 1..8"):
        inputs(rows(9))
    if dims == [4]:
        with pytest.raises(InvalidArgument, match=r"shape \[2, 5\] does not match"):
            inputs(rows(2, 5))
    narrower = ModelSpec.from_config(config("add", [tensor("a", [3])], [tensor("b", [4])]))
    with pytest.raises(InvalidArgument, match=r"shape \[2, 4\] does not match"):
        inputs(rows(2), narrower)
    assert inputs(rows(2))[0].shape == (2, 4)
