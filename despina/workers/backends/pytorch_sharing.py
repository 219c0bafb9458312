"""Triton's ENABLE_WEIGHT_SHARING: the instances of a model on one device share one loaded module, so its
weights are in memory once (Triton's ModelState::LoadModel keeps one per device and hands it to every
instance there). Instances run on threads of one worker process, as Triton's do, and call the module at
once: TorchScript and torch.export modules are not changed by a call.

A module is kept while an instance holds it; the key names the file's size and modification time too,
so a model reloaded from a changed file reads it again rather than take the old weights.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

Loaded = TypeVar("Loaded")
Key = tuple[str, str, int, int, str]

_LOCK = threading.Lock()
_SHARED: dict[Key, list[Any]] = {}  # key -> [what was loaded, how many instances hold it]


def sharing_key(model: str, path: Path, device: str) -> Key:
    stat = path.stat()
    return (model, str(path.resolve()), stat.st_size, stat.st_mtime_ns, device)


def take(key: Key, load: Callable[[], Loaded]) -> Loaded:
    """What `load()` gives, once per key while some instance holds it."""
    with _LOCK:  # a second instance waits for the first one's load rather than load its own copy
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = [load(), 0]
        entry[1] += 1
        return entry[0]  # type: ignore[no-any-return]


def give_back(key: Key) -> None:
    with _LOCK:
        entry = _SHARED.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _SHARED[key]
