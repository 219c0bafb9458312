"""Triton's checksum repository agent: a model's config may list files of its folder with their MD5
(`model_repository_agents { agents [ { name: "checksum" parameters { key: "MD5:1/model.onnx" value:
"<hex>" } } ] }`), and the model does not load unless each file's digest is the one given. The keys are
checked when the config is read (contract/unsupported.py); the files where the worker loads them."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ..contract.errors import ConfigError, InvalidArgument
from ..registry.base import check_relative

CHUNK = 1 << 20


def listed(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(file relative to the model's folder, its expected MD5 in hex) for each file the checksum agent
    lists."""
    agents = (config.get("model_repository_agents") or {}).get("agents") or ()
    return [(key.partition(":")[2], value) for agent in agents if agent.get("name") == "checksum"
            for key, value in (agent.get("parameters") or {}).items()]


def listed_paths(config: dict[str, Any]) -> list[str]:
    """The files the checksum agent lists: a worker fetching a remote model's files fetches them too, of
    whichever version they are (Triton copies the whole model folder before its agent runs)."""
    return [path for path, _ in listed(config)]


def verify(model: str, folder: Path, config: dict[str, Any]) -> None:
    """Each listed file's MD5 against the config's, in the words of Triton's agent."""
    for relative, expected in listed(config):
        digest = hashlib.md5(usedforsecurity=False)
        try:
            check_relative(relative)
        except InvalidArgument as exc:
            raise ConfigError(f"model '{model}': checksum agent: {exc.message}") from None
        try:
            with open(folder / relative, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise ConfigError(f"model '{model}': checksum agent: cannot read file {relative}: "
                              f"{exc.strerror}") from None
        if (got := digest.hexdigest()) != expected.lower():
            raise ConfigError(f"model '{model}': mismatched MD5 hash for file {relative}, expect: "
                              f"{expected}, got: {got}")
