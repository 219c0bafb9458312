"""A local cache of model artifacts, keyed by content (ETag and size).

Files live once under `blobs/`; a model folder under `models/<name>/<digest of its manifest>/` is
hard links to them. Both are built under `tmp/` and renamed into place (a file synced to the disk first:
after a power loss it is whole or absent), so a reader never sees half a file or half a folder, and
processes on one machine (control plane and workers) share the cache.
A folder that is already there costs no download; a new version downloads only the files that changed.

The cache keeps itself under `max_bytes` (eviction.py): after it builds a folder, the folders used least
recently go first, never one used within `lease_s`. A disk that fills before the limit does (a volume
smaller than it, files beside the cache) has the same folders evicted for room, and when none is left to
evict the fetch fails with an error that names the cache, not the registry. A process taking a folder
that is there marks it used under the cache's shared lock, which eviction takes exclusively: a folder
handed out is whole, and stays so for the lease.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..contract.errors import InvalidArgument, Unavailable
from .base import FileInfo, check_relative, digest
from .eviction import CacheEviction

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger("despina.registry")

Download = Callable[[FileInfo, Path], None]   # fetch one file to a local path
LEASE_S = 600.0   # a folder or blob used this recently is in use: never evicted
FULL = (errno.ENOSPC, errno.EDQUOT)
# what the cache's own disk answers when it cannot take a file: the deployment's fault, not the registry's
LOCAL = (*FULL, errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass
class CacheStats:
    downloads: int = 0          # files fetched
    downloaded_bytes: int = 0
    reused: int = 0             # files found in the cache
    folders: int = 0            # model folders built
    evicted_folders: int = 0
    evicted_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "despina"


class ArtifactCache(CacheEviction):
    def __init__(self, root: str | Path | None = None, max_bytes: int = 0, lease_s: float = LEASE_S) -> None:
        self.root = Path(root) if root else default_cache_dir()
        self.blobs, self.models, self.tmp = self.root / "blobs", self.root / "models", self.root / "tmp"
        try:
            self._make_dirs()
        except OSError:  # a read-only or full disk: each fetch says so, as the model's reason
            pass
        self.max_bytes, self.lease_s = max_bytes, lease_s
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._warned_full = False

    @classmethod
    def from_settings(cls, settings: Settings) -> ArtifactCache:
        return cls(settings.cache_dir, int(settings.cache_max_gb * 2**30))

    def _make_dirs(self) -> None:
        for d in (self.blobs, self.models, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    def folder(self, name: str, files: Sequence[FileInfo], download: Download) -> Path:
        """The local folder holding exactly `files`, fetching the ones not cached yet. A disk that
        cannot take them (full, read-only) raises Unavailable naming the cache: it may pass."""
        try:
            self._make_dirs()
            return self._folder(name, files, download)
        except OSError as exc:
            if exc.errno not in LOCAL:
                raise
            hint = "DESPINA_CACHE_DIR must be a folder this process can write"
            if exc.errno in FULL:
                hint = (f"no room for model '{name}' ({sum(f.size for f in files) / 1e6:.1f} MB) beside what "
                        f"models loaded in the last {self.lease_s / 60:.0f} min use; free space there or "
                        "give DESPINA_CACHE_DIR a bigger volume")
            raise Unavailable(f"artifact cache {self.root}: {exc.strerror}: {hint}") from None

    def _folder(self, name: str, files: Sequence[FileInfo], download: Download) -> Path:
        paths, longest = {f.path for f in files}, self._name_max()
        for f in files:  # a store keeps keys as written: 'mlp//model.onnx' lists as '/model.onnx'
            check_relative(f.path)
            if any(len(part.encode()) > longest for part in f.path.split("/")):  # S3 takes 1,024 bytes
                raise InvalidArgument(f"model '{name}': '{f.path}' cannot be a file of the model on this "
                                      f"disk: a name longer than {longest} bytes")
            folder = f.path.rpartition("/")[0]
            while folder:  # keys 'mlp/1' and 'mlp/1/model.onnx' both: no disk holds that
                if folder in paths:
                    raise InvalidArgument(f"model '{name}': '{folder}' is both a file and a folder in the "
                                          "registry")
                folder = folder.rpartition("/")[0]
        final = self.models / name / digest(f.pack() for f in files)
        with self._evicting(fcntl.LOCK_SH):  # no trim removes it between this look and the touch
            found = final.is_dir()
            if found:
                touch(final)
        if found:
            with self._lock:
                self.stats.reused += len(files)
            return final
        blobs = [self.blob(f, download) for f in files]  # first: a folder being built lives a moment only
        work = self.tmp / f"{name}-{uuid.uuid4().hex}"
        try:
            for f, blob in zip(files, blobs):
                dest = work / f.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self._link(blob, dest)
                except FileNotFoundError:  # evicted by another process between our look and the link
                    self._link(self.blob(f, download), dest)
            work.mkdir(parents=True, exist_ok=True)
            with self._evicting(fcntl.LOCK_SH):  # no trim removes the model's folder before the rename
                final.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(work, final)
                except OSError:
                    if not final.is_dir():  # not a concurrent builder's win: a real failure
                        raise
                touch(final)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
        with self._lock:
            self.stats.folders += 1
        if self.max_bytes:
            self.trim()
        return final

    def _name_max(self) -> int:
        """The longest file name the cache's disk takes."""
        try:
            return os.pathconf(self.root, "PC_NAME_MAX")
        except (OSError, ValueError):
            return 255

    @staticmethod
    def _link(blob: Path, dest: Path) -> None:
        try:
            os.link(blob, dest)
        except FileNotFoundError:
            raise
        except OSError:  # another file system, or no hard links there
            shutil.copyfile(blob, dest)
            synced(dest)  # a folder is trusted once renamed into place: its copies too

    def blob(self, f: FileInfo, download: Download) -> Path:
        key = hashlib.sha256(f"{f.etag}\0{f.size}".encode()).hexdigest()
        path = self.blobs / key[:2] / key
        if self._reuse(path, f):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._fetching(key):
            if self._reuse(path, f):  # another process (a worker beside this one) fetched it meanwhile
                return path
            try:
                self._fetch(f, path, download)
            except OSError as exc:
                if exc.errno not in FULL or not self.make_room(f.size):
                    raise
                self._fetch(f, path, download)
        with self._lock:
            self.stats.downloads += 1
            self.stats.downloaded_bytes += f.size
        log.debug("cache: fetched %s (%d bytes)", f.path, f.size)
        return path

    def _fetch(self, f: FileInfo, path: Path, download: Download) -> None:
        part = self.tmp / f"{path.name}.{uuid.uuid4().hex}.part"
        try:
            download(f, part)
            got = part.stat().st_size
            if got != f.size:
                raise OSError(f"{f.path}: downloaded {got} bytes, the registry lists {f.size}")
            synced(part)
            os.chmod(part, 0o444)  # shared by hard links: nobody may write through one
            os.replace(part, path)
            touch(path)
        finally:
            part.unlink(missing_ok=True)

    def _reuse(self, path: Path, f: FileInfo) -> bool:
        if not (path.is_file() and path.stat().st_size == f.size):
            return False
        touch(path)  # in use again: not garbage for the next trim, linked or not
        with self._lock:
            self.stats.reused += 1
        return True

    @contextmanager
    def _fetching(self, key: str) -> Iterator[None]:
        """One download of a blob at a time on this machine (workers loading one model together): the
        others wait for it, then find the blob. The lock file goes with the lock; one who opened it
        before finds the blob there, and at worst (the download failed) two fetch at once again."""
        lock = self.tmp / f"{key}.lock"
        with lock.open("ab") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            try:
                yield
            finally:
                lock.unlink(missing_ok=True)
                fcntl.flock(held, fcntl.LOCK_UN)

    def holds(self, path: Path) -> bool:
        """Whether `path` is one of this cache's model folders."""
        return path.parent.parent == self.models


def synced(path: Path) -> None:
    """A file's data on the disk, before a rename names it: else a power loss may leave the name with the
    right size and zeros, which the cache (it checks sizes) would trust for good. A rename lost to one is
    harmless (the file is fetched again): the folder is not synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch(path: Path) -> None:
    """Mark a cached folder or blob as in use now (its mtime)."""
    try:
        os.utime(path)
    except OSError:
        pass
