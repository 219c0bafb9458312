"""Logging set-up shared by every role: plain lines, or JSON lines with --log-format json.

Structured fields travel in `extra={"fields": {...}}`: JSON lines carry them as keys, plain lines
append them as key=value. A request's id (the client's X-Request-Id, else one the gateway makes)
is the field `request_id` in the gateway and `request_ids` in a worker's batch line.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
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


def dump_tasks() -> None:
    """Every asyncio task's chain of awaits to stderr (`kill -USR2`): where each one waits. A thread
    dump (SIGUSR1) shows only the event loop; this shows what the loop is waiting for."""
    tasks = asyncio.all_tasks()
    lines = [f"-- {len(tasks)} asyncio tasks in pid {os.getpid()} --"]
    for task in tasks:
        lines.append(f"{task.get_name()}:")
        awaiting: Any = task.get_coro()
        while awaiting is not None:
            frame = getattr(awaiting, "cr_frame", None) or getattr(awaiting, "gi_frame", None)
            if frame is None:
                lines.append(f"  awaiting {awaiting!r}"[:200])
                break
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
            awaiting = getattr(awaiting, "cr_await", None) or getattr(awaiting, "gi_yieldfrom", None)
    print("\n".join(lines), file=sys.stderr, flush=True)


def dump_tasks_on_sigusr2() -> None:
    """In the running event loop: `kill -USR2 <pid>` calls dump_tasks."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, dump_tasks)
    except (RuntimeError, ValueError):  # not the main thread (an app under a test client): no dump
        pass
