"""The backend protocol: every framework sits behind this one small class.

A backend instance is one loaded copy of one model version. The worker calls `load()` once,
`execute()` for each batch (from a thread: it must not touch the event loop), and `unload()` once.
`auto_complete()` fills in what a config.pbtxt left out, from the model file, as Triton does.

A backend whose model answers each request on its own (Triton's Python backend) defines
`execute_requests()` instead of `execute()`: the worker then hands it the requests of a batch one by
one, unconcatenated, and takes one result per request, where an error fails only its own request.
A request with custom parameters or a V2 id comes as a `Request` (its inputs, and those), and a result
may be an `Outputs` carrying the model's response parameters; the others are plain dicts.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ...contract._schema import model_config_pb2 as pb
from ...contract.datatypes import to_numpy
from ...contract.errors import ConfigError, DespinaError, InvalidArgument
from ...contract.modelspec import ModelSpec
from ...contract.records import NO_PARAMETERS, InferRequest, Parameters

if TYPE_CHECKING:
    from ..bls import ModelCaller


@dataclass(frozen=True)
class Instance:
    """Where one instance runs: `kind` is "CPU", "GPU" or "MODEL"; `device` is the GPU index. A passive one
    is loaded and warmed up, and given no requests (Triton's `passive: true`). `group`: the index of its
    instance group."""

    name: str
    kind: str = "CPU"
    device: int = 0
    threads: int = 1
    passive: bool = False
    group: int = 0


class Request(dict[str, np.ndarray]):
    """A request's inputs by name, with its custom parameters, its V2 id, its place in a sequence
    (correlation ID, START|END flags; contract/sequence.py) and the timeout its client asked for in µs
    (0: none) (per_request backends)."""

    __slots__ = ("parameters", "request_id", "sequence", "timeout_us")

    def __init__(self, inputs: dict[str, np.ndarray], parameters: Parameters, request_id: str,
                 sequence: tuple[int | str, int] | None = None, timeout_us: int = 0) -> None:
        super().__init__(inputs)
        self.parameters = parameters
        self.request_id = request_id
        self.sequence = sequence
        self.timeout_us = timeout_us


class Outputs(dict[str, np.ndarray]):
    """A request's outputs by name, with the response parameters its model set (per_request backends)."""

    __slots__ = ("parameters",)

    def __init__(self, outputs: dict[str, np.ndarray], parameters: Parameters) -> None:
        super().__init__(outputs)
        self.parameters = parameters


# an execution's moments by name, as time.perf_counter_ns() gives them (execute_requests)
Marks = dict[str, int]


def request_inputs(req: InferRequest) -> dict[str, np.ndarray]:
    """A request's inputs as arrays; a Request when it has parameters, an id, a sequence or a timeout
    (else none is made)."""
    tensors = req.inputs
    if len(tensors) == 1:  # the usual case: no comprehension's frame (this runs for every request)
        t = tensors[0]
        inputs = {t.name: to_numpy(t.datatype, t.shape, t.data)}
    else:
        inputs = {t.name: t.numpy() for t in tensors}
    if req.parameters or req.request_id or req.sequence is not None or req.timeout_us:
        return Request(inputs, req.parameters, req.request_id, req.sequence, req.timeout_us)
    return inputs


def text_inputs(spec: ModelSpec, backend: type[Backend]) -> frozenset[str]:
    """The model's BYTES inputs that must hold UTF-8 text (Backend.text_only)."""
    if not backend.text_only:
        return frozenset()
    return frozenset(t.name for t in spec.inputs if t.datatype == "BYTES")


def check_text(inputs: Mapping[str, np.ndarray], names: frozenset[str]) -> None:
    """InvalidArgument when an element of one of the request's BYTES inputs `names` is not UTF-8."""
    for name in names & inputs.keys():
        for i, element in enumerate(inputs[name].reshape(-1)):
            try:
                element.decode()
            except UnicodeDecodeError as exc:
                why = f"{exc.reason} at byte {exc.start}"
                raise InvalidArgument(f"input '{name}': element {i} is not UTF-8 text ({why}), which this "
                                      "model's string tensors hold") from None


def response_parameters(result: dict[str, np.ndarray]) -> Parameters:
    """The response parameters a per_request backend's result carries (none: NO_PARAMETERS)."""
    return result.parameters if isinstance(result, Outputs) else NO_PARAMETERS


class Backend:
    """Subclass this for a framework; register it in `despina.backends` (an entry-point group)."""

    #: True when `execute_requests` is the entry point (one result per request) instead of `execute`.
    per_request: ClassVar[bool] = False
    #: True when it also has `execute_requests_async`, which the worker awaits on its event loop (the
    #: work happens in another process: no thread needed).
    awaitable: ClassVar[bool] = False
    #: How its model calls other models (workers/bls.py), set by the worker before load(); None: it cannot.
    caller: ModelCaller | None = None
    #: True when its BYTES inputs must be UTF-8 text (onnxruntime's string tensors): the worker refuses a
    #: request with other bytes there on its own, before it can fail a batch (text_inputs).
    text_only: ClassVar[bool] = False

    def __init__(self, spec: ModelSpec, version_dir: Path, instance: Instance) -> None:
        self.spec = spec
        self.version_dir = version_dir
        self.instance = instance

    def load(self) -> None:
        raise NotImplementedError

    def execute(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one batch: inputs by name, batch dimension first; return the asked outputs by name."""
        raise NotImplementedError

    def execute_requests(self, requests: Sequence[Mapping[str, np.ndarray]],
                         outputs: Sequence[Sequence[str]], marks: Marks | None = None
                         ) -> list[dict[str, np.ndarray] | DespinaError]:
        """Run the requests of one batch, each with its own inputs and asked outputs (per_request only).
        `marks`: where it may stamp (time.perf_counter_ns()) "input", once the requests are ready for
        its model, and "infer", once its model has answered: the statistics' compute input, infer and
        output (unstamped, the worker's call of it is the infer)."""
        raise NotImplementedError

    async def execute_requests_async(self, requests: Sequence[Mapping[str, np.ndarray]],
                                     outputs: Sequence[Sequence[str]], marks: Marks | None = None
                                     ) -> list[dict[str, np.ndarray] | DespinaError]:
        """execute_requests, awaited on the event loop (`awaitable` backends only)."""
        raise NotImplementedError

    def quick(self) -> bool:
        """Whether execute_requests_async may be used now: False while the backend first has to
        recover (a Python model's process restarting), which execute_requests does on a thread."""
        return True

    def unload(self) -> None:
        """Free what load() took. The default drops references and lets the collector work."""

    def custom_metrics(self) -> list[dict[str, Any]]:
        """The metric families the model made itself (a Python model's pb_utils.MetricFamily), as
        despina/custom_metrics.py reads them; none by default. Called on the event loop: quick."""
        return []

    @classmethod
    def auto_complete(cls, config: Any, version_dir: Path) -> None:
        """Fill missing inputs/outputs of `config` (a ModelConfig protobuf) from the model file."""

    @classmethod
    def gpu_available(cls) -> bool:
        return False

    @classmethod
    def gpu_count(cls) -> int:
        """GPUs this framework can use here; KIND_GPU instances must name one of them."""
        return visible_gpus() if cls.gpu_available() else 0

    def model_path(self) -> Path:
        filename = self.spec.config.get("default_model_filename") or self.default_filename()
        path = self.version_dir / filename
        if not path.exists():
            raise ConfigError(f"model '{self.spec.name}': model file {path} does not exist")
        return path

    @classmethod
    def default_filename(cls) -> str:
        raise NotImplementedError


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing a framework (0 when there is none)."""
    proc = Path("/proc/driver/nvidia/gpus")  # some VMs and containers have the device nodes alone
    present = len(list(proc.iterdir())) if proc.is_dir() else len(list(Path("/dev").glob("nvidia[0-9]*")))
    if not present:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    ids = []
    for v in visible.split(","):  # CUDA stops at the first invalid entry ("-1" hides every GPU)
        if not v.strip() or v.strip().startswith("-"):
            break
        ids.append(v)
    return min(present, len(ids))


DEFAULT_MAX_BATCH_SIZE = 4  # Triton's --backend-config=default-max-batch-size


@dataclass(frozen=True)
class Declared:
    """A tensor as a model file declares it, for auto-complete."""

    name: str
    data_type: str | None       # Triton's TYPE_*; None when the framework's type has no equivalent
    framework_type: str         # the framework's own name of the type, for the error message
    dims: tuple[int, ...]       # batch dimension first; -1 for a size the model leaves open


def complete_config(config: Any, inputs: list[Declared], outputs: list[Declared]) -> None:
    """Triton's auto-complete from a model file's tensors: a model whose tensors all lead with an
    open dimension batches (max_batch_size 4, dynamic batching) unless the config says otherwise (a
    max_batch_size, or dims of the model's rank);
    inputs or outputs the config leaves out are filled in (a tensor of the batch dimension alone as
    dims [1] and an empty reshape, as Triton fills it), and so are the datatype and dims of those it
    lists without them."""
    batchable = all(t.dims and t.dims[0] == -1 for t in (*inputs, *outputs))
    if config.max_batch_size == 0 and batchable and _batch_hint(config, inputs, outputs):
        config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        if not config.HasField("dynamic_batching"):
            config.dynamic_batching.SetInParent()
    skip = 1 if config.max_batch_size > 0 else 0
    made = {n for b in config.batch_input for n in b.target_name}  # the batch inputs: not the client's
    inputs = [t for t in inputs if t.name not in made]
    for declared, found in ((config.input, inputs), (config.output, outputs)):
        if declared:  # those listed are completed, those left out stay out
            by_name = {t.name: t for t in found}
            for entry in declared:
                if entry.name in by_name:
                    _fill(config.name, entry, by_name[entry.name], skip)
            continue
        for t in found:
            _fill(config.name, declared.add(name=t.name), t, skip)


def _fill(model: str, entry: Any, t: Declared, skip: int) -> None:
    """What a config entry leaves out (its datatype, its dims) from the model's tensor."""
    if entry.data_type == pb.TYPE_INVALID:
        if t.data_type is None:
            raise ConfigError(f"model '{model}': tensor '{t.name}' has type {t.framework_type}, "
                              "which Despina cannot serve")
        entry.data_type = pb.DataType.Value(t.data_type)
    if not entry.dims and not entry.HasField("reshape"):
        entry.dims.extend(t.dims[skip:])
        if skip and not entry.dims:  # the batch dimension alone: clients see [-1, 1], as Triton's say
            entry.dims.append(1)
            entry.reshape.SetInParent()


def _batch_hint(config: Any, inputs: list[Declared], outputs: list[Declared]) -> bool:
    """Whether a config with max_batch_size 0 (which may mean "not said") is for a batching model, as
    Triton reads it: a listed tensor whose dims are one shorter than the model's shape says yes, one of
    the model's rank says no; the listed tensors must agree. None listed with dims: yes."""
    found = {t.name: t for t in inputs} | {t.name: t for t in outputs}
    hints = {len(found[t.name].dims) == len(t.dims) + 1 for t in (*config.input, *config.output)
             if t.dims and t.name in found}
    if len(hints) > 1:
        raise ConfigError(f"model '{config.name}': the config's dims contradict each other on whether the "
                          "model batches (one shorter than the model's shape: it batches)")
    return hints != {False}


def check_config(config: Any, inputs: list[Declared], outputs: list[Declared],
                 overridable: Sequence[Declared] = ()) -> None:
    """Triton's load-time check of a config against its model file's tensors: each declared input and
    output is one of the model's, of its datatype and of a shape it takes; each model input is declared
    or is one the server makes (a batch input, a sequence's control or state input). `overridable` are
    inputs the model may be given but has values for (ONNX initializers listed as graph inputs): the
    config may declare them, and need not. Dims are not compared for a reshaped or ragged tensor, a batch
    output, or a model tensor of rank 0 (onnxruntime reports an unknown shape so)."""
    model_inputs = {t.name: t for t in inputs}
    made = {n for b in config.batch_input for n in b.target_name}
    made |= {c.name for c in config.sequence_batching.control_input}
    made |= {s.input_name for s in config.sequence_batching.state}
    scattered = {n for b in config.batch_output for n in b.target_name}
    for kind, declared, found in (("input", config.input, {t.name: t for t in overridable} | model_inputs),
                                  ("output", config.output, {t.name: t for t in outputs})):
        for t in declared:
            where = f"model '{config.name}': {kind} '{t.name}'"
            model = found.get(t.name)
            if model is None:
                raise ConfigError(f"{where} is not one of the model's; allowed {kind}s are: "
                                  f"{', '.join(sorted(found)) or 'none'}")
            wanted = pb.DataType.Name(t.data_type)
            if model.data_type != wanted:
                raise ConfigError(f"{where}: the config says {wanted}, the model "
                                  f"{model.data_type or model.framework_type}")
            if model.dims and not (t.HasField("reshape") or t.name in scattered
                                   or (kind == "input" and t.allow_ragged_batch)):
                _check_dims(where, config.max_batch_size, list(t.dims), model.dims)
    missing = sorted(set(model_inputs) - {t.name for t in config.input} - made)
    if missing:
        raise ConfigError(f"model '{config.name}': the model's input {', '.join(missing)} is not in the "
                          f"config (declared: {', '.join(t.name for t in config.input) or 'none'}); "
                          "the model needs every input")


def _check_dims(where: str, max_batch_size: int, dims: list[int], model: tuple[int, ...]) -> None:
    """The model's shape against the config's dims, as Triton's backends compare them: the model's -1
    matches any size, the config's -1 only the model's (a config that leaves open what the model fixes
    would let requests through that the model then fails); with
    max_batch_size > 0 the model leads with a batch dimension, which must be open (or 1 when batches
    are of 1), since the batcher sends any number of rows up to max_batch_size."""
    full = [-1, *dims] if max_batch_size > 0 else dims
    if max_batch_size > 0 and model[0] != -1 and not model[0] == max_batch_size == 1:
        raise ConfigError(f"{where}: the model's shape {list(model)} has a fixed first dimension, and "
                          "max_batch_size > 0 needs it open (-1) to batch (else set max_batch_size: 0 and "
                          "give the whole shape in dims)")
    rest = model[1:] if max_batch_size > 0 else model
    if len(model) != len(full) or any(m != c and m != -1 for m, c in zip(rest, dims)):
        note = " (max_batch_size > 0: a batch dimension, then dims)" if max_batch_size > 0 else ""
        raise ConfigError(f"{where}: the model's shape {list(model)} does not match the config's "
                          f"{full}{note}; a size the model fixes is given as that size, -1 only where the "
                          "model's is open")
