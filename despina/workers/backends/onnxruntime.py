"""ONNX Runtime: the CPU execution provider always; CUDA when onnxruntime-gpu and a GPU are present."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...contract.errors import BackendError, ConfigError
from .base import Backend, Declared, complete_config

ONNX_TO_CONFIG = {
    "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16", "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
}


class OnnxRuntimeBackend(Backend):
    session: ort.InferenceSession

    @classmethod
    def default_filename(cls) -> str:
        return "model.onnx"

    @classmethod
    def gpu_available(cls) -> bool:
        return "CUDAExecutionProvider" in ort.get_available_providers()

    def load(self) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.instance.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers: list[Any] = ["CPUExecutionProvider"]
        if self.instance.kind == "GPU":
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": self.instance.device}))
        try:
            self.session = ort.InferenceSession(str(self.model_path()), options, providers=providers)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"model '{self.spec.name}': onnxruntime cannot load it: {exc}") from None
        self._strings = {i.name for i in self.session.get_inputs() if i.type == "tensor(string)"}

    def execute(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        feed = {name: (_as_str(a) if name in self._strings else a) for name, a in inputs.items()}
        try:
            result = self.session.run(list(outputs), feed)
        except Exception as exc:
            raise BackendError(f"onnxruntime failed on model '{self.spec.name}': {exc}") from None
        return dict(zip(outputs, result))

    def unload(self) -> None:
        self.__dict__.pop("session", None)

    @classmethod
    def auto_complete(cls, config: Any, version_dir: Path) -> None:
        if config.input and config.output:
            return
        path = version_dir / (config.default_model_filename or cls.default_filename())
        try:
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ConfigError(f"model '{config.name}': cannot read {path} to complete the config: {exc}"
                              ) from None
        complete_config(config, [_declared(t) for t in session.get_inputs()],
                        [_declared(t) for t in session.get_outputs()])


def _declared(t: Any) -> Declared:
    dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in t.shape)
    return Declared(t.name, ONNX_TO_CONFIG.get(t.type), t.type, dims)


def _as_str(array: np.ndarray) -> np.ndarray:
    """BYTES elements -> str, which onnxruntime wants for string tensors (any bytes survive)."""
    out = np.empty(array.shape, dtype=np.object_)
    out.reshape(-1)[:] = [b.decode("utf-8", "surrogateescape") if isinstance(b, bytes) else str(b)
                          for b in array.reshape(-1)]
    return out
