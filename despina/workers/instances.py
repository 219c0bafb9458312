"""Triton's instance groups: how many copies of a model run, and on which device each one runs."""
from __future__ import annotations

from typing import Any

from ..contract.errors import ConfigError
from ..contract.modelspec import ModelSpec
from .backends.base import Instance


def plan(spec: ModelSpec, gpu_count: int, threads: int = 1) -> list[Instance]:
    """The instances of `spec`'s instance_group on a worker that sees `gpu_count` GPUs.

    KIND_CPU: `count` on the CPU. KIND_GPU: `count` on each GPU in `gpus` (every GPU when empty); an
    error when a GPU is missing, never a silent CPU run. KIND_AUTO: as KIND_GPU when there is a GPU,
    else on the CPU. KIND_MODEL: `count` instances that place themselves. A `passive` group's instances
    are loaded and given no requests.
    """
    # Triton names the group it makes for a config without one after the model, and an unnamed
    # group of the config `<model>_<index>`; an instance is `<group>_<n>`, the same on every GPU
    groups: list[dict[str, Any]] = spec.config.get("instance_group") or [{"name": spec.name}]
    instances: list[Instance] = []
    for index, group in enumerate(groups):
        name = group.get("name") or f"{spec.name}_{index}"
        count = max(1, int(group.get("count") or 1))  # Triton: an unset (0) count means 1
        kind = group.get("kind") or "KIND_AUTO"
        gpus = [int(g) for g in group.get("gpus") or ()]
        where = f"model '{spec.name}': instance_group[{index}]"
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if gpu_count > 0 else "KIND_CPU"
        if kind == "KIND_GPU":
            if gpu_count == 0:
                raise ConfigError(f"{where} asks for KIND_GPU, but backend '{spec.backend}' sees no GPU "
                                  "on this worker (use KIND_CPU or KIND_AUTO to run on the CPU)")
            missing = [g for g in gpus if g < 0 or g >= gpu_count]
            if missing:
                raise ConfigError(f"{where} asks for GPU {missing}, but backend '{spec.backend}' sees "
                                  f"{gpu_count} GPU(s) on this worker")
            places = [("GPU", gpu) for gpu in gpus or range(gpu_count) for _ in range(count)]
        elif kind in ("KIND_CPU", "KIND_MODEL"):
            places = [("CPU" if kind == "KIND_CPU" else "MODEL", 0)] * count
        else:
            raise ConfigError(f"{where}: field 'kind' {kind} is not supported")
        passive = bool(group.get("passive", False))
        instances += [Instance(f"{name}_{i % count}", k, device, threads, passive)
                      for i, (k, device) in enumerate(places)]
    return instances
