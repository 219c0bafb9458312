"""The backend protocol: every framework sits behind this one small class.

A backend instance is one loaded copy of one model version. The worker calls `load()` once,
`execute()` for each batch (from a thread: it must not touch the event loop), and `unload()` once.
`auto_complete()` fills in what a config.pbtxt left out, from the model file, as Triton does.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...contract.errors import ConfigError
from ...contract.modelconfig import ModelSpec


@dataclass(frozen=True)
class Instance:
    """Where one instance runs: `kind` is "CPU" or "GPU"; `device` is the GPU index."""

    name: str
    kind: str = "CPU"
    device: int = 0
    threads: int = 1


class Backend:
    """Subclass this for a framework; register it in `despina.backends` (an entry-point group)."""

    def __init__(self, spec: ModelSpec, version_dir: Path, instance: Instance) -> None:
        self.spec = spec
        self.version_dir = version_dir
        self.instance = instance

    def load(self) -> None:
        raise NotImplementedError

    def execute(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one batch: inputs by name, batch dimension first; return the asked outputs by name."""
        raise NotImplementedError

    def unload(self) -> None:
        """Free what load() took. The default drops references and lets the collector work."""

    @classmethod
    def auto_complete(cls, config: Any, version_dir: Path) -> None:
        """Fill missing inputs/outputs of `config` (a ModelConfig protobuf) from the model file."""

    @classmethod
    def gpu_available(cls) -> bool:
        return False

    def model_path(self) -> Path:
        filename = self.spec.config.get("default_model_filename") or self.default_filename()
        path = self.version_dir / filename
        if not path.exists():
            raise ConfigError(f"model '{self.spec.name}': model file {path} does not exist")
        return path

    @classmethod
    def default_filename(cls) -> str:
        raise NotImplementedError
