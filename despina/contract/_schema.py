"""Triton's ModelConfig protobuf schema, as tritonclient ships it.

tritonclient keeps the generated module inside its gRPC package, whose __init__ needs grpcio; we
load the one module by its path (and register it under its own name, so that a later import of the
gRPC client reuses it instead of registering the schema twice).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_NAME = "tritonclient.grpc.model_config_pb2"


def load() -> ModuleType:
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tritonclient is not installed; it provides Triton's model config schema")
    path = Path(next(iter(spec.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
    module_spec = importlib.util.spec_from_file_location(_NAME, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[_NAME] = module
    module_spec.loader.exec_module(module)
    return module


model_config_pb2 = load()
