"""A model's instance groups as Triton completes them where the model runs: KIND_AUTO resolved to the
device it runs on. A worker resolves them for itself (it knows its GPUs); a gateway shows them, in GET
.../config, as the workers that serve the model resolved them (they report how many GPUs they used)."""
from __future__ import annotations

import hashlib
from typing import Any

import orjson

from .ensemble import is_ensemble
from .modelspec import ModelSpec


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
    """The model's config with its instance groups as they run where `gpu_count` GPUs are seen (resolve);
    an ensemble's as it is (it has no instances: its steps' models do)."""
    if is_ensemble(spec.config):
        return spec.config
    return {**spec.config, "instance_group": resolve(spec, gpu_count)}


def revision_parts(config: dict[str, Any]) -> tuple[bytes, str]:
    """What a version's revision is made of: the config but its instance groups, canonical (hashed with the
    files), and the instance groups' digest, the revision's end after a '.'. A reload that moves the end
    alone is Triton's in-place instance update (same_but_instances)."""
    rest = {k: v for k, v in config.items() if k != "instance_group"}
    body = orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)
    groups = orjson.dumps(config.get("instance_group") or [], option=orjson.OPT_SORT_KEYS)
    return body, "." + hashlib.sha256(groups).hexdigest()[:12]


def same_but_instances(old: str, new: str) -> bool:
    """Whether revisions `old` and `new` (revision_parts) have the same files and config but perhaps their
    instance groups: as Triton's, a load that moves one to the other adds or removes instances in place."""
    base = old.partition(".")[0]
    return bool(base) and "." in old and "." in new and base == new.partition(".")[0]
