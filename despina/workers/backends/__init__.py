"""Backend registry: built-in frameworks plus any registered under the `despina.backends` entry points."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from ...contract.errors import ConfigError
from .base import Backend, Instance

__all__ = ["Backend", "Instance", "backend_class"]

BUILTIN = {
    "onnxruntime": "despina.workers.backends.onnxruntime:OnnxRuntimeBackend",
    "pytorch": "despina.workers.backends.pytorch:PyTorchBackend",
    "tensorflow": "despina.workers.backends.tensorflow:TensorFlowBackend",
    "python": "despina.workers.backends.python:PythonBackend",
}
EXTRAS = {"onnxruntime": "onnx", "pytorch": "torch", "tensorflow": "tensorflow"}  # pip install despina[...]


def backend_class(name: str) -> type[Backend]:
    """The class for a config's `backend`; frameworks are imported only when a model needs them."""
    target = BUILTIN.get(name)
    if target is None:
        found = [ep for ep in entry_points(group="despina.backends") if ep.name == name]
        if not found:
            raise ConfigError(f"no backend named '{name}' (built in: {', '.join(sorted(BUILTIN))}; "
                              "others register under the 'despina.backends' entry points)")
        try:
            cls = found[0].load()
        except Exception as exc:
            raise ConfigError(f"backend '{name}' (entry point {found[0].value}) cannot be imported: "
                              f"{exc}") from None
    else:
        module, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise ConfigError(f"backend '{name}' is not installed ({exc}); install "
                              f"despina[{EXTRAS.get(name, name)}]") from None
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"backend '{name}' does not implement despina's Backend protocol")
    return cls
