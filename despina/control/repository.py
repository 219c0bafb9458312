"""A Triton model repository on local disk: <repo>/<model>/config.pbtxt and numeric version folders."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..contract.catalog import CatalogEntry
from ..contract.errors import ConfigError, DespinaError
from ..contract.modelconfig import ModelConfig, check_model_name, normalize, parse_text, to_dict, validate
from ..workers.backends import backend_class

log = logging.getLogger("despina.control")

GUESS_BY_FILE = {"model.onnx": "onnxruntime", "model.pt": "pytorch", "model.pt2": "pytorch",
                 "model.savedmodel": "tensorflow", "model.py": "python"}


def version_folders(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir()
                  if p.is_dir() and p.name.isdigit() and int(p.name) > 0)


def select_versions(config: Any, available: list[int]) -> list[int]:
    """Triton's version_policy: latest {num_versions} (default 1), all, or specific {versions}."""
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return available
    if which == "specific":
        missing = [v for v in policy.specific.versions if v not in available]
        if missing:
            raise ConfigError(f"model '{config.name}': field 'version_policy.specific' names versions "
                              f"{missing} that have no folder")
        return sorted(policy.specific.versions)
    n = policy.latest.num_versions or 1
    return available[-n:]


def load_model(model_dir: Path) -> CatalogEntry:
    """Parse, normalize, auto-complete and validate one model folder."""
    name = check_model_name(model_dir.name)
    config_file = model_dir / "config.pbtxt"
    available = version_folders(model_dir)
    if config_file.exists():
        config = parse_text(name, config_file.read_text())
    else:
        config = ModelConfig()
        config.backend = _guess_backend(name, model_dir, available)
    normalize(name, config)
    selected = select_versions(config, available)
    if not selected:
        raise ConfigError(f"model '{name}': no numeric version folder holds the model")
    backend_class(config.backend).auto_complete(config, model_dir / str(selected[-1]))
    validate(config)
    return CatalogEntry(name, str(model_dir.resolve()), to_dict(config), tuple(selected),
                        available=tuple(available))


def _guess_backend(name: str, model_dir: Path, available: list[int]) -> str:
    for version in reversed(available):
        for filename, backend in GUESS_BY_FILE.items():
            if (model_dir / str(version) / filename).exists():
                return backend
    raise ConfigError(f"model '{name}': no config.pbtxt and no model file Despina recognizes")


def scan(root: Path) -> dict[str, CatalogEntry]:
    """Every model folder under root; a model that cannot load is kept, UNAVAILABLE, with its reason."""
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a folder")
    found: dict[str, CatalogEntry] = {}
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            found[model_dir.name] = load_model(model_dir)
        except DespinaError as exc:
            log.error("%s", exc.message)
            found[model_dir.name] = CatalogEntry(model_dir.name, str(model_dir.resolve()), {}, (),
                                                 state="UNAVAILABLE", reason=exc.message)
    return found
