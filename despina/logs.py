"""Logging set-up shared by every role: plain lines, or JSON lines with --log-format json.

Structured fields travel in `extra={"fields": {...}}`: JSON lines carry them as keys, plain lines
append them as key=value. A request's id (the client's X-Request-Id, else one the gateway makes)
is the field `request_id` in the gateway and `request_ids` in a worker's batch line.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import orjson


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname,
                               "role": self.role, "pid": record.process, "logger": record.name,
                               "message": record.getMessage(), **_fields(record)}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__(f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        return line + "".join(f" {k}={v}" for k, v in fields.items()) if fields else line


def setup(level: str = "info", role: str = "despina", json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if json else TextFormatter(role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
