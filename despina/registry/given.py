"""The files a load API call gives (its `file:<path>` entries), as a registry of their own.

Triton loads such a model from a temporary folder and never writes into the repository; Despina keeps the
files in Redis, which every control plane and worker reaches, for as long as the model is loaded from them:
one hash per model (Keys.given_files), a field `<digest>/<path>` per file, where the digest names one
load's set of files. A catalog entry loaded from them has the path `GIVEN + digest`; a worker (on any
host, restarted or not) reads the files from Redis into its artifact cache, keyed by content as a remote
registry's are, and loads from there. The control plane removes a load's files once nothing loads from them
(control/load_files.py).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

from redis.exceptions import RedisError

from ..contract.errors import Unavailable
from .base import FileInfo, ModelFiles, Registry, digest

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ..contract.keys import Keys
    from .cache import ArtifactCache

GIVEN = "load-files:"  # a catalog entry's path where a load's given files are the model


def given_digest(path: str) -> str | None:
    """The digest of the given files an entry's path names, or None for a registry's model folder."""
    return path[len(GIVEN):] if path.startswith(GIVEN) else None


def etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class GivenFiles(Registry):
    """One load's files, in memory, turned into local folders through the artifact cache."""

    remote = True

    def __init__(self, name: str, files: Mapping[str, bytes], cache: ArtifactCache) -> None:
        self.name, self.data, self.cache = name, dict(files), cache
        infos = tuple(sorted(FileInfo(p, len(d), etag(d)) for p, d in self.data.items()))
        self.digest = digest(f.pack() for f in infos)
        self.url = GIVEN + self.digest
        tops = tuple(sorted({p.split("/", 1)[0] for p in self.data if "/" in p}))
        self.files = ModelFiles(name, self.url, infos, tops)

    def model_url(self, name: str) -> str:
        return self.url

    def folder(self, model: ModelFiles, versions: Iterable[int], also: Iterable[str] = ()) -> Path:
        def write(f: FileInfo, dest: Path) -> None:
            dest.write_bytes(self.data[f.path])

        return self.cache.folder(model.name, model.of_versions(versions, also), write)

    def fields(self) -> dict[str, bytes]:
        """The Redis hash fields that hold these files."""
        return {f"{self.digest}/{path}": data for path, data in self.data.items()}


async def read_given(redis: Redis, keys: Keys, name: str, path: str, files: Iterable[str],
                     cache: ArtifactCache) -> GivenFiles:
    """The given files an entry's `path` names, read back from Redis: Unavailable where they are gone (the
    model was unloaded meanwhile, or Redis lost its data)."""
    digest_ = given_digest(path)
    paths = sorted(files)
    try:
        found = await redis.hmget(keys.given_files(name), [f"{digest_}/{p}" for p in paths]) if paths else []
    except (RedisError, OSError) as exc:
        raise Unavailable(f"model '{name}': the files its load gave cannot be read from Redis: {exc}"
                          ) from None
    missing = [p for p, d in zip(paths, found) if d is None]
    if missing:
        raise Unavailable(f"model '{name}': the files its load gave ({', '.join(missing)}) are no longer in "
                          "Redis; load the model again")
    return GivenFiles(name, {p: cast(bytes, d) for p, d in zip(paths, found)}, cache)
