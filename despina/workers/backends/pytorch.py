"""PyTorch: TorchScript files (model.pt) and torch.export programs (model.pt2).

Inputs follow Triton's PyTorch backend: config names that are the forward() argument names bind by
name; names of the form `<name>__<i>` (INPUT__0; i is all that follows the first "__") bind to position
i; otherwise the config order is the argument order; a forward() whose one argument is a
Dict[str, Tensor] gets every input in it by name. A model returning a tuple maps it the same way onto
the outputs (OUTPUT__0, or the config order; a config may list only some of them, OUTPUT__1 alone say).
As in Triton's libtorch path, a TorchScript model gives a Tensor, a List[str], or a tuple of those: a
dict, a List[Tensor] or a scalar fails each request with Triton's words (a torch.export program's inputs
and outputs are its graph's flat tensors, named as pytorch_export.py says). As in Triton, a TYPE_STRING
input or output is a List[str] (UTF-8: other bytes fail their request alone) of one dimension, the
batch's when the model batches.
Every call runs under `torch.inference_mode()` (or `torch.no_grad()`, parameter INFERENCE_MODE "false")
with parameters frozen, so the "inference tensors cannot be saved for backward" trap cannot happen. Triton's
other parameters: pytorch_options.py.
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from ...contract.errors import BackendError, ConfigError, InvalidArgument
from ...contract.modelspec import ModelSpec
from .base import Backend, Declared, complete_config
from .pytorch_export import arguments, batch_bound, input_names, output_names, results
from .pytorch_options import call_mode, not_torchscript, set_threads, torch_options
from .pytorch_sharing import Key, give_back, sharing_key, take

if find_spec("torch") is None:  # torch itself is imported only where a model needs it
    raise ImportError("No module named 'torch'")

# torch.export.load keeps its deserializer in a global: two models loading at once must take turns.
_LOADING = threading.Lock()
TORCH_TO_CONFIG = {
    "torch.bool": "TYPE_BOOL", "torch.uint8": "TYPE_UINT8", "torch.int8": "TYPE_INT8",
    "torch.int16": "TYPE_INT16", "torch.int32": "TYPE_INT32", "torch.int64": "TYPE_INT64",
    "torch.float16": "TYPE_FP16", "torch.float32": "TYPE_FP32", "torch.float64": "TYPE_FP64",
}


def _torch() -> Any:
    import torch

    return torch


class PyTorchBackend(Backend):
    text_only = True  # a TYPE_STRING input is a List[str]: a request whose bytes are not text fails alone
    @classmethod
    def default_filename(cls) -> str:
        return "model.pt"

    @classmethod
    def gpu_available(cls) -> bool:
        return bool(_torch().cuda.is_available())

    @classmethod
    def gpu_count(cls) -> int:
        torch = _torch()
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0

    def model_path(self) -> Path:
        if not self.spec.config.get("default_model_filename"):
            exported = self.version_dir / "model.pt2"
            if exported.exists() and not (self.version_dir / "model.pt").exists():
                return exported
        return super().model_path()

    def load(self) -> None:
        torch = _torch()
        options = torch_options(self.spec.name, self.spec.config)
        set_threads(torch, self.spec.name, options, self.instance.threads)
        self.device = torch.device(f"cuda:{self.instance.device}" if self.instance.kind == "GPU" else "cpu")
        self.call_mode = call_mode(torch, options, self.device.type == "cuda")
        path = self.model_path()
        self.shared_as: Key | None = None
        try:
            if options.weight_sharing:
                self.shared_as = sharing_key(self.spec.name, path, str(self.device))
                read = take(self.shared_as, lambda: _read(torch, path, self.device))
            else:
                read = _read(torch, path, self.device)
        except Exception as exc:
            self.shared_as = None  # take() counts only what it gave
            why = not_torchscript(path) if path.suffix != ".pt2" and path.is_file() else None
            raise ConfigError(f"model '{self.spec.name}': {why or f'torch cannot load {path.name}: {exc}'}"
                              ) from None
        try:
            self._bind(torch, read)
        except BaseException:
            self.unload()  # a shared module goes back
            raise

    def _bind(self, torch: Any, read: _Read) -> None:
        """The config's tensors bound to what the model's forward() takes and returns."""
        self.module = read.module
        self.dict_input = read.dict_input  # forward(self, inputs: Dict[str, Tensor]): Triton's dict input
        self.refusal = read.refusal  # why each call fails: what forward() returns Triton refuses
        self.exported, self.in_spec = read.exported, read.in_spec
        if read.batch_bound is not None and self.spec.max_batch_size > read.batch_bound:
            raise ConfigError(f"model '{self.spec.name}': max_batch_size {self.spec.max_batch_size} is more "
                              f"than the program takes: it was exported for batches of at most "
                              f"{read.batch_bound} (its Dim's max); set max_batch_size to at most that")
        names = read.names
        _check_strings(self.spec)
        self.string_inputs = {t.name for t in self.spec.inputs if t.datatype == "BYTES"}
        made = [n for b in self.spec.batch_inputs for n in b.targets]  # the batch inputs (workers/ragged.py)
        declared = [t.name for t in self.spec.inputs] + made
        if not self.dict_input and len(declared) != len(names):  # Triton's load-time check too
            raise ConfigError(f"model '{self.spec.name}': the config gives {len(declared)} inputs, the "
                              f"model's forward() takes {len(names)} ({', '.join(names)})")
        self.arguments = declared if self.dict_input else _order(declared, names, "input", self.spec.name)
        self.results = _positions([t.name for t in self.spec.outputs])
        # the torch dtype each output must have (BYTES: a List[str]; a datatype torch has no name here for,
        # UINT32 say, is not checked)
        # a scalar output the config gives as dims [1] (Triton's way to declare one): answered in those dims
        self.scalars = {t.name: t.dims for t in self.spec.outputs
                        if not self.spec.batched and t.dims and set(t.dims) == {1}}
        self.output_types = {t.name: "BYTES" if t.datatype == "BYTES" else _torch_type(torch, t.datatype)
                             for t in self.spec.outputs}

    def execute(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        torch = _torch()
        try:
            if self.string_inputs:
                args = [self._strings_in(name, inputs[name]) if name in self.string_inputs
                        else self._tensor(torch, inputs[name]) for name in self.arguments]
            else:
                args = [self._tensor(torch, inputs[name]) for name in self.arguments]
        except KeyError as exc:
            raise BackendError(f"model '{self.spec.name}': input {exc} is missing") from None
        kwargs: dict[str, Any] = {}
        if self.dict_input:
            args = [dict(zip(self.arguments, args))]
        elif self.in_spec is not None:  # a program's flat inputs into its dicts, tuples and keywords
            args, kwargs = arguments(self.in_spec, args)
        if self.refusal:  # Triton calls forward() and then refuses what it gave: the same answer, sooner
            raise BackendError(f"model '{self.spec.name}': PyTorch execute failure: {self.refusal}")
        try:
            with self.call_mode():
                result = self.module(*args, **kwargs)
        except Exception as exc:
            if self.exported and isinstance(exc, AssertionError) and str(exc).startswith("Guard failed"):
                # the program's input check, before it ran: a size the config's -1 let through
                raise InvalidArgument(f"model '{self.spec.name}': the request's inputs are outside the "
                                      f"shapes the program was exported for: {exc}") from None
            raise BackendError(f"torch failed on model '{self.spec.name}': {exc}") from None
        by_name = self._by_name(result)
        missing = [name for name in outputs if name not in by_name]
        if missing:
            raise BackendError(f"model '{self.spec.name}' returned no {', '.join(missing)} "
                               f"(it returned {', '.join(map(str, by_name))})")
        return {name: self._array(name, by_name[name]) for name in outputs}

    def unload(self) -> None:
        self.__dict__.pop("module", None)
        shared_as = getattr(self, "shared_as", None)
        if shared_as is not None:  # ENABLE_WEIGHT_SHARING: the last instance to go frees the module
            self.shared_as = None
            give_back(shared_as)
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            _torch().cuda.empty_cache()

    def _tensor(self, torch: Any, array: np.ndarray) -> Any:
        if not array.flags.writeable:  # torch.from_numpy wants memory it may write
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _strings_in(self, name: str, array: np.ndarray) -> list[str]:
        """A TYPE_STRING input as the List[str] a TorchScript model takes (its shape is one dimension,
        checked at load)."""
        try:
            return [v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1).tolist()]
        except UnicodeDecodeError as exc:
            raise BackendError(f"model '{self.spec.name}': input '{name}' is not UTF-8, which a List[str] "
                               f"needs: {exc}") from None

    def _array(self, name: str, value: Any) -> np.ndarray:
        """An output as numpy, of the config's datatype: as in Triton, another is the request's error (it
        would otherwise go out under a datatype the client was not told)."""
        wanted_type = self.output_types[name]
        if wanted_type == "BYTES":  # TYPE_STRING: the model gives a List[str]
            return self._strings(name, value)
        if wanted_type is not None and getattr(value, "dtype", None) != wanted_type:
            given = TORCH_TO_CONFIG.get(str(getattr(value, "dtype", "")), type(value).__name__)
            wanted = TORCH_TO_CONFIG[str(wanted_type)]
            raise InvalidArgument(f"model '{self.spec.name}': configuration expects datatype {wanted} for "
                                  f"output '{name}', model provides {given}")
        if value.dim() == 0:
            if not self.exported:  # Triton's libtorch path: INVALID_ARG, its words
                raise InvalidArgument(f"model '{self.spec.name}': output '{name}' is a scalar which is not "
                                      "supported.")
            if name in self.scalars:  # a program's scalar, declared as dims [1]: answered in them
                return value.detach().cpu().numpy().reshape(self.scalars[name])
        return value.detach().cpu().numpy()

    def _strings(self, name: str, value: Any) -> np.ndarray:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise BackendError(f"model '{self.spec.name}': configuration expects datatype TYPE_STRING for "
                               f"output '{name}', model provides {type(value).__name__} (a List[str] is "
                               "taken)")
        return np.array([v.encode() for v in value], dtype=object)

    def _by_name(self, result: Any) -> dict[str, Any]:
        if self.exported:  # nested tuples flattened, as auto-complete names them
            result = results(result)
        if isinstance(result, Mapping):
            return dict(result)
        one = not isinstance(result, (tuple, list)) or _is_strings(result)  # a List[str] is one output
        values = [result] if one else list(result)
        beyond = [name for name, i in self.results.items() if i >= len(values)]
        if beyond:  # Triton's words and code (INVALID_ARG): the config names an output the model lacks
            raise InvalidArgument(f"model '{self.spec.name}': the output {beyond[0]} in the model "
                                  "configuration refers to an output index which doesn't exist. This model "
                                  f"has {len(values)} outputs")
        return {name: values[i] for name, i in self.results.items()}

    @classmethod
    def auto_complete(cls, config: Any, version_dir: Path) -> None:
        """torch.export programs carry their signature; TorchScript files need a full config."""
        path = version_dir / (config.default_model_filename or cls.default_filename())
        if not config.default_model_filename and not path.exists():
            path = version_dir / "model.pt2"
        if not path.exists():
            wanted = config.default_model_filename or "model.pt or model.pt2"
            raise ConfigError(f"model '{config.name}': no {wanted} in {version_dir}")
        if config.input and config.output:
            return
        if path.suffix != ".pt2":
            raise ConfigError(f"model '{config.name}': a TorchScript model needs its input and output "
                              "listed in config.pbtxt")
        try:
            with _LOADING:
                program = _torch().export.load(str(path))
        except Exception as exc:
            raise ConfigError(f"model '{config.name}': cannot read {path} to complete the config: {exc}"
                              ) from None
        _complete_from_program(config, program)


def _output_refusal(returns: list[Any]) -> str | None:
    """Why Triton's libtorch path fails every call of a TorchScript model returning this (its words), or
    None: it takes a Tensor, a List[str], or a tuple whose elements are one of those two."""
    if len(returns) != 1:  # a TorchScript method returns one value (a tuple is one)
        return None
    given = returns[0].type
    if given.kind() == "TupleType":
        for i, element in enumerate(given.elements()):
            if not _tensor_or_strings(element):
                return f"output at index {i} must be of type Tensor or List[str], received {element}"
        return None
    if _tensor_or_strings(given):
        return None
    if given.kind() == "ListType":
        return f"output must be of type Tensor or List[str], received {given}"
    return ("output must be of type Tensor, List[str] or Tuple containing one of these two types. It should "
            "not be a List / Dictionary of Tensors or a Scalar")


def _tensor_or_strings(value_type: Any) -> bool:
    kind = value_type.kind()
    if kind == "ListType":
        return bool(value_type.getElementType().kind() == "StringType")
    return kind in ("TensorType", "AnyType")  # Any: a traced model's type torch could not name


@dataclass(frozen=True)
class _Read:
    """A loaded model.pt or model.pt2, and what its forward() takes and returns."""

    module: Any
    names: list[str]
    dict_input: bool = False
    refusal: str | None = None
    exported: bool = False  # a model.pt2 (torch.export), not TorchScript
    batch_bound: int | None = None  # a torch.export program's largest batch, when its Dim has a max
    in_spec: Any = None  # a torch.export program's (args, kwargs) structure, which its flat inputs fill


def _read(torch: Any, path: Path, device: Any) -> _Read:
    with _LOADING, warnings.catch_warnings():  # TorchScript is deprecated upstream
        warnings.simplefilter("ignore", DeprecationWarning)
        if path.suffix == ".pt2":
            program = torch.export.load(str(path))
            read = _Read(program.module().to(device), input_names(program), exported=True,
                         batch_bound=batch_bound(program), in_spec=program.call_spec.in_spec)
        else:
            module = torch.jit.load(str(path), map_location=device)
            module.eval()
            arguments = module.forward.schema.arguments[1:]
            read = _Read(module, [a.name for a in arguments],
                         len(arguments) == 1 and isinstance(arguments[0].type, torch.DictType),
                         _output_refusal(module.forward.schema.returns))
    for param in read.module.parameters():
        param.requires_grad_(False)
    return read


def _is_strings(result: list[Any] | tuple[Any, ...]) -> bool:
    return isinstance(result, list) and (not result or isinstance(result[0], str))


def _check_strings(spec: ModelSpec) -> None:
    """Triton's load-time rule: a List[str] is one dimension, the batch's when the model batches."""
    for kind, tensors in (("input", spec.inputs), ("output", spec.outputs)):
        for t in tensors:
            shape = t.dims if t.reshape is None else t.reshape
            if t.datatype == "BYTES" and len(shape) + spec.batched > 1:
                raise ConfigError(f"model '{spec.name}': {kind} '{t.name}' is TYPE_STRING, which a "
                                  "TorchScript model takes and gives as a List[str]: only one dimension "
                                  "(with max_batch_size > 0, the batch's: dims [1] with reshape "
                                  "{ shape: [] })")


def _torch_type(torch: Any, datatype: str) -> Any:
    """The torch dtype of a V2 datatype; None for one TORCH_TO_CONFIG does not name."""
    for torch_name, config_name in TORCH_TO_CONFIG.items():
        if config_name == f"TYPE_{datatype}":
            return getattr(torch, torch_name.removeprefix("torch."))
    return None


def _order(config_names: list[str], forward_names: list[str], kind: str, model: str) -> list[str]:
    """Config names in the model's positional order (Triton's PyTorch backend naming rules)."""
    if forward_names and set(config_names) <= set(forward_names):
        return [n for n in forward_names if n in config_names]
    indexes = [i for i in map(_index, config_names) if i is not None]
    if config_names and len(indexes) == len(config_names):
        indexed = sorted(zip(indexes, config_names))
        if [i for i, _ in indexed] != list(range(len(indexed))):
            raise ConfigError(f"model '{model}': {kind} names ending in __<i> must number "
                              f"0..{len(indexed) - 1}")
        return [n for _, n in indexed]
    return list(config_names)


def _positions(config_names: list[str]) -> dict[str, int]:
    """Each output's place in what the model returns: the <i> of `<name>__<i>` when every name has one
    (as in Triton, any of the model's outputs, in any order), else the config order."""
    indexes = [i for i in map(_index, config_names) if i is not None]
    if config_names and len(indexes) == len(config_names):
        return dict(zip(config_names, indexes))
    return {n: i for i, n in enumerate(config_names)}


def _index(name: str) -> int | None:
    """The <index> of Triton's `<name>__<index>`: all that follows the first "__", when it is all digits
    (`a__x__1` has none: Triton reads `x__1`)."""
    _, delimiter, index = name.partition("__")
    return int(index) if delimiter and index.isascii() and index.isdigit() else None


def _complete_from_program(config: Any, program: Any) -> None:
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    flat = program.graph_signature.user_inputs  # (input_names: forward()'s names where they are one each)
    inputs = [(name, placeholders[p].meta["val"]) for name, p in zip(input_names(program), flat)]
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    outputs = [(name, node.meta["val"]) for name, node in zip(output_names(program), output_node.args[0])]
    unset = config.max_batch_size == 0
    complete_config(config, [_declared(n, v) for n, v in inputs], [_declared(n, v) for n, v in outputs])
    bound = batch_bound(program)
    if unset and bound is not None and config.max_batch_size > bound:  # the default (4) is more than it takes
        config.max_batch_size = bound
    if not config.max_batch_size:  # a scalar output as dims [1], as onnxruntime's (Triton's) auto-complete
        for t in config.output:
            if not t.dims and not t.HasField("reshape"):
                t.dims.append(1)


def _declared(name: str, value: Any) -> Declared:
    dims = tuple(d if isinstance(d, int) else -1 for d in value.shape)
    return Declared(name, TORCH_TO_CONFIG.get(str(value.dtype)), str(value.dtype), dims)
