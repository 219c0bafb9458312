"""The load API's `config` and `file:<path>` parameters: the config override read, and the files written
into the registry's model folder (and put back as they were after a load that failed), as Triton's load
with files does."""
from __future__ import annotations

import base64
import binascii
import logging
from typing import TYPE_CHECKING, Any

import orjson
from google.protobuf import text_format

from ..contract.errors import DespinaError, InvalidArgument
from ..contract.modelconfig import normalize, parse_json
from ..registry.base import VERSION_DIGITS, check_relative, is_served_version

if TYPE_CHECKING:
    from ..registry.base import Registry

log = logging.getLogger("despina.control")


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


def write_files(registry: Registry, name: str, files: dict[str, Any], config: dict[str, Any]
                ) -> dict[str, bytes | None]:
    """The load API's `file:` entries and config, written into the registry's model folder; returns
    what each file written held before (None: there was none), for restore_files."""
    message = parse_json(name, config)
    if message.platform or message.backend:  # else read_model finds it from the files, once written
        normalize(name, message)
    decoded = {}
    for path, data in files.items():
        top = path.split("/", 1)[0]  # a number that names no version (01, 0): the file would go unread
        if "/" in path and top.isascii() and top.isdigit() and not is_served_version(top):
            raise InvalidArgument(f"load parameter 'file:{path}': '{top}' is not a version folder (a "
                                  f"number from 1, without a leading zero, of at most {VERSION_DIGITS} "
                                  "digits): no version would be read from it")
        try:
            decoded[check_relative(path)] = base64.b64decode(data, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise InvalidArgument(f"load parameter 'file:{path}' is not base64") from None
    decoded["config.pbtxt"] = text_format.MessageToString(message).encode()
    before = {path: registry.get(name, path) for path in decoded}
    written: list[str] = []
    try:
        for path, data in sorted(decoded.items()):
            registry.put(name, path, data)  # each put replaces its file whole, or leaves it
            written.append(path)
    except (DespinaError, OSError):
        restore_files(registry, name, {path: before[path] for path in written})
        raise
    log.info("model %s: %d file(s) and its config written to %s", name, len(decoded) - 1,
             registry.model_url(name))
    return before

def restore_files(registry: Registry, name: str, before: dict[str, bytes | None]) -> None:
    """Put back what write_files replaced, and remove what it added (best effort: a failure is logged)."""
    try:
        for path, data in before.items():
            if data is None:
                registry.delete(name, path)
            else:
                registry.put(name, path, data)
    except (DespinaError, OSError) as exc:
        log.error("model %s: putting back the files a failed load replaced failed: %s", name, exc)
        return
    log.info("model %s: the failed load's files were taken back out of %s", name,
             registry.model_url(name))
