"""A local cache of model artifacts, keyed by content (ETag and size).

Files live once under `blobs/`; a model folder under `models/<name>/<digest of its manifest>/` is
hard links to them. Both are built under `tmp/` and renamed into place, so a reader never sees half
a file or half a folder, and processes on one machine (control plane and workers) share the cache.
A folder that is already there costs no download; a new version downloads only the files that changed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .base import FileInfo, digest

log = logging.getLogger("despina.registry")

Download = Callable[[FileInfo, Path], None]   # fetch one file to a local path


@dataclass
class CacheStats:
    downloads: int = 0          # files fetched
    downloaded_bytes: int = 0
    reused: int = 0             # files found in the cache
    folders: int = 0            # model folders built

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "despina"


class ArtifactCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else default_cache_dir()
        self.blobs, self.models, self.tmp = self.root / "blobs", self.root / "models", self.root / "tmp"
        for d in (self.blobs, self.models, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def folder(self, name: str, files: Sequence[FileInfo], download: Download) -> Path:
        """The local folder holding exactly `files`, fetching the ones not cached yet."""
        final = self.models / name / digest(f.pack() for f in files)
        if final.is_dir():
            with self._lock:
                self.stats.reused += len(files)
            return final
        work = self.tmp / f"{name}-{uuid.uuid4().hex}"
        try:
            for f in files:
                blob = self.blob(f, download)
                dest = work / f.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(blob, dest)
                except OSError:  # another file system, or no hard links there
                    shutil.copyfile(blob, dest)
            work.mkdir(parents=True, exist_ok=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(work, final)
            except OSError:
                if not final.is_dir():  # not a concurrent builder's win: a real failure
                    raise
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
        with self._lock:
            self.stats.folders += 1
        return final

    def blob(self, f: FileInfo, download: Download) -> Path:
        key = hashlib.sha256(f"{f.etag}\0{f.size}".encode()).hexdigest()
        path = self.blobs / key[:2] / key
        if path.is_file() and path.stat().st_size == f.size:
            with self._lock:
                self.stats.reused += 1
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        part = self.tmp / f"{key}.{uuid.uuid4().hex}.part"
        try:
            download(f, part)
            got = part.stat().st_size
            if got != f.size:
                raise OSError(f"{f.path}: downloaded {got} bytes, the registry lists {f.size}")
            os.chmod(part, 0o444)  # shared by hard links: nobody may write through one
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        with self._lock:
            self.stats.downloads += 1
            self.stats.downloaded_bytes += f.size
        log.debug("cache: fetched %s (%d bytes)", f.path, f.size)
        return path
