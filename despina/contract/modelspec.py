"""A model's spec: what gateways and workers need of its config (ModelSpec, TensorSpec), rebuilt from
the config's JSON form (modelconfig.py), and the checks a request's tensors meet against it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .batchio import BatchInputSpec, BatchOutputSpec, batch_inputs, batch_outputs
from .datatypes import CONFIG_TO_V2
from .errors import InvalidArgument
from .policy import BatchPolicy, batch_policy
from .sequence import SequencePolicy, sequence_policy


def _reshape_of(tensor: dict[str, Any]) -> tuple[int, ...] | None:
    """A tensor's reshape in the JSON form (present, maybe empty, only when the config sets it)."""
    if "reshape" not in tensor:
        return None
    return tuple(int(d) for d in (tensor["reshape"] or {}).get("shape", []))


def _count(dims: Any) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str             # V2 name
    dims: tuple[int, ...]     # without the batch dimension
    optional: bool = False
    reshape: tuple[int, ...] | None = None  # the shape the model itself has (Triton's reshape), if other
    ragged: bool = False      # allow_ragged_batch: batched whatever its shape, given flat (workers/ragged.py)

    def metadata(self, batched: bool) -> dict[str, Any]:
        shape = [-1, *self.dims] if batched else list(self.dims)
        return {"name": self.name, "datatype": self.datatype, "shape": shape}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What gateways and workers need of a model's config, rebuilt from its JSON form."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    policy: BatchPolicy
    config: dict[str, Any]
    by_name: dict[str, TensorSpec] = field(default_factory=dict, repr=False, compare=False)
    sequence: SequencePolicy | None = None  # sequence_batching: a stateful model (contract/sequence.py)
    decoupled: bool = False  # it answers a request through a response sender, any number of times
    response_cache: bool = False  # response_cache { enable: true }: gateways keep its answers (cache.py)
    batch_inputs: tuple[BatchInputSpec, ...] = ()
    batch_outputs: tuple[BatchOutputSpec, ...] = ()
    batched: bool = field(init=False, repr=False, compare=False)  # a batch dimension: max_batch_size > 0

    def __post_init__(self) -> None:
        # (a field, not a property: read for every request, a property's call cost more than the rest)
        object.__setattr__(self, "batched", self.max_batch_size > 0)
        # inputs and outputs by name ("in:x", "out:y"): looked up for every request
        self.by_name.update({f"in:{t.name}": t for t in self.inputs})
        self.by_name.update({f"out:{t.name}": t for t in self.outputs})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelSpec:
        def tensors(items: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
            return tuple(
                TensorSpec(t["name"], CONFIG_TO_V2[t.get("data_type", "TYPE_FP32")],
                           tuple(int(d) for d in t.get("dims", [])), bool(t.get("optional", False)),
                           _reshape_of(t), bool(t.get("allow_ragged_batch", False)))
                for t in items)


        return cls(config["name"], config.get("platform", ""), config.get("backend", ""),
                   int(config.get("max_batch_size", 0)), tensors(config.get("input", [])),
                   tensors(config.get("output", [])), batch_policy(config), config,
                   sequence=sequence_policy(config),
                   decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled", False)),
                   response_cache=bool(config.get("response_cache", {}).get("enable", False)),
                   batch_inputs=batch_inputs(config), batch_outputs=batch_outputs(config))

    def input(self, name: str) -> TensorSpec | None:
        return self.by_name.get(f"in:{name}")

    def output(self, name: str) -> TensorSpec | None:
        return self.by_name.get(f"out:{name}")

    def instance_count(self) -> int:
        """The instances that take requests (a passive group's are loaded and take none)."""
        groups = self.config.get("instance_group") or [{"count": 1}]
        return max(1, sum(int(g.get("count", 1)) for g in groups if not g.get("passive", False)))

    def metadata(self, versions: list[int]) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [str(v) for v in versions],
            "platform": self.platform or self.backend,
            "inputs": [t.metadata(self.batched) for t in self.inputs],
            "outputs": [t.metadata(self.batched) for t in self.outputs],
        }


# -- a request's tensors against the spec ----------------------------------------------------------

def known_input(spec: ModelSpec, name: str) -> TensorSpec:
    """The model's input `name`, or the error a client gets for naming one it lacks."""
    expected = spec.input(name)
    if expected is None:
        known = ", ".join(t.name for t in spec.inputs)
        raise InvalidArgument(f"model '{spec.name}' has no input '{name}' (inputs: {known})")
    return expected


def check_datatype(expected: TensorSpec, datatype: Any) -> None:
    if datatype != expected.datatype:
        raise InvalidArgument(f"input '{expected.name}': datatype {datatype!r} given, the model expects "
                              f"{expected.datatype}")


def known_output(spec: ModelSpec, name: str) -> None:
    """The error a client gets for asking for an output the model lacks."""
    if spec.output(name) is None:
        known = ", ".join(t.name for t in spec.outputs)
        raise InvalidArgument(f"unexpected inference output '{name}' for model '{spec.name}' "
                              f"(outputs: {known})")


def check_shape(spec: ModelSpec, expected: TensorSpec, shape: list[int]) -> None:
    dims = list(expected.dims)
    if spec.batched:
        if len(shape) != len(dims) + 1:
            raise InvalidArgument(f"input '{expected.name}': shape {shape} has {len(shape)} dimensions; "
                                  f"the model expects {len(dims) + 1} ([batch, {', '.join(map(str, dims))}])")
        if shape[0] < 1 or shape[0] > spec.max_batch_size:
            raise InvalidArgument(f"input '{expected.name}': batch size {shape[0]} is outside "
                                  f"1..{spec.max_batch_size} (max_batch_size)")
        rest = shape[1:]
    else:
        rest = shape
        if len(shape) != len(dims):
            raise InvalidArgument(f"input '{expected.name}': shape {shape} does not match the model's "
                                  f"{dims}")
    for got, want in zip(rest, dims):
        if want != -1 and got != want:
            expect = ([-1] if spec.batched else []) + dims
            raise InvalidArgument(f"input '{expected.name}': shape {shape} does not match the model's "
                                  f"{expect}")
    if expected.reshape is not None and -1 in dims and not _fits(rest, expected.dims, expected.reshape):
        raise InvalidArgument(f"input '{expected.name}': shape {shape} cannot take the shape "
                              f"{list(expected.reshape)} the model has (reshape)")


def reshaped(shape: tuple[int, ...], source: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` (laid out as `source`, -1 where sizes are open) as `target` (Triton's reshape, the batch
    dimension left out): a lone -1 of `target` is left for numpy to work out; several take the open sizes
    of `shape` in order (the config's check keeps their counts equal)."""
    if target.count(-1) == 1:
        return target
    sizes = [size for size, d in zip(shape, source) if d == -1] if len(shape) == len(source) else []
    open_sizes = iter(sizes)
    return tuple(next(open_sizes, -1) if d == -1 else d for d in target)


def _fits(shape: list[int], source: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` can take the shape `target` (as numpy.reshape would)."""
    count = _count(shape)
    want = reshaped(tuple(shape), source, target)
    fixed = _count([d for d in want if d != -1])
    return count == fixed if -1 not in want else fixed > 0 and count % fixed == 0


def check_inputs(spec: ModelSpec, inputs: Sequence[Any]) -> None:
    """Every input the model needs is given (tensors with .name and .shape), one batch size for all."""
    given = {t.name for t in inputs}
    missing = [t.name for t in spec.inputs if not t.optional and t.name not in given]
    if missing:
        raise InvalidArgument(f"model '{spec.name}' needs input(s) {', '.join(missing)}")
    if spec.batched and len({t.shape[0] for t in inputs}) > 1:
        raise InvalidArgument("all inputs must have the same batch size")
