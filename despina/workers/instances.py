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
    instances: list[Instance] = []
    for index, group in enumerate(resolve(spec, gpu_count)):
        name, count, kind, gpus = group["name"], group["count"], group["kind"], group.get("gpus") or []
        where = f"model '{spec.name}': instance_group[{index}]"
        if kind == "KIND_GPU":
            if gpu_count == 0:
                raise ConfigError(f"{where} asks for KIND_GPU, but backend '{spec.backend}' sees no GPU "
                                  "on this worker (use KIND_CPU or KIND_AUTO to run on the CPU)")
            missing = [g for g in gpus if g < 0 or g >= gpu_count]
            if missing:
                raise ConfigError(f"{where} asks for GPU {missing}, but backend '{spec.backend}' sees "
                                  f"{gpu_count} GPU(s) on this worker")
            places = [("GPU", gpu) for gpu in gpus for _ in range(count)]
        elif kind in ("KIND_CPU", "KIND_MODEL"):
            places = [("CPU" if kind == "KIND_CPU" else "MODEL", 0)] * count
        else:
            raise ConfigError(f"{where}: field 'kind' {kind} is not supported")
        passive = bool(group.get("passive", False))
        instances += [Instance(f"{name}_{i % count}", k, device, threads, passive)
                      for i, (k, device) in enumerate(places)]
    return instances


def resolve(spec: ModelSpec, gpu_count: int) -> list[dict[str, Any]]:
    """The config's instance groups as Triton completes them where they run (a Python model's initialize
    sees them so): each named, counted, and of the kind it runs as (KIND_AUTO: KIND_GPU when there is a
    GPU, else KIND_CPU), a KIND_GPU group with the GPUs it runs on (every one when it names none)."""
    # Triton names the group it makes for a config without one after the model, and an unnamed
    # group of the config `<model>_<index>`; an instance is `<group>_<n>`, the same on every GPU
    groups: list[dict[str, Any]] = spec.config.get("instance_group") or [{"name": spec.name}]
    resolved = []
    for index, group in enumerate(groups):
        kind = group.get("kind") or "KIND_AUTO"
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if gpu_count > 0 else "KIND_CPU"
        gpus = [int(g) for g in group.get("gpus") or ()]
        if kind == "KIND_GPU" and not gpus:
            gpus = list(range(gpu_count))
        resolved.append({**group, "name": group.get("name") or f"{spec.name}_{index}",
                         "count": max(1, int(group.get("count") or 1)),  # Triton: an unset (0) count means 1
                         "kind": kind, "gpus": gpus})
    return resolved


def completed_config(spec: ModelSpec, gpu_count: int) -> dict[str, Any]:
    """The model's config with its instance groups as they run on this worker (resolve)."""
    return {**spec.config, "instance_group": resolve(spec, gpu_count)}
