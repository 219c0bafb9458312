"""A Python model's own environment: Triton's EXECUTION_ENV_PATH parameter.

    parameters: { key: "EXECUTION_ENV_PATH", value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }

names a packed environment (a conda-pack or venv tarball, .tar.gz or .tgz) or an unpacked one (a
folder); `$$TRITON_MODEL_DIRECTORY` is the model's folder. The model's process then runs on that
environment's interpreter (`bin/python3`, else `bin/python`) with its `bin` first on PATH and its `lib`
on LD_LIBRARY_PATH, as Triton's stub runs after `source bin/activate`, so the model imports what the
environment holds. The process needs only the standard library and numpy there. A tarball is unpacked
once into the temporary folder, keyed by its path, size, modification and change times, and reused by
every instance, worker and load after. (The change time because a copy that keeps the modification time
(`cp -p`, `rsync -a`) of an archive of the same size would otherwise run the old environment.)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...contract.errors import ConfigError

PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
ARCHIVES = (".tar.gz", ".tgz", ".tar")
_unpacking = threading.Lock()


@dataclass(frozen=True, slots=True)
class Interpreter:
    """How a model's process starts: the Python to run and what to add to its environment."""

    python: str
    env: dict[str, str] | None = None  # None: the worker's own environment

    def environ(self) -> dict[str, str] | None:
        if self.env is None:
            return None
        return {**os.environ, **self.env}


def interpreter(model: str, parameters: dict[str, Any], model_dir: Path, default: str) -> Interpreter:
    """The interpreter the config's EXECUTION_ENV_PATH gives (`parameters` in Triton's JSON form), or
    `default` (the worker's own) without one; ConfigError when the environment cannot be used."""
    raw = parameters.get(PARAMETER)
    value = raw.get("string_value", "") if isinstance(raw, dict) else ""
    if not value:
        return Interpreter(default)
    where = f"model '{model}': parameter {PARAMETER} {value!r}"
    path = Path(value.replace(MODEL_DIRECTORY, str(model_dir))).expanduser()
    if not path.is_absolute():
        path = model_dir / path
    if not path.exists():
        raise ConfigError(f"{where}: no such file or folder ({path})")
    root = path if path.is_dir() else _unpacked(path, where)
    inner = [p for p in root.iterdir() if p.is_dir()] if not (root / "bin").is_dir() else []
    if len(inner) == 1 and (inner[0] / "bin").is_dir():  # an archive of the folder, not of its contents
        root = inner[0]
    for name in ("python3", "python"):
        python = root / "bin" / name
        if python.exists():
            break
    else:
        raise ConfigError(f"{where}: the environment has no bin/python3 or bin/python")
    path_var = f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    libs = os.pathsep.join(p for p in (str(root / "lib"), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return Interpreter(str(python), {"PATH": path_var, "LD_LIBRARY_PATH": libs, "CONDA_PREFIX": str(root),
                                     "PYTHONNOUSERSITE": "1"})


def _unpacked(archive: Path, where: str) -> Path:
    """The archive unpacked (once) into the temporary folder."""
    if not archive.name.endswith(ARCHIVES):
        raise ConfigError(f"{where}: expected a folder or a .tar.gz, .tgz or .tar archive")
    stat = archive.stat()
    key = f"{archive.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    base = Path(tempfile.gettempdir()) / "despina-python-envs"
    final = base / digest
    with _unpacking:
        if final.is_dir():
            return final
        work = base / f".{digest}-{uuid.uuid4().hex}"
        try:
            work.mkdir(parents=True)
            with tarfile.open(archive) as tar:
                tar.extractall(work, filter="tar")  # nothing outside the folder, no setuid bits
            try:
                os.rename(work, final)
            except OSError:  # another process unpacked it first
                if not final.is_dir():
                    raise
        except (OSError, tarfile.TarError) as exc:
            raise ConfigError(f"{where}: cannot unpack it: {exc}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
