"""How the artifact cache (cache.py) stays under its limit, and makes room on a full disk.

After the cache builds a folder it trims: the folders used least recently go first, then every blob no
folder links to any more (a blob's link count says so). A folder used within the lease is never removed:
workers touch the folders they serve from at every heartbeat, so a loaded model keeps its files however
long it serves, whichever process on the machine trims. When everything left is in use the cache stays
over its limit, and says so once. A disk that fills first has the same folders evicted for room.

Eviction moves a folder out of `models/` before removing it, under an exclusive lock on the cache's
`lock` file; a process taking a folder that is there marks it used under a shared one (`_evicting`).
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import CacheStats

log = logging.getLogger("despina.registry")


class CacheEviction:
    """The eviction half of ArtifactCache (its base): what it keeps under `max_bytes`, in its folders."""

    root: Path
    blobs: Path
    models: Path
    tmp: Path
    max_bytes: int
    lease_s: float
    stats: CacheStats
    _lock: threading.Lock
    _warned_full: bool

    @contextmanager
    def _evicting(self, how: int) -> Iterator[None]:
        """The cache-wide lock between eviction (LOCK_EX) and taking or placing a folder (LOCK_SH)."""
        with (self.root / "lock").open("ab") as held:
            fcntl.flock(held, how)
            try:
                yield
            finally:
                fcntl.flock(held, fcntl.LOCK_UN)

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
        if not self.tmp.is_dir():  # a disk that never took the cache's folders (each fetch says why)
            return 0
        try:
            freed = self._clear_tmp()
            return freed + self._trim() if self.max_bytes else freed
        except OSError as exc:
            log.warning("cache %s: trimming failed: %s", self.root, exc)
            return 0

    def _trim(self) -> int:
        freed = self._collect_garbage()  # blobs left unlinked by another process's trim, say
        freed += self._evict(lambda used: used <= self.max_bytes)
        used = self.usage()
        if used > self.max_bytes and not self._warned_full:
            self._warned_full = True
            log.warning("cache %s holds %.1f MB, over its limit of %.1f MB, all of it in use by models "
                        "loaded in the last %.0f min", self.root, used / 1e6, self.max_bytes / 1e6,
                        self.lease_s / 60)
        elif used <= self.max_bytes:
            self._warned_full = False
        return freed

    def make_room(self, size: int) -> bool:
        """After a full disk refused a file of `size` bytes: evict what trim would, past any limit, until
        the disk has room for it. Whether it has now (else everything left is in use)."""
        def room(_: int) -> bool:
            return shutil.disk_usage(self.tmp).free > size
        try:
            self._clear_tmp()
            self._collect_garbage()
            self._evict(room)
            return room(0)
        except OSError as exc:
            log.warning("cache %s: making room failed: %s", self.root, exc)
            return False

    def _evict(self, enough: Callable[[int], bool]) -> int:
        """Evict the folders used least recently (and the blobs only they linked to) until `enough(bytes
        used)`; never one used within the lease. The bytes freed."""
        freed, used, now = 0, self.usage(), time.time()
        for mtime, folder in sorted(self._folders()):
            if enough(used) or now - mtime < self.lease_s:
                break  # past the first one in use, every later one is in use too
            if not self._remove(folder):
                continue
            self._collect_garbage()
            before, used = used, self.usage()
            freed_now = max(0, before - used)  # its own copies too, where files could not be linked
            freed += freed_now
            with self._lock:
                self.stats.evicted_folders += 1
            log.info("cache: evicted %s/%s (unused for %.0f min, %.1f MB freed); %s", folder.parent.name,
                     folder.name, (now - mtime) / 60, freed_now / 1e6, self._used_text(used))
        with self._lock:
            self.stats.evicted_bytes += freed
        return freed

    def _used_text(self, used: int) -> str:
        if self.max_bytes:
            return f"{used / 1e6:.1f} of {self.max_bytes / 1e6:.1f} MB used"
        # without a limit only a full disk evicts (make_room)
        return f"{used / 1e6:.1f} MB used, no limit set: evicted for room on a full disk"

    def _remove(self, folder: Path) -> bool:
        """Move a folder unused for the lease out of models/, then delete it; False where it was used
        again meanwhile (or is gone). Out of models/ first: nobody is handed a folder half removed, and a
        removal that fails half way leaves its rest in tmp/, where _clear_tmp finds it."""
        trash = self.tmp / f"evicted-{uuid.uuid4().hex}"
        with self._evicting(fcntl.LOCK_EX):
            try:
                if time.time() - folder.stat().st_mtime < self.lease_s:
                    return False
                os.rename(folder, trash)
            except OSError:
                return False
            try:
                folder.parent.rmdir()  # the model's last folder: its directory goes too
            except OSError:
                pass
        shutil.rmtree(trash, ignore_errors=True)
        return True

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
