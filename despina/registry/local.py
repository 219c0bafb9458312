"""A model repository on local disk: the folder itself is what backends load."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..contract.errors import ConfigError, InvalidArgument
from .base import FileInfo, ModelFiles, Progress, Registry, check_relative

log = logging.getLogger("despina.registry")
_told: set[str] = set()  # what the listing left out, said once each

class LocalRegistry(Registry):
    remote = False

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.url = str(self.root.resolve())

    def _check(self) -> None:
        if not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} is not a folder")

    def names(self) -> list[str]:
        self._check()
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and _utf8(p))

    def scan(self) -> dict[str, ModelFiles]:
        return {name: self._files(name) for name in self.names()}

    def scan_one(self, name: str) -> ModelFiles | None:
        self._check()
        return self._files(name) if (self.root / name).is_dir() else None

    def _files(self, name: str) -> ModelFiles:
        folder = self.root / name
        files = []
        # through links, as Triton's poll stats through them: a version folder linked to a build's output
        # changes when the files behind it do
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                           and _utf8(Path(dirpath) / d) and not _loops(Path(dirpath) / d, folder)]
            for filename in filenames:
                path = Path(dirpath) / filename
                if filename.startswith(".") or not _utf8(path):
                    continue
                try:
                    st = path.stat()
                except OSError:  # removed while we looked
                    continue
                rel = path.relative_to(folder).as_posix()
                if not stat.S_ISREG(st.st_mode):  # a FIFO would hang whoever reads it: the poll, a worker
                    _leave_out(f"{self.root}/{name}/{rel}", "it is not a regular file")
                    continue
                files.append(FileInfo(rel, st.st_size, local_etag(st)))
        tops = tuple(sorted(p.name for p in folder.iterdir() if p.is_dir() and _utf8(p)))
        return ModelFiles(name, str(folder.resolve()), tuple(sorted(files)), tops)

    def folder(self, model: ModelFiles, versions: Iterable[int], also: Iterable[str] = ()) -> Path:
        return Path(model.url)

    def put(self, name: str, path: str, data: bytes) -> None:
        target = self.root / name / check_relative(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".despina-")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                os.replace(tmp, target)  # a reader sees the old file or the new one, never half of one
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            _prune(self.root / name, target)  # the folders made for it: an empty "2/" would be a version
            raise unfit(name, path, exc) from None

    def delete(self, name: str, path: str) -> None:
        folder = self.root / name
        target = folder / check_relative(path)
        target.unlink(missing_ok=True)
        _prune(folder, target)

    def make_folder(self, name: str, path: str) -> None:
        try:
            (self.root / name / check_relative(path)).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise unfit(name, path, exc) from None

    def upload(self, name: str, path: str, source: Path, progress: Progress | None = None) -> FileInfo:
        target = self.root / name / check_relative(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".despina-")
        os.close(fd)
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        if progress:
            progress(source.stat().st_size)
        st = target.stat()
        return FileInfo(path, st.st_size, local_etag(st))


def _utf8(path: Path) -> bool:
    """Whether the name is text (UTF-8): another one could not be a model's, a file's or a folder's name in
    the catalog, the cache or Redis (the whole model stayed unread, its poll failing every round)."""
    try:
        path.name.encode()
    except UnicodeEncodeError:
        _leave_out(os.fsencode(path).decode("utf-8", "backslashreplace"), "its name is not UTF-8")
        return False
    return True


def _leave_out(what: str, why: str) -> None:
    if what not in _told:
        _told.add(what)
        log.warning("model repository: %s is left out: %s", what, why)


def _loops(path: Path, top: Path) -> bool:
    """Whether the folder `path` (inside `top`) is a link to a folder that holds the model's folder (a link
    up to the repository, or to /) or to one of the folders the walk went through to reach it (links to
    each other): walked, it would never end, or list files of other models. Only a link can loop: a plain
    folder costs one lstat here, not a path resolved (a poll walks every model's folders)."""
    if not path.is_symlink():
        return False
    real = path.resolve()
    return top.resolve().is_relative_to(real) or any(
        p.resolve() == real for p in (path.parent, *path.parent.parents) if p.is_relative_to(top))


def local_etag(st: os.stat_result) -> str:
    """What says a file changed: its size and mtime, and its change time, which no copy can set (`cp -p`,
    `rsync -a` and unpacked archives keep a file's mtime, and new weights of one architecture have one
    size). A chmod changes it too: a reload of what did not change, not a stale model."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ctime_ns:x}"


def _prune(folder: Path, target: Path) -> None:
    """Remove the folders `target` was the last thing in, up to the model's own `folder`."""
    for parent in target.parents:
        if not parent.is_relative_to(folder):
            break
        if parent.is_dir():
            if any(parent.iterdir()):
                break
            parent.rmdir()


def unfit(name: str, path: str, exc: OSError) -> Exception:
    """A path that cannot be a file of the model's folder (a folder is there, a file stands where a folder
    must, a name too long) is the caller's mistake, said as such; any other failure (a full disk) is not."""
    if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG):
        return InvalidArgument(f"'{path}' cannot be a file of model '{name}': {exc.strerror}")
    return exc
