"""ONNX Runtime: the CPU execution provider always; CUDA when onnxruntime-gpu and a GPU are present."""
from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...contract.errors import BackendError, ConfigError
from ...contract.modelconfig import parameter_bool, parameter_int, string_parameters
from .base import Backend, Declared, check_config, complete_config
from .ort_providers import CUDA, providers

log = logging.getLogger("despina.backends.onnxruntime")

ONNX_TO_CONFIG = {
    "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16", "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
}


class OnnxRuntimeBackend(Backend):
    session: ort.InferenceSession
    text_only = True  # its string tensors take str, which Python encodes as UTF-8

    @classmethod
    def default_filename(cls) -> str:
        return "model.onnx"

    @classmethod
    def gpu_available(cls) -> bool:
        return "CUDAExecutionProvider" in ort.get_available_providers()

    def model_path(self) -> Path:
        return onnx_file(super().model_path())

    def load(self) -> None:
        options = session_options(self.spec.name, self.spec.config, self.instance.threads)
        chosen = providers(self.spec.name, self.spec.config, self.instance.kind, self.instance.device,
                           ort.get_available_providers(), has_tf32_option())
        if any(name == CUDA for name, _ in chosen):
            preload_cuda_libraries()
        try:
            self.session = ort.InferenceSession(str(self.model_path()), options, providers=chosen)
        except Exception as exc:
            raise ConfigError(f"model '{self.spec.name}': onnxruntime cannot load it: {exc}") from None
        started = self.session.get_providers()
        missing = [name for name, _ in chosen if name not in started]
        if missing:  # onnxruntime falls back to the next provider when one cannot start, and only logs it
            raise ConfigError(f"model '{self.spec.name}': onnxruntime could not start {', '.join(missing)} "
                              f"(it started {', '.join(started)}; its log above says why)")
        self._strings = {i.name for i in self.session.get_inputs() if i.type == "tensor(string)"}
        # a scalar the config gives as dims [1] (Triton's way to declare one): clients get it in those dims
        self._scalars = {t.name: t.dims for t in self.spec.outputs
                         if not self.spec.batched and t.dims and set(t.dims) == {1}}
        # a scalar input the config gives as dims [1]: fed to onnxruntime as a 0-d array, as Triton feeds it;
        # under other dims the model's [] is an unknown rank (onnxruntime reports it so too): fed as it comes
        declared = {t.name for t in self.spec.inputs if not self.spec.batched and set(t.dims or [0]) == {1}}
        self._scalar_inputs = {i.name for i in self.session.get_inputs()
                               if i.shape == [] and i.name in declared}

    def execute(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        feed = {name: (_as_str(a) if name in self._strings else a) for name, a in inputs.items()}
        if self._scalar_inputs:  # rare: a model taking a scalar
            for name in self._scalar_inputs & feed.keys():
                if feed[name].size == 1:
                    feed[name] = feed[name].reshape(())
        try:
            result = self.session.run(list(outputs), feed)
        except Exception as exc:
            raise BackendError(f"onnxruntime failed on model '{self.spec.name}': {exc}") from None
        answer = dict(zip(outputs, result))
        if self._scalars:  # rare: the usual model's batch goes as onnxruntime gave it
            for name, dims in self._scalars.items():
                if name in answer and answer[name].ndim == 0:
                    answer[name] = answer[name].reshape(dims)
        return answer

    def unload(self) -> None:
        self.__dict__.pop("session", None)

    @classmethod
    def auto_complete(cls, config: Any, version_dir: Path) -> None:
        """Fill in what the config leaves out from the model's tensors, then check the config against them
        (as Triton's onnxruntime backend does at load): a config the model disagrees with fails its load
        rather than every request. The session is only read, so it is built with no graph optimization.
        A file onnxruntime cannot read is left to the load of its version when the config needs nothing
        from it (the other versions serve)."""
        path = onnx_file(version_dir / (config.default_model_filename or cls.default_filename()))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            if config.input and config.output:  # nothing to fill in: loading this version says what is wrong
                return
            raise ConfigError(f"model '{config.name}': cannot read {path} to complete the config: {exc}"
                              ) from None
        inputs = [_declared(t) for t in session.get_inputs()]
        outputs = [_declared(t) for t in session.get_outputs()]
        filled = [kind for kind in ("input", "output") if not getattr(config, kind)]
        complete_config(config, inputs, outputs)
        if not config.max_batch_size:  # Triton's onnxruntime backend fills a scalar as dims [1], no reshape
            for kind in filled:
                for t in getattr(config, kind):
                    if not t.dims:
                        t.dims.append(1)
        check_config(config, inputs, outputs, [_declared(t) for t in session.get_overridable_initializers()])


def onnx_file(path: Path) -> Path:
    """The ONNX file at `path`: a folder of that name holds it as model.onnx, beside its external data
    (Triton's layout for a model past protobuf's 2 GB)."""
    return path / "model.onnx" if path.is_dir() else path


def has_tf32_option(version: str = ort.__version__) -> bool:
    """Whether this onnxruntime's CUDA provider takes use_tf32 (1.18 on; an older one refuses the option)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return True  # a development build: a current one
    return (major, minor) >= (1, 18)


@cache
def preload_cuda_libraries() -> None:
    """Once per process, before the first session with the CUDA provider: onnxruntime-gpu's own
    preload_dlls (1.21 and later), which loads the CUDA and cuDNN libraries from the nvidia-* packages
    beside it (`pip install onnxruntime-gpu[cuda,cudnn]`), where the dynamic loader does not look, and
    otherwise from its usual paths (a system CUDA). What it prints about a library it could not load goes
    to the log; the session then says whether its provider started (load)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            preload()
    except Exception as exc:  # e.g. a build without the CUDA version recorded
        log.warning("onnxruntime could not preload the CUDA libraries: %s", exc)
    for line in filter(None, said.getvalue().splitlines()):
        log.warning("onnxruntime: %s", line)


# Triton's onnxruntime backend: optimization { graph { level } } -> the session's optimization level
GRAPH_LEVELS = {-1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
SESSION_ENTRIES = ("session.use_device_allocator_for_initializers",)  # passed to onnxruntime as they are


def session_options(model: str, config: dict[str, Any], threads: int) -> ort.SessionOptions:
    """The session options a config asks for, as Triton's onnxruntime backend reads them: the graph
    optimization level, and the parameters execution_mode (0 sequential, 1 parallel),
    intra_op_thread_count and inter_op_thread_count (0: the worker's choice, `threads` and 1),
    enable_mem_arena, enable_mem_pattern and session.use_device_allocator_for_initializers; and the custom
    operation libraries of model_operations. A value onnxruntime cannot take is the model's load error,
    naming the parameter or library."""
    params = string_parameters(config)
    options = ort.SessionOptions()
    level = int((config.get("optimization") or {}).get("graph", {}).get("level", 0))
    options.graph_optimization_level = GRAPH_LEVELS.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    mode = _int(model, params, "execution_mode", 0)
    if mode not in (0, 1):
        raise ConfigError(f"model '{model}': parameter execution_mode must be 0 (sequential) or 1 "
                          f"(parallel), got {mode}")
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL if mode else ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = _int(model, params, "intra_op_thread_count", 0) or threads
    options.inter_op_num_threads = _int(model, params, "inter_op_thread_count", 0) or 1
    for name, attribute in (("enable_mem_arena", "enable_cpu_mem_arena"), ("enable_mem_pattern",
                                                                            "enable_mem_pattern")):
        if name in params:
            setattr(options, attribute, _bool(model, params, name))
    for key in SESSION_ENTRIES:
        if key in params:
            options.add_session_config_entry(key, params[key])
    for library in (config.get("model_operations") or {}).get("op_library_filename") or ():
        try:
            options.register_custom_ops_library(library)
        except Exception as exc:  # onnxruntime's own error: missing file, no RegisterCustomOps, ...
            raise ConfigError(f"model '{model}': model_operations: onnxruntime cannot load '{library}': "
                              f"{exc}") from None
    return options


def _int(model: str, params: dict[str, str], name: str, default: int) -> int:
    return parameter_int(model, name, params[name]) if name in params else default


def _bool(model: str, params: dict[str, str], name: str) -> bool:
    return parameter_bool(model, name, params[name])


def _declared(t: Any) -> Declared:
    dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in t.shape)
    return Declared(t.name, ONNX_TO_CONFIG.get(t.type), t.type, dims)


def _as_str(array: np.ndarray) -> np.ndarray:
    """BYTES elements -> str, which onnxruntime wants for string tensors (any bytes survive)."""
    out = np.empty(array.shape, dtype=np.object_)
    out.reshape(-1)[:] = [b.decode("utf-8", "surrogateescape") if isinstance(b, bytes) else str(b)
                          for b in array.reshape(-1)]
    return out
