"""A local cache of model artifacts, keyed by content (ETag and size).

Files live once under `blobs/`; a model folder under `models/<name>/<digest of its manifest>/` is
hard links to them. Both are built under `tmp/` and renamed into place, so a reader never sees half
a file or half a folder, and processes on one machine (control plane and workers) share the cache.
A folder that is already there costs no download; a new version downloads only the files that changed.

The cache keeps itself under `max_bytes`: after it builds a folder, the folders used least recently
go first, then every blob no folder links to any more (a blob's link count says so). A folder used
within `lease_s` is never removed: workers touch the folders they serve from at every heartbeat, so
a loaded model keeps its files however long it serves, whichever process on the machine trims. When
everything left is in use the cache stays over its limit, and says so.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..contract.errors import InvalidArgument
from .base import FileInfo, check_relative, digest

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger("despina.registry")

Download = Callable[[FileInfo, Path], None]   # fetch one file to a local path
LEASE_S = 600.0   # a folder or blob used this recently is in use: never evicted


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


class ArtifactCache:
    def __init__(self, root: str | Path | None = None, max_bytes: int = 0, lease_s: float = LEASE_S) -> None:
        self.root = Path(root) if root else default_cache_dir()
        self.blobs, self.models, self.tmp = self.root / "blobs", self.root / "models", self.root / "tmp"
        for d in (self.blobs, self.models, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.lease_s = max_bytes, lease_s
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._warned_full = False

    @classmethod
    def from_settings(cls, settings: Settings) -> ArtifactCache:
        return cls(settings.cache_dir, int(settings.cache_max_gb * 2**30))

    def folder(self, name: str, files: Sequence[FileInfo], download: Download) -> Path:
        """The local folder holding exactly `files`, fetching the ones not cached yet."""
        paths = {f.path for f in files}
        for f in files:  # a store keeps keys as written: 'mlp//model.onnx' lists as '/model.onnx'
            check_relative(f.path)
            folder = f.path.rpartition("/")[0]
            while folder:  # keys 'mlp/1' and 'mlp/1/model.onnx' both: no disk holds that
                if folder in paths:
                    raise InvalidArgument(f"model '{name}': '{folder}' is both a file and a folder in the "
                                          "registry")
                folder = folder.rpartition("/")[0]
        final = self.models / name / digest(f.pack() for f in files)
        if final.is_dir():
            touch(final)
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

    @staticmethod
    def _link(blob: Path, dest: Path) -> None:
        try:
            os.link(blob, dest)
        except FileNotFoundError:
            raise
        except OSError:  # another file system, or no hard links there
            shutil.copyfile(blob, dest)

    def blob(self, f: FileInfo, download: Download) -> Path:
        key = hashlib.sha256(f"{f.etag}\0{f.size}".encode()).hexdigest()
        path = self.blobs / key[:2] / key
        if self._reuse(path, f):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._fetching(key):
            if self._reuse(path, f):  # another process (a worker beside this one) fetched it meanwhile
                return path
            part = self.tmp / f"{key}.{uuid.uuid4().hex}.part"
            try:
                download(f, part)
                got = part.stat().st_size
                if got != f.size:
                    raise OSError(f"{f.path}: downloaded {got} bytes, the registry lists {f.size}")
                os.chmod(part, 0o444)  # shared by hard links: nobody may write through one
                os.replace(part, path)
                touch(path)
            finally:
                part.unlink(missing_ok=True)
        with self._lock:
            self.stats.downloads += 1
            self.stats.downloaded_bytes += f.size
        log.debug("cache: fetched %s (%d bytes)", f.path, f.size)
        return path

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

    # -- staying under the limit -------------------------------------------------------------------

    def holds(self, path: Path) -> bool:
        """Whether `path` is one of this cache's model folders."""
        return path.parent.parent == self.models

    def usage(self) -> int:
        """Bytes on disk: every blob once, plus folder files that are copies rather than links."""
        total = sum(st.st_size for _, st in self._blobs())
        for path in self.models.rglob("*"):
            try:
                st = path.lstat()
            except OSError:
                continue
            if path.is_file() and st.st_nlink == 1:
                total += st.st_size
        return total

    def trim(self) -> int:
        """Evict folders used least recently, and blobs none links to, until under max_bytes (or
        everything left is in use); returns the bytes freed. A failure is logged, never raised: the
        cache is then only bigger than it should be. What a process that died mid-fetch left in tmp/
        goes, with a limit or without."""
        try:
            freed = self._clear_tmp()
            return freed + self._trim() if self.max_bytes else freed
        except OSError as exc:
            log.warning("cache %s: trimming failed: %s", self.root, exc)
            return 0

    def _trim(self) -> int:
        freed = self._collect_garbage()  # blobs left unlinked by another process's trim, say
        used = self.usage()
        now = time.time()
        for mtime, folder in sorted(self._folders()):
            if used <= self.max_bytes:
                break
            if now - mtime < self.lease_s:
                break  # this one and every later one is in use
            shutil.rmtree(folder, ignore_errors=True)
            try:
                folder.parent.rmdir()  # the model's last folder: its directory goes too
            except OSError:
                pass
            self._collect_garbage()
            before, used = used, self.usage()
            freed_now = max(0, before - used)  # its own copies too, where files could not be linked
            freed += freed_now
            with self._lock:
                self.stats.evicted_folders += 1
            log.info("cache: evicted %s/%s (unused for %.0f min, %.1f MB freed); %.1f of %.1f MB used",
                     folder.parent.name, folder.name, (now - mtime) / 60, freed_now / 1e6, used / 1e6,
                     self.max_bytes / 1e6)
        with self._lock:
            self.stats.evicted_bytes += freed
        if used > self.max_bytes and not self._warned_full:
            self._warned_full = True
            log.warning("cache %s holds %.1f MB, over its limit of %.1f MB, all of it in use by models "
                        "loaded in the last %.0f min", self.root, used / 1e6, self.max_bytes / 1e6,
                        self.lease_s / 60)
        elif used <= self.max_bytes:
            self._warned_full = False
        return freed

    def _clear_tmp(self) -> int:
        """Remove the entries of tmp/ untouched for the lease: a download's part file (written to all
        along, and boto3 gives up on a store silent for a minute) or a folder being built (blobs are
        fetched before it is made) of a process killed meanwhile. Nobody else would ever remove them."""
        now, freed, removed = time.time(), 0, 0
        for path in self.tmp.iterdir():
            try:
                st = path.lstat()
                if now - st.st_mtime < self.lease_s:
                    continue
                if path.is_dir() and not path.is_symlink():
                    # a folder's files are mostly links to blobs: only their own copies free anything
                    freed += sum(p.lstat().st_size for p in path.rglob("*")
                                 if p.is_file() and p.lstat().st_nlink == 1)
                    shutil.rmtree(path)
                else:
                    path.unlink()
                    freed += st.st_size
                removed += 1
            except OSError:  # removed meanwhile, or by its own process
                continue
        if removed:
            log.info("cache: removed %d entries a fetch left half-done in %s (%.1f MB)", removed, self.tmp,
                     freed / 1e6)
        return freed

    def _folders(self) -> Iterator[tuple[float, Path]]:
        for model in self.models.iterdir():
            if not model.is_dir():
                continue
            for folder in model.iterdir():
                try:
                    yield folder.stat().st_mtime, folder
                except OSError:  # removed meanwhile
                    continue

    def _blobs(self) -> Iterator[tuple[Path, os.stat_result]]:
        for path in self.blobs.glob("*/*"):
            try:
                yield path, path.stat()
            except OSError:  # removed meanwhile
                continue

    def _collect_garbage(self) -> int:
        """Remove blobs no folder links to that nobody used within the lease (a blob just fetched
        for a folder being built is not linked yet, and is recent)."""
        now, freed = time.time(), 0
        for path, st in self._blobs():
            if st.st_nlink == 1 and now - st.st_mtime >= self.lease_s:
                try:
                    path.unlink()
                    freed += st.st_size
                except OSError:
                    pass
        return freed


def touch(path: Path) -> None:
    """Mark a cached folder or blob as in use now (its mtime)."""
    try:
        os.utime(path)
    except OSError:
        pass
