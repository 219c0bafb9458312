"""TensorFlow SavedModel: the MetaGraph and signature Triton serves (savedmodel.py: "serve" and
"serving_default", or the parameters TF_GRAPH_TAG and TF_SIGNATURE_DEF).

Input and output names are the signature's keys. Auto-complete reads the signature from
saved_model.pb with a small wire-compatible schema, so the control plane needs no TensorFlow. GPU
memory growth is turned on before TensorFlow touches a GPU, so one model does not take a whole GPU.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from functools import cache
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from ...contract.errors import BackendError, ConfigError
from ...contract.modelconfig import parameter_bool, parameter_int, string_parameters
from .base import Backend, Declared, check_config, complete_config
from .savedmodel import DEFAULT_SIGNATURE, Served, served

if find_spec("tensorflow") is None:  # TensorFlow itself is imported only where a model loads
    raise ImportError("No module named 'tensorflow'")

log = logging.getLogger("despina.backends.tensorflow")
TF_TO_CONFIG = {1: "TYPE_FP32", 2: "TYPE_FP64", 3: "TYPE_INT32", 4: "TYPE_UINT8", 5: "TYPE_INT16",
                6: "TYPE_INT8", 7: "TYPE_STRING", 9: "TYPE_INT64", 10: "TYPE_BOOL", 17: "TYPE_UINT16",
                19: "TYPE_FP16", 22: "TYPE_UINT32", 23: "TYPE_UINT64"}
TF_NAMES = {8: "DT_COMPLEX64", 14: "DT_BFLOAT16", 18: "DT_COMPLEX128", 20: "DT_RESOURCE", 21: "DT_VARIANT"}


@cache
def _tf() -> Any:
    """TensorFlow, configured once per process: quiet C++ logs, GPU memory growth, thread pools."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except (RuntimeError, ValueError):  # the GPU was initialised already
            pass
    return tf


class TensorFlowBackend(Backend):
    @classmethod
    def default_filename(cls) -> str:
        return "model.savedmodel"

    @classmethod
    def gpu_available(cls) -> bool:
        return cls.gpu_count() > 0

    @classmethod
    def gpu_count(cls) -> int:
        return len(_tf().config.list_physical_devices("GPU"))

    def load(self) -> None:
        check_accelerators(self.spec.name, self.spec.config, self.instance.kind)
        tf = _tf()
        params = string_parameters(self.spec.config)
        _set_threads(tf, self.spec.name, params, self.instance.threads)
        self.device = f"/GPU:{self.instance.device}" if self.instance.kind == "GPU" else "/CPU:0"
        path = self.model_path()
        chosen = _served(self.spec.name, path, params)
        try:
            with tf.device(self.device):
                self.model = tf.saved_model.load(str(path), tags=chosen.tags or None)
        except Exception as exc:
            raise ConfigError(f"model '{self.spec.name}': tensorflow cannot load {path.name}: {exc}"
                              ) from None
        name = chosen.name
        if name not in self.model.signatures:
            raise ConfigError(f"model '{self.spec.name}': the SavedModel has no signature '{name}' "
                              f"(it has: {', '.join(self.model.signatures) or 'none'})")
        self.function = self.model.signatures[name]
        self.arguments: dict[str, Any] = dict(self.function.structured_input_signature[1])
        outputs = set(self.function.structured_outputs)
        for kind, declared, known in (("input", self.spec.inputs, self.arguments), ("output",
                                      self.spec.outputs, outputs)):
            unknown = [t.name for t in declared if t.name not in known]
            if unknown:
                raise ConfigError(f"model '{self.spec.name}': {kind} {', '.join(unknown)} not in "
                                  f"signature '{name}' (it has: {', '.join(sorted(known))})")

    def execute(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        tf = _tf()
        try:
            with tf.device(self.device):
                feed = {n: tf.convert_to_tensor(inputs[n], dtype=spec.dtype)
                        for n, spec in self.arguments.items()}
                result = self.function(**feed)
        except KeyError as exc:
            raise BackendError(f"model '{self.spec.name}': input {exc} is missing") from None
        except Exception as exc:
            raise BackendError(f"tensorflow failed on model '{self.spec.name}': {exc}") from None
        return {n: result[n].numpy() for n in outputs}

    def unload(self) -> None:
        self.__dict__.pop("function", None)
        self.__dict__.pop("model", None)

    @classmethod
    def auto_complete(cls, config: Any, version_dir: Path) -> None:
        folder = version_dir / (config.default_model_filename or cls.default_filename())
        if not folder.is_dir():
            raise ConfigError(f"model '{config.name}': SavedModel folder {folder} does not exist")
        path = folder / "saved_model.pb"
        try:
            signature = served(path, {k: v.string_value for k, v in config.parameters.items()}).signature
        except (OSError, ValueError) as exc:
            if config.input and config.output:  # nothing to fill in: loading this version says what is wrong
                return
            raise ConfigError(f"model '{config.name}': cannot read {path} to complete the config: {exc}"
                              ) from None
        _complete(config, signature)


def check_accelerators(model: str, config: Mapping[str, Any], kind: str) -> None:
    """Triton's TensorFlow backend reads `optimization { execution_accelerators }`: on a GPU instance
    "gpu_io" (a hint: TensorFlow places the inputs on the device anyway, so it is taken), "tensorrt" and
    "auto_mixed_precision", which this backend does not apply; those, any other name, and any CPU
    accelerator are the load error, so a config never runs without what it asked for unnoticed. A GPU
    accelerator on a CPU instance is not consulted."""
    accelerators = (config.get("optimization") or {}).get("execution_accelerators") or {}
    asked = [a.get("name", "") for a in accelerators.get("cpu_execution_accelerator") or []]
    if kind == "GPU":
        asked += [a.get("name", "") for a in accelerators.get("gpu_execution_accelerator") or []]
    for name in asked:
        if name == "gpu_io" and kind == "GPU":
            continue
        if name in ("tensorrt", "auto_mixed_precision"):
            raise ConfigError(f"model '{model}': execution accelerator '{name}' is not applied by Despina's "
                              "tensorflow backend; convert the SavedModel ahead of time (TF-TRT, mixed "
                              "precision) and leave it out of the config")
        raise ConfigError(f"model '{model}': unknown Execution Accelerator '{name}' is requested "
                          "(tensorflow takes gpu_io on GPU instances)")


def _set_threads(tf: Any, model: str, params: Mapping[str, str], default: int) -> None:
    """Triton's TF_NUM_INTRA_THREADS and TF_NUM_INTER_THREADS (0 or unset: the instance's threads and 1),
    checked as Triton checks them with its session parameters, which TensorFlow 2 has no sessions for.
    TensorFlow takes thread counts once per process, before its runtime starts: a later load asking for
    others is told they have no effect."""
    if "TF_USE_PER_SESSION_THREADS" in params:
        parameter_bool(model, "TF_USE_PER_SESSION_THREADS", params["TF_USE_PER_SESSION_THREADS"])
    if "MAX_SESSION_SHARE_COUNT" in params:
        parameter_int(model, "MAX_SESSION_SHARE_COUNT", params["MAX_SESSION_SHARE_COUNT"], minimum=1)
    for key in ("TF_USE_PER_SESSION_THREADS", "MAX_SESSION_SHARE_COUNT"):
        if key in params:
            log.warning("model '%s': parameter %s has no effect (TensorFlow 2 runs a SavedModel without "
                        "sessions; each instance loads its own copy)", model, key)
    given = {key: parameter_int(model, key, params[key]) for key in ("TF_NUM_INTRA_THREADS",
             "TF_NUM_INTER_THREADS") if key in params}
    intra = given.get("TF_NUM_INTRA_THREADS") or max(1, default)
    inter = given.get("TF_NUM_INTER_THREADS") or 1
    threading = tf.config.threading
    try:
        threading.set_intra_op_parallelism_threads(intra)
        threading.set_inter_op_parallelism_threads(inter)
    except RuntimeError:  # the runtime has started: every model in this process shares its pools
        now = (threading.get_intra_op_parallelism_threads(), threading.get_inter_op_parallelism_threads())
        unmet = [f"{key} {value}" for key, value, have in (("TF_NUM_INTRA_THREADS", intra, now[0]),
                 ("TF_NUM_INTER_THREADS", inter, now[1])) if key in given and value != have]
        if unmet:
            log.warning("model '%s': %s has no effect: TensorFlow's thread pools are set once per process, "
                        "and have %d intra-op and %d inter-op threads", model, " and ".join(unmet), *now)


def _served(model: str, folder: Path, parameters: dict[str, str]) -> Served:
    """The MetaGraph's tags and the signature to load; a SavedModel without saved_model.pb (its text form,
    say) is left to TensorFlow, asked for TF_GRAPH_TAG's graph if given."""
    try:
        return served(folder / "saved_model.pb", parameters)
    except OSError:
        tag = parameters.get("TF_GRAPH_TAG", "")
        return Served([tag] if tag else [], parameters.get("TF_SIGNATURE_DEF") or DEFAULT_SIGNATURE, None)
    except ValueError as exc:
        raise ConfigError(f"model '{model}': {exc}") from None


def _complete(config: Any, signature: Any) -> None:
    """Auto-complete from the signature, then Triton's check of the config against it (as for ONNX)."""
    ins = sorted((e.key, e.value) for e in signature.inputs)
    outs = sorted((e.key, e.value) for e in signature.outputs)
    if not (config.input and config.output):
        for key, info in (*ins, *outs):
            if info.tensor_shape.unknown_rank:
                raise ConfigError(f"model '{config.name}': tensor '{key}' has an unknown rank; list the "
                                  "inputs and outputs in config.pbtxt")
    inputs = [_declared(key, info) for key, info in ins]
    outputs = [_declared(key, info) for key, info in outs]
    complete_config(config, inputs, outputs)
    check_config(config, inputs, outputs)


def _declared(key: str, info: Any) -> Declared:
    dims = tuple(d.size if d.size > 0 else -1 for d in info.tensor_shape.dim)
    named = TF_NAMES.get(info.dtype, f"DataType {info.dtype}")
    return Declared(key, TF_TO_CONFIG.get(info.dtype), named, dims)
