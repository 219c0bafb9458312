"""The catalog: what the control plane says each model is, and which versions should serve."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    path: str                         # the model's folder (a local path, or the cache for S3)
    config: dict[str, Any]            # Triton's JSON form, auto-completed
    versions: tuple[int, ...]         # versions the policy selects, ascending
    state: str = "READY"              # READY, or UNAVAILABLE when the config cannot be used
    reason: str = ""
    available: tuple[int, ...] = field(default=())  # every version folder present

    def dumps(self) -> bytes:
        return orjson.dumps({"name": self.name, "path": self.path, "config": self.config,
                             "versions": list(self.versions), "state": self.state,
                             "reason": self.reason, "available": list(self.available)})

    @classmethod
    def loads(cls, raw: bytes | str) -> CatalogEntry:
        d = orjson.loads(raw)
        return cls(d["name"], d["path"], d["config"], tuple(d["versions"]), d.get("state", "READY"),
                   d.get("reason", ""), tuple(d.get("available", ())))
