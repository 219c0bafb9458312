"""From a model folder in the registry to a catalog entry: parse, select versions, auto-complete, validate."""
from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Any

from ..contract.catalog import CatalogEntry
from ..contract.ensemble import PLATFORM, Ensemble, is_ensemble
from ..contract.errors import ConfigError, DespinaError
from ..contract.instance_groups import revision_parts
from ..contract.modelconfig import (
    ModelConfig,
    check_model_name,
    complete,
    normalize,
    parse_json,
    parse_text,
    to_dict,
    validate,
)
from ..contract.unsupported import ignored
from ..registry import ModelFiles, Registry
from ..registry.base import check_relative
from ..workers import checksums
from ..workers.backends import backend_class

log = logging.getLogger("despina.control")

GUESS_BY_FILE = {"model.onnx": "onnxruntime", "model.pt": "pytorch", "model.pt2": "pytorch",
                 "model.savedmodel": "tensorflow", "model.py": "python"}
GUESS_BY_SUFFIX = {Path(filename).suffix: backend for filename, backend in GUESS_BY_FILE.items()}
# the warnings about ignored fields said so far: a model read again unchanged (a poll, a load call, a
# control plane taking over) does not say them again
_warned: set[str] = set()


def select_versions(config: Any, available: list[int]) -> list[int]:
    """Triton's version_policy: latest {num_versions} (default 1), all, or specific {versions}; one that
    chooses none of them ("version_policy { }") is all, as Triton's VersionsToLoad reads it."""
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which in ("all", None):
        return available
    if which == "specific":  # as Triton's: the versions named that are there (one named twice is one)
        chosen = sorted(set(policy.specific.versions) & set(available))
        if not chosen:
            raise ConfigError(f"model '{config.name}': field 'version_policy.specific' names versions "
                              f"{sorted(set(policy.specific.versions))}, none of which has a folder (at "
                              f"least one version must be available under the version policy of model "
                              f"'{config.name}')")
        return chosen
    if not policy.latest.num_versions:  # (normalize() fills 1 where the config has no version_policy)
        raise ConfigError(f"model '{config.name}': field 'version_policy.latest.num_versions' is 0: no "
                          "version is selected (at least one version must be available under the version "
                          "policy)")
    return available[-policy.latest.num_versions:]


def read_model(registry: Registry, model: ModelFiles, override: dict[str, Any] | None = None,
               rate_limited: bool = False) -> CatalogEntry:
    """Parse, normalize, auto-complete and validate one model folder (`override`: the load API's config;
    `rate_limited`: the workers run Triton's rate limiter, and heed instance groups' rate_limiter)."""
    name = check_model_name(model.name)
    available = model.versions
    paths = {f.path for f in model.files}
    if override is not None:
        config = parse_json(name, override)
    elif "config.pbtxt" in model.folders:
        raise ConfigError(f"model '{name}': config.pbtxt is a folder, not a file")
    elif "config.pbtxt" in paths:
        config = parse_text(name, read_file(registry.folder(model, []), "config.pbtxt", f"model '{name}'"))
    elif not registry.remote and os.path.lexists(Path(model.url) / "config.pbtxt"):
        read_file(Path(model.url), "config.pbtxt", f"model '{name}'")  # a link to nothing, or a loop: why
        raise ConfigError(f"model '{name}': config.pbtxt cannot be read")
    else:
        config = ModelConfig()
    if not config.platform and not config.backend:  # Triton's auto-complete: from the model file
        config.backend = _guess_backend(name, paths, available, config.default_model_filename,
                                        has_config=override is not None or "config.pbtxt" in paths)
    normalize(name, config)
    ensemble = config.backend == PLATFORM
    if ensemble and not available:
        available = [1]  # an ensemble has no files: Triton's empty version folder may be left out
    selected = select_versions(config, available)
    if not selected:
        raise ConfigError(f"model '{name}': no numeric version folder holds the model")
    if ensemble:
        _check_ensemble(config)
    else:
        folder = registry.folder(model, selected[-1:])
        try:
            backend = backend_class(config.backend)
        except ConfigError as exc:
            raise ConfigError(f"model '{name}': {exc.message}") from None
        backend.auto_complete(config, folder / str(selected[-1]))
    complete(config)
    validate(config)
    _warn_ignored(config, rate_limited)
    as_dict = to_dict(config)
    if ensemble:
        Ensemble.from_config(as_dict)  # the graph alone; the models it calls are checked as they come
    body, groups = revision_parts(as_dict)
    return CatalogEntry(
        name, model.url, as_dict, tuple(selected), available=tuple(available),
        revisions={v: model.revision(v, body, checksums.listed_paths(as_dict)) + groups for v in selected},
        files=tuple(f.pack() for f in model.files) if registry.remote else (),
        footprint=footprint(as_dict, model.size(selected), len(selected)),
        labels=_labels(registry, model, config, paths))


def _warn_ignored(config: Any, rate_limited: bool) -> None:
    fields = ignored(config, rate_limited)
    if not fields:
        return
    line = f"model '{config.name}': Despina ignores {'; '.join(fields)}"
    if line not in _warned:
        _warned.add(line)
        log.warning("%s", line)


def _labels(registry: Registry, model: ModelFiles, config: Any, paths: set[str]
            ) -> dict[str, tuple[str, ...]]:
    """Each output's labels, a line each, from its label_filename in the model's folder (Triton's
    classification extension names a class by them)."""
    named = {o.name: o.label_filename for o in config.output if o.label_filename}
    if not named:
        return {}
    where = f"model '{config.name}'"
    for output, filename in named.items():
        try:
            named[output] = check_relative(filename)
        except DespinaError:
            raise ConfigError(f"{where}: output '{output}': label_filename {filename!r} is not a path "
                              "inside the model's folder") from None
        if named[output] not in paths:
            raise ConfigError(f"{where}: output '{output}': label_filename {filename!r} is not in the "
                              "model's folder")
    folder = registry.folder(model, [])
    return {output: tuple(read_file(folder, path, f"{where}: output '{output}'").decode(
                "utf-8", errors="replace").splitlines())
            for output, path in named.items()}


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder"}


def read_file(folder: Path, path: str, where: str) -> bytes:
    """A file of a model's folder, or a ConfigError that says why it cannot be read: a link to nothing, a
    link loop, or something other than a regular file (a FIFO would block the read, and with it every load
    after it, forever)."""
    target = folder / path
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT and target.is_symlink():
            shown = os.fsencode(os.readlink(target)).decode("utf-8", "backslashreplace")  # (text, whatever)
            raise ConfigError(f"{where}: {path} is a symbolic link to '{shown}', which does not exist"
                              ) from None
        raise ConfigError(f"{where}: {path} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
            raise ConfigError(f"{where}: {path} is not a regular file ({kind})")
        try:
            return file.read()
        except OSError as exc:
            raise ConfigError(f"{where}: {path} cannot be read: {exc.strerror}") from None


def _check_ensemble(config: Any) -> None:
    """What Triton asks of an ensemble's config before its graph: declared tensors, no batcher, and no
    instances, optimization or warmup (its steps' models have those)."""
    name = config.name
    if config.WhichOneof("scheduling_choice") != "ensemble_scheduling":
        raise ConfigError(f"model '{name}': platform \"ensemble\" needs field 'ensemble_scheduling'")
    given = {field.name for field, _ in config.ListFields()}
    for field in ("instance_group", "optimization", "model_warmup"):
        if field in given:
            raise ConfigError(f"model '{name}': an ensemble takes no field '{field}' (the models its steps "
                              "call have their own)")
    if not config.input or not config.output:
        raise ConfigError(f"model '{name}': an ensemble declares its inputs and outputs in its config "
                          "(nothing can fill them in)")


def load_model(model_dir: Path) -> CatalogEntry:
    """read_model for one folder on local disk."""
    from ..registry import LocalRegistry

    registry = LocalRegistry(model_dir.parent)
    return read_model(registry, registry.model(model_dir.name))


# What an instance takes beside its copy of the model's weights (a session, its threads' arenas): an
# estimate, so that an instance count no worker can hold is refused by placement, not found out by the
# kernel's OOM killer. A Python-backend instance is a stub process of its own: 37 MB resident, 21 MB of it
# its own (Pss), before its model.py imports anything (CPython 3.11, 2026-12-05)
INSTANCE_BYTES = 16 * 2**20
PYTHON_INSTANCE_BYTES = 48 * 2**20


def footprint(config: dict[str, Any], file_bytes: int, versions: int = 1) -> int:
    """Memory a model is expected to take: its `memory_mb` parameter; else, for each instance of each
    version, a copy of the version's files (each instance loads its own) and INSTANCE_BYTES (a Python
    model's: PYTHON_INSTANCE_BYTES)."""
    raw = parameter(config, "memory_mb")
    try:
        if raw:
            return int(float(raw) * 1024 * 1024)
    except ValueError:
        raise ConfigError(f"model '{config.get('name')}': parameter 'memory_mb' must be a number") from None
    if is_ensemble(config):
        return file_bytes
    instances = sum(max(1, int(g.get("count") or 1)) * max(1, len(g.get("gpus") or ()))
                    for g in config.get("instance_group") or [{}])
    each = PYTHON_INSTANCE_BYTES if config.get("backend") == "python" else INSTANCE_BYTES
    return instances * (file_bytes + versions * each)


def parameter(config: dict[str, Any], key: str) -> str | None:
    """A `parameters { key: ... value: { string_value: ... } }` entry of the config, or None."""
    value = (config.get("parameters") or {}).get(key)
    return value.get("string_value") if isinstance(value, dict) else None


def _guess_backend(name: str, paths: set[str], available: list[int], filename: str, has_config: bool) -> str:
    """The backend of a model whose config names none, from the newest version's model file: one of
    GUESS_BY_FILE, or `filename` (the config's default_model_filename) by its extension."""
    guesses = {filename: GUESS_BY_SUFFIX.get(Path(filename).suffix)} if filename else GUESS_BY_FILE
    for version in reversed(available):
        for file, backend in guesses.items():
            if backend and (f"{version}/{file}" in paths
                            or any(p.startswith(f"{version}/{file}/") for p in paths)):
                return backend
    what = "neither field 'platform' nor field 'backend' is set" if has_config else "no config.pbtxt"
    known = repr(filename) if filename else ", ".join(GUESS_BY_FILE)
    raise ConfigError(f"model '{name}': {what}, and no model file Despina recognizes ({known})")


def unavailable(model: ModelFiles | str, reason: str) -> CatalogEntry:
    name = model if isinstance(model, str) else model.name
    url = "" if isinstance(model, str) else model.url
    return CatalogEntry(name, url, {}, (), state="UNAVAILABLE", reason=reason)


def read_or_report(registry: Registry, model: ModelFiles, override: dict[str, Any] | None = None
                   ) -> CatalogEntry:
    """read_model, with a model that cannot load kept as UNAVAILABLE with its reason (and logged)."""
    try:
        return read_model(registry, model, override)
    except DespinaError as exc:
        log.error("%s", exc.message)
        return unavailable(model, exc.message)
