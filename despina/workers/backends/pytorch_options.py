"""What a PyTorch model's config and file say beyond its tensors: Triton's `parameters`, and a model.pt
that is not TorchScript.

Triton's PyTorch backend reads these parameters (string values; a value it cannot read fails the load):
DISABLE_OPTIMIZED_EXECUTION and INFERENCE_MODE apply to the model's own calls, as here (the graph
executor's optimisation is per thread in torch; INFERENCE_MODE is on unless the config says "false", as in
Triton's current releases, whose ModelState starts with it enabled); INTRA_OP_THREAD_COUNT and
INTER_OP_THREAD_COUNT set torch's thread pools; ENABLE_CACHE_CLEANING empties the CUDA cache after each
call on a GPU; ENABLE_WEIGHT_SHARING gives the instances on one device one module (pytorch_sharing.py).
The others Triton flips torch-wide around each call (JIT profiling and executor, the tensor-expression
fuser, cuDNN), which in a Despina worker would change every other model it runs; those and the
ENABLE_NVFUSER of older releases load with a warning that they have no effect.
"""
from __future__ import annotations

import logging
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ...contract.modelconfig import parameter_bool, parameter_int, string_parameters

log = logging.getLogger("despina.backends.pytorch")

NOT_APPLIED = {
    "ENABLE_JIT_PROFILING": "torch-wide", "ENABLE_JIT_EXECUTOR": "torch-wide",
    "ENABLE_TENSOR_FUSER": "torch-wide", "DISABLE_CUDNN": "torch-wide",
    "ENABLE_NVFUSER": "nvFuser is gone from torch and Triton",
}
BOOLEANS = ("DISABLE_OPTIMIZED_EXECUTION", "INFERENCE_MODE", "ENABLE_CACHE_CLEANING", "ENABLE_WEIGHT_SHARING",
            *NOT_APPLIED)
UNSET = -1  # Triton's thread counts: a value <= 0 leaves torch's own


@dataclass(frozen=True)
class TorchOptions:
    optimized: bool = True
    inference_mode: bool = True  # Triton's default (INFERENCE_MODE "false" gives torch.no_grad())
    clean_cache: bool = False
    weight_sharing: bool = False
    intra_op_threads: int = 0
    inter_op_threads: int = 0


def torch_options(model: str, config: Mapping[str, Any]) -> TorchOptions:
    """The config's parameters, checked as Triton parses them; the ones not applied are logged."""
    params = string_parameters(dict(config))
    flags = {key: parameter_bool(model, key, params[key]) for key in BOOLEANS if key in params}
    ignored = [f"{key} ({NOT_APPLIED[key]})" for key in NOT_APPLIED if key in params]
    if ignored:
        log.warning("model '%s': these parameters have no effect in Despina: %s", model, "; ".join(ignored))
    threads = {key: parameter_int(model, key, params[key], minimum=UNSET) if key in params else 0
               for key in ("INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT")}
    return TorchOptions(optimized=not flags.get("DISABLE_OPTIMIZED_EXECUTION", False),
                        inference_mode=flags.get("INFERENCE_MODE", True),
                        clean_cache=flags.get("ENABLE_CACHE_CLEANING", False),
                        weight_sharing=flags.get("ENABLE_WEIGHT_SHARING", False),
                        intra_op_threads=threads["INTRA_OP_THREAD_COUNT"],
                        inter_op_threads=threads["INTER_OP_THREAD_COUNT"])


def call_mode(torch: Any, options: TorchOptions, cuda: bool) -> Callable[[], AbstractContextManager[Any]]:
    """What each call runs under: made once at load, so the usual case costs a call what no_grad did."""
    grad = torch.inference_mode if options.inference_mode else torch.no_grad
    clean = options.clean_cache and cuda
    if options.optimized and not clean:
        return grad  # type: ignore[no-any-return]
    return partial(_call, torch, grad, options.optimized, clean)


@contextmanager
def _call(torch: Any, grad: Callable[[], Any], optimized: bool, clean: bool) -> Iterator[None]:
    try:
        with grad(), torch.jit.optimized_execution(optimized):
            yield
    finally:
        if clean:  # ENABLE_CACHE_CLEANING: as Triton, after each call
            torch.cuda.empty_cache()


def set_threads(torch: Any, model: str, options: TorchOptions, default: int) -> None:
    torch.set_num_threads(options.intra_op_threads if options.intra_op_threads > 0 else max(1, default))
    if options.inter_op_threads > 0 and torch.get_num_interop_threads() != options.inter_op_threads:
        try:
            torch.set_num_interop_threads(options.inter_op_threads)
        except RuntimeError:  # torch takes it only before its first parallel work, as in Triton
            log.warning("model '%s': INTER_OP_THREAD_COUNT %d has no effect: torch's inter-op pool has %d "
                        "threads already", model, options.inter_op_threads, torch.get_num_interop_threads())


def not_torchscript(path: Path) -> str | None:
    """Why a model.pt torch.jit.load refused is not TorchScript, when it is one of the usual mistakes."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = {name.partition("/")[2] for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile):
        names = None
    if names is None:
        try:
            with path.open("rb") as f:
                legacy = f.read(1) == b"\x80"  # a pickle's PROTO opcode: torch.save's old format
        except OSError:
            return None
        return _pickled(path.name) if legacy else None
    if "archive_format" in names or "models/model.json" in names:
        return f"{path.name} is a torch.export program, not TorchScript: name it model.pt2"
    if "data.pkl" in names and "constants.pkl" not in names:
        return _pickled(path.name)
    return None


def _pickled(name: str) -> str:
    return (f"{name} was written by torch.save() (a pickled nn.Module or state_dict), not TorchScript: "
            "save the model with torch.jit.script(model).save(path) or torch.jit.trace(model, example)"
            ".save(path), or torch.export it to a model.pt2")
