"""Settings: one frozen object, built once at start-up from arguments and DESPINA_* variables."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class Settings:
    redis_url: str | None = None            # None: start an embedded Valkey
    key_prefix: str = "despina"
    model_repository: str = "./model_repository"
    host: str = "127.0.0.1"
    http_port: int = 8000
    workers: int = 1
    request_timeout_s: float = 60.0         # default deadline of a request
    max_body_bytes: int = 64 * 1024 * 1024
    model_control_mode: str = "none"
    intra_op_threads: int = 1               # per backend instance; 1 is fastest on a loaded machine
    worker_id: str | None = None
    log_level: str = "info"
    log_format: str = "text"                # or "json"
    drain_timeout_s: float = 30.0

    @classmethod
    def from_sources(cls, args: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> Settings:
        """Arguments win over DESPINA_* variables, which win over defaults. REDIS_URL is honoured too."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = environ.get(f"DESPINA_{f.name.upper()}")
            if f.name == "redis_url" and env is None:
                env = environ.get("REDIS_URL")
            if env is not None and env != "":
                values[f.name] = _coerce(f.type, env)
        for key, value in (args or {}).items():
            if value is not None and key in cls.__dataclass_fields__:
                values[key] = value
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)


def _coerce(annotation: Any, raw: str) -> Any:
    kind = str(annotation)
    if "int" in kind and "str" not in kind:
        return int(raw)
    if "float" in kind:
        return float(raw)
    return raw
