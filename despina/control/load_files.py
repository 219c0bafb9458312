"""The load API's `config` and `file:<path>` parameters: the config override read, and the files given
checked and kept in Redis, where every worker finds them (registry/given.py). As Triton's load with files
(which loads from a temporary folder), the model is those files alone and the repository is never written;
a load's files are removed once nothing loads from them: once a later load is in the catalog (a load that
waits, once it ends: a failed one may give the model back its old files), after an unload, and after their
own load fails."""
from __future__ import annotations

import base64
import binascii
import logging
from typing import TYPE_CHECKING, Any, cast

import orjson

from ..contract.errors import InvalidArgument
from ..registry.base import VERSION_DIGITS, check_relative, is_version
from ..registry.given import GivenFiles, given_digest

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ..contract.keys import Keys
    from ..registry.cache import ArtifactCache

log = logging.getLogger("despina.control")
NAME_MAX = 255  # bytes of one name in a path, on the file systems a cache is on (ext4, xfs, overlayfs)


def config_override(name: str, raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        config = orjson.loads(raw) if isinstance(raw, str | bytes) else raw
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"load parameter 'config' of model '{name}' is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"load parameter 'config' of model '{name}' must be a JSON object")
    return config


def given_files(name: str, files: dict[str, Any], cache: ArtifactCache) -> GivenFiles:
    """The load API's `file:` entries, decoded and checked: the model they alone make up."""
    decoded = {}
    for path, data in files.items():
        top = path.split("/", 1)[0]  # a number that names no version (01, 00): the file would go unread
        if "/" in path and top.isascii() and top.isdigit() and not is_version(top):
            raise InvalidArgument(f"load parameter 'file:{path}': '{top}' is not a version folder (a "
                                  f"number from 0, without a leading zero, of at most {VERSION_DIGITS} "
                                  "digits): no version would be read from it")
        try:
            decoded[check_relative(path)] = base64.b64decode(data, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise InvalidArgument(f"load parameter 'file:{path}' is not base64") from None
    _check_tree(name, decoded)
    return GivenFiles(name, decoded, cache)


def _check_tree(name: str, paths: dict[str, bytes]) -> None:
    """No path is both a file and a folder ('1' and '1/model.onnx'): no folder could hold them; no name
    is longer than a file system takes."""
    for path in paths:
        if any(len(part.encode()) > NAME_MAX for part in path.split("/")):
            raise InvalidArgument(f"load parameter 'file:{path}' of model '{name}': File name too long (a "
                                  f"name in a path has {NAME_MAX} bytes at most)")
        folder = path.rpartition("/")[0]
        while folder:
            if folder in paths:
                raise InvalidArgument(f"load parameters 'file:{folder}' and 'file:{path}' of model '{name}': "
                                      f"'{folder}' cannot be both a file and a folder")
            folder = folder.rpartition("/")[0]


async def keep(redis: Redis, keys: Keys, given: GivenFiles) -> None:
    """The given files into Redis (one write: all of them, or none)."""
    await redis.hset(keys.given_files(given.name), mapping=given.fields())  # type: ignore[arg-type]
    log.info("model %s: the %d file(s) its load gave kept as %s", given.name, len(given.data), given.url)


async def forget(redis: Redis, keys: Keys, name: str, path: str | None = None) -> None:
    """Remove the model's given files but those its entry's `path` names (all where it names none)."""
    key = keys.given_files(name)
    keeping = given_digest(path or "")
    if keeping is None:
        await redis.delete(key)
        return
    mine = f"{keeping}/".encode()
    stale = [f for f in await redis.hkeys(key) if not cast(bytes, f).startswith(mine)]
    if stale:
        await redis.hdel(key, *stale)
