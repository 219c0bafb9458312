"""The model registry: a Triton model repository on local disk or in an object store.

A registry lists models as file manifests (path, size, ETag) and turns a manifest into a local
folder that a backend can load. The local registry is that folder; a remote one fetches the files
into a cache keyed by content.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..contract.errors import NotFound

Progress = Callable[[int], None]   # called with the bytes moved since the last call


@dataclass(frozen=True, order=True)
class FileInfo:
    path: str          # relative to the model folder, '/'-separated
    size: int
    etag: str          # the object store's ETag; a local file's mtime, size and ctime (local_etag)

    def pack(self) -> tuple[str, int, str]:
        return (self.path, self.size, self.etag)


# The most digits of a version: what a URL may name (gateway/auth.py). Past int64 Triton's stoll refuses a
# folder, and Despina's catalog (JSON, msgpack) cannot hold the number.
VERSION_DIGITS = 18


def is_version(folder: str) -> bool:
    """A version folder's name: ASCII digits (str.isdigit() also takes '²', which int() refuses), with no
    leading zero: Triton ignores '01', which would else be a second version 1; and at most VERSION_DIGITS."""
    return (folder.isascii() and folder.isdigit() and len(folder) <= VERSION_DIGITS
            and (folder == "0" or not folder.startswith("0")))


@dataclass(frozen=True)
class ModelFiles:
    """Every file of one model folder in a registry."""

    name: str
    url: str                         # the model folder: a local path or s3://bucket/prefix/name
    files: tuple[FileInfo, ...]
    folders: tuple[str, ...] = ()    # top-level folders, empty ones too (where the store has folders)

    @property
    def versions(self) -> list[int]:
        tops = {f.path.split("/", 1)[0] for f in self.files if "/" in f.path} | set(self.folders)
        return sorted(int(t) for t in tops if is_version(t))

    def of_versions(self, versions: Iterable[int], also: Iterable[str] = ()) -> tuple[FileInfo, ...]:
        """The files a folder holding `versions` needs: theirs, those outside every version folder, and
        those named in `also` (of other versions: what the config's checksum agent lists)."""
        wanted, named = {str(v) for v in versions}, set(also)
        out = []
        for f in self.files:
            top = f.path.split("/", 1)[0] if "/" in f.path else ""
            if top in wanted or not is_version(top) or f.path in named:
                out.append(f)
        return tuple(out)

    def size(self, versions: Iterable[int]) -> int:
        return sum(f.size for f in self.of_versions(versions))

    def revision(self, version: int, config: bytes, also: Iterable[str] = ()) -> str:
        """A digest of what one version loads from: its files, the shared files, those named in `also`
        and the config (config.pbtxt as the config it holds: what else it holds changes nothing)."""
        files = [f.pack() for f in self.of_versions([version], also) if f.path != "config.pbtxt"]
        return digest(files, config)

    def fingerprint(self) -> str:
        """What says the folder changed: its files, and its versions (an ensemble's folders hold no file:
        one made or removed changes nothing else, and Triton's poll loads or unloads that version)."""
        return digest([f.pack() for f in self.files], ",".join(map(str, self.versions)).encode())

    def unchanged_since(self, fingerprint: str) -> bool:
        """Whether `fingerprint` (kept in the catalog) is this folder's: its own, or the files-only one an
        earlier Despina kept (its load API override then survives an upgrade, as for unchanged files)."""
        return fingerprint in (self.fingerprint(), digest([f.pack() for f in self.files]))


def digest(items: Iterable[tuple[str, int, str]], extra: bytes = b"") -> str:
    h = hashlib.sha256(extra)
    for path, size, etag in sorted(items):
        h.update(f"\0{path}\0{size}\0{etag}".encode())
    return h.hexdigest()[:24]


class Registry:
    """A Triton model repository. Implementations: LocalRegistry, S3Registry."""

    url: str
    remote: bool = False

    def names(self) -> list[str]:
        """The model folders, without reading their files."""
        raise NotImplementedError

    def scan(self) -> dict[str, ModelFiles]:
        """Every model folder with its files."""
        raise NotImplementedError

    def model(self, name: str) -> ModelFiles:
        found = self.scan_one(name)
        if found is None or not found.files:
            raise NotFound(f"no model '{name}' in the repository {self.url}")
        return found

    def scan_one(self, name: str) -> ModelFiles | None:
        raise NotImplementedError

    def folder(self, model: ModelFiles, versions: Iterable[int], also: Iterable[str] = ()) -> Path:
        """A local folder holding the model's files for `versions` (and its shared files, and the files
        named in `also`)."""
        raise NotImplementedError

    def put(self, name: str, path: str, data: bytes) -> None:
        """Write one file of a model (`despina push`: a renamed model's config)."""
        raise NotImplementedError

    def delete(self, name: str, path: str) -> None:
        """Remove one file of a model (nothing where there is none)."""
        raise NotImplementedError

    def make_folder(self, name: str, path: str) -> None:
        """Make an empty folder of a model (an ensemble's version folder); in S3 a folder marker."""
        raise NotImplementedError

    def upload(self, name: str, path: str, source: Path, progress: Progress | None = None) -> FileInfo:
        """Copy one local file into the model folder (`despina push`); returns what landed."""
        raise NotImplementedError

    def model_url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"


def check_relative(path: str) -> str:
    """A path inside a model folder: nothing absolute, nothing that climbs out, no NUL (no file system
    takes one)."""
    parts = path.replace("\\", "/").split("/")
    if not path or path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts):
        from ..contract.errors import InvalidArgument

        raise InvalidArgument(f"invalid file path '{path}' in a model folder")
    return "/".join(parts)
