"""A Python model's own environment: Triton's EXECUTION_ENV_PATH parameter.

    parameters: { key: "EXECUTION_ENV_PATH", value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }

names a packed environment (a conda-pack or venv tarball, .tar.gz or .tgz) or an unpacked one (a
folder); `$$TRITON_MODEL_DIRECTORY` is the model's folder. The model's process then runs on that
environment's interpreter (`bin/python3`, else `bin/python`) with its `bin` first on PATH and its `lib`
on LD_LIBRARY_PATH, as Triton's stub runs after `source bin/activate`, so the model imports what the
environment holds. The process needs only the standard library and numpy there. A tarball is unpacked
once into `python-envs/` in the artifact cache's folder (DESPINA_CACHE_DIR, the volume given to models),
keyed by its path, size, modification and change times, and reused by every instance, worker and load
after. (The change time because a copy that keeps the modification time (`cp -p`, `rsync -a`) of an
archive of the same size would otherwise run the old environment.) Not the temporary folder: on many
systems (systemd's tmp.mount: Debian 13, Fedora, Arch) that is a tmpfs, and an environment of hundreds of
MB unpacked there took as much memory, per version. Where the cache's folder cannot be written (a
read-only home), the temporary folder it is.

Each model update brings a new archive, and so a new unpacked folder of hundreds of MB: the folders
unused for LEASE_S go at the next unpack and at workers' trims (trim()). A folder is in use while a
process holds a shared flock on it: the model's process inherits one from the worker and keeps it as long
as it runs (its death lets it go, however it dies). A trim takes an exclusive lock before it moves a
folder out of the way, so a folder handed out is whole, and stays so while a process runs on it.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...contract.errors import ConfigError
from ...registry.cache import default_cache_dir

log = logging.getLogger("despina.worker")

PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
ARCHIVES = (".tar.gz", ".tgz", ".tar")
LEASE_S = 600.0  # an unpacked environment used this recently stays for the next load (a reload, a restart)
_unpacking = threading.Lock()


class Hold:
    """A shared lock on an unpacked environment's folder (an open descriptor of it): no trim removes the
    folder while this process, or a child that inherited the descriptor, keeps it open."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True, slots=True)
class Interpreter:
    """How a model's process starts: the Python to run and what to add to its environment. As a context
    manager it lets go of its environment's hold at the end: start the process within it."""

    python: str
    env: dict[str, str] | None = None  # None: the worker's own environment
    hold: Hold | None = field(default=None, compare=False, repr=False)  # an unpacked archive's

    def environ(self) -> dict[str, str] | None:
        if self.env is None:
            return None
        return {**os.environ, **self.env}

    def pass_fds(self) -> tuple[int, ...]:
        """The descriptors the model's process must inherit: its environment's hold, kept while it runs."""
        return (self.hold.fd,) if self.hold is not None and self.hold.fd >= 0 else ()

    def __enter__(self) -> Interpreter:
        return self

    def __exit__(self, *_: object) -> None:
        if self.hold is not None:
            self.hold.close()


def envs_dir() -> Path:
    """Where archives are unpacked: python-envs/ in the artifact cache's folder, else the temporary folder's
    despina-python-envs/ (the module's docstring says why)."""
    configured = os.environ.get("DESPINA_CACHE_DIR")
    folder = (Path(configured) if configured else default_cache_dir()) / "python-envs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK | os.X_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "despina-python-envs"


def interpreter(model: str, parameters: dict[str, Any], model_dir: Path, default: str,
                envs: Path | None = None) -> Interpreter:
    """The interpreter the config's EXECUTION_ENV_PATH gives (`parameters` in Triton's JSON form), or
    `default` (the worker's own) without one; ConfigError when the environment cannot be used. An archive
    is unpacked under `envs` (envs_dir()), and held until the Interpreter's `with` ends."""
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
    if path.is_dir():
        return _on(path, where, None)
    root, hold = _unpacked(path, where, envs or envs_dir())
    try:
        return _on(root, where, hold)
    except ConfigError:
        hold.close()
        raise


def _on(root: Path, where: str, hold: Hold | None) -> Interpreter:
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
                                     "PYTHONNOUSERSITE": "1"}, hold)


def _unpacked(archive: Path, where: str, envs: Path) -> tuple[Path, Hold]:
    """The archive unpacked (once) under `envs`, and a hold on it."""
    if not archive.name.endswith(ARCHIVES):
        raise ConfigError(f"{where}: expected a folder or a .tar.gz, .tgz or .tar archive")
    stat = archive.stat()
    key = f"{archive.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    final = envs / hashlib.sha256(key.encode()).hexdigest()[:16]
    with _unpacking:
        for _ in range(5):  # each turn lost only to another process's unpack or trim of the same folder
            if (hold := _take(final)) is not None:
                return final, hold
            if (hold := _unpack(archive, final, where)) is not None:
                break
        else:
            raise ConfigError(f"{where}: its unpacked folder {final} kept being removed; try again")
    trim(envs)  # a new environment: the ones unused for the lease go
    return final, hold


def _take(final: Path) -> Hold | None:
    """A hold on the unpacked folder, marked used now; None where it is not there (or was just trimmed)."""
    try:
        fd = os.open(final, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot open the unpacked environment {final}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a trim moves the folder away
        if not os.path.samestat(os.fstat(fd), os.stat(final)):
            raise FileNotFoundError(final)  # moved away, another unpack in its place
        _used(fd)
    except OSError:
        os.close(fd)
        return None
    return Hold(fd)


def _unpack(archive: Path, final: Path, where: str) -> Hold | None:
    """Unpack beside `final` and rename into place, held all along (a trim leaves a folder being unpacked
    alone, however long it takes); None where another process renamed its own there first."""
    work = final.parent / f".{final.name}-{uuid.uuid4().hex}"
    fd = -1
    try:
        work.mkdir(parents=True)
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="tar")  # nothing outside the folder, no setuid bits
        _used(fd)  # extractall gave it the archive's time for '.'
        try:
            os.rename(work, final)  # the hold goes with it
        except OSError:
            if not final.is_dir():
                raise
            return None  # another process unpacked it first: take that one
        hold, fd = Hold(fd), -1
        return hold
    except (OSError, tarfile.TarError) as exc:
        raise ConfigError(f"{where}: cannot unpack it: {exc}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)  # there only where it was not renamed into place


def _used(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:  # another user's folder: the lease counts from its unpack, the hold still protects it
        pass


def trim(envs: Path | None = None, lease_s: float = LEASE_S) -> int:
    """Remove the unpacked environments no process holds that were not used within `lease_s` (and what an
    unpack or a trim killed half way left); the number removed. Never raises: a folder that cannot go
    stays for the next trim."""
    envs = envs or envs_dir()
    try:
        entries = list(envs.iterdir())
    except OSError:  # none unpacked yet
        return 0
    now, removed = time.time(), 0
    for path in entries:
        removed += _remove_unused(path, now, lease_s)
    if removed:
        log.info("python environments: removed %d unpacked environments unused for %.0f min from %s",
                 removed, lease_s / 60, envs)
    return removed


def _remove_unused(path: Path, now: float, lease_s: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # not a folder, or gone
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused while any process holds it
        st = os.fstat(fd)
        if now - st.st_mtime < lease_s:
            return False
        if not path.name.startswith("."):  # out of the way first: a taker that opened it finds it gone
            if not os.path.samestat(st, os.stat(path)):
                return False
            trash = path.parent / f".trash-{uuid.uuid4().hex}"
            os.rename(path, trash)
            path = trash
    except OSError:  # held (BlockingIOError), or removed meanwhile
        return False
    finally:
        os.close(fd)
    shutil.rmtree(path, ignore_errors=True)
    return True
