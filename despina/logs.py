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
import time
from typing import Any

import orjson

from .contract.errors import Code, DespinaError, InvalidArgument


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class _Times(logging.Formatter):
    iso = False  # Triton's log_format ISO8601: UTC timestamps, 2026-12-03T12:00:00.123Z

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if not self.iso:
            return super().formatTime(record, datefmt)
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class JsonFormatter(_Times):
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


class TextFormatter(_Times):
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
    global _started_level, _current, _json
    _started_level = root.level
    _current = defaults(level)
    _json = json


# -- Triton's logging extension: settings every process follows ------------------------------------

EVENT = b"logging"  # on the events channel: the log settings changed
FORMATS = ("default", "ISO8601")
# Triton's server names the switches log_warning and log_error; its protocol document spells them so
ALIASES = {"log_warnings": "log_warning", "log_errors": "log_error"}
_started_level = logging.INFO  # the level the process started with (--log-level)


def defaults(level: str) -> dict[str, Any]:
    """The settings a process starts with, as Triton's logging extension names them."""
    n = logging.getLevelName(level.upper())
    n = n if isinstance(n, int) else logging.INFO
    return {"log_file": "", "log_info": n <= logging.INFO, "log_warning": n <= logging.WARNING,
            "log_error": n <= logging.ERROR, "log_verbose_level": 1 if n <= logging.DEBUG else 0,
            "log_format": "default"}


_current = defaults("info")  # current()'s
_json = False  # setup's: JSON lines (--log-format json)


def merged(current: dict[str, Any], update: Any) -> dict[str, Any]:
    """`current` with the settings a POST /v2/logging gives (a null leaves its setting as it is, as Triton
    skips it); InvalidArgument names a bad one."""
    if not isinstance(update, dict):
        raise InvalidArgument("the log settings must be a JSON object")
    out = dict(current)
    for name, value in update.items():
        name = ALIASES.get(name, name)
        if value is None and name in out:
            continue
        if name in ("log_info", "log_warning", "log_error"):
            if type(value) is not bool:
                raise InvalidArgument(f"log setting '{name}' must be a boolean")
        elif name == "log_verbose_level":
            if type(value) is not int or not 0 <= value < 1 << 32:
                raise InvalidArgument("log setting 'log_verbose_level' must be an unsigned integer")
        elif name == "log_format":
            if value not in FORMATS:
                raise InvalidArgument(f"log setting 'log_format' must be one of {', '.join(FORMATS)}")
        elif name == "log_file":
            if not isinstance(value, str):
                raise InvalidArgument("log setting 'log_file' must be a string")
            if value:  # Triton's words and status (UNSUPPORTED: 501), then why
                raise DespinaError("log file location can not be updated through network protocol: every "
                                   "Despina process logs to standard error (a container's log); a log file "
                                   "is not supported", Code.UNIMPLEMENTED)
        else:
            raise InvalidArgument(f"unknown log setting '{name}' (known: {', '.join(defaults('info'))})")
        out[name] = value
    return out


class _Levels(logging.Filter):
    """Which levels pass: Triton's switches are one each, not a threshold."""

    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__()
        self.passes = {logging.DEBUG: settings["log_verbose_level"] > 0, logging.INFO: settings["log_info"],
                       logging.WARNING: settings["log_warning"], logging.ERROR: settings["log_error"],
                       logging.CRITICAL: settings["log_error"]}

    def filter(self, record: logging.LogRecord) -> bool:
        return self.passes.get(record.levelno, True)


def current() -> dict[str, Any]:
    """The settings this process follows: its start's (setup), then the last applied. A new dict each time
    they change, so that a caller may tell a change by identity (a Python model's process is told them:
    workers/backends/python_process.py)."""
    return _current


def json_lines() -> bool:
    """Whether this process writes JSON lines (--log-format json): a Python model's process does the same."""
    return _json


def apply(settings: dict[str, Any]) -> None:
    """Follow the settings in this process: verbose level 1 opens Despina's own debug lines, 2 and more
    every library's too; ISO8601 timestamps the lines in UTC."""
    global _current
    _current = {**_current, **settings}
    root = logging.getLogger()
    verbose = int(settings.get("log_verbose_level", 0))
    root.setLevel(logging.DEBUG if verbose >= 2 else min(_started_level, logging.INFO))
    logging.getLogger("despina").setLevel(logging.DEBUG if verbose >= 1 else logging.NOTSET)
    iso = settings.get("log_format") == "ISO8601"
    for handler in root.handlers:
        handler.filters[:] = [_Levels({**defaults("info"), **settings})]
        formatter = handler.formatter
        if isinstance(formatter, (TextFormatter, JsonFormatter)):
            formatter.iso = iso


async def follow(redis: Any, keys: Any) -> None:
    """Read the cluster's log settings and follow them (when a POST /v2/logging set some)."""
    raw = await redis.get(keys.log_settings)
    if raw:
        try:
            apply(orjson.loads(raw))
        except (ValueError, TypeError, KeyError) as exc:
            logging.getLogger("despina").warning("ignoring unreadable log settings (%s)", exc)


LOG_EVERY_S = 5.0  # while Redis is down, a failure of the same kind is logged at most this often


class Throttled:
    """Logs a recurring failure once, then at most every LOG_EVERY_S with how many went unlogged: a loop
    that retries twice a second while Redis is down logs a line every few seconds, not one a retry."""

    def __init__(self, log: logging.Logger, level: int = logging.WARNING) -> None:
        self._log = log
        self.level = level
        self.last = -LOG_EVERY_S
        self.unlogged = 0
        self.since: float | None = None  # when the failure began (monotonic); None: not failing

    def log(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.last < LOG_EVERY_S:
            self.unlogged += 1
            return
        if self.unlogged:
            message += f" ({self.unlogged} more like it since the last report)"
        self._log.log(self.level, message, *args)
        self.last, self.unlogged = now, 0

    def recovered(self, message: str, *args: object) -> None:
        """The failure is over: say so once, with how long it lasted (the other half of the pair an
        operator looks for), at the failure's level though no higher than WARNING. The next failure is
        logged at once. (Callers look at `since` first: nothing to do while nothing failed.)"""
        if self.since is None:
            return
        lasted, self.since = time.monotonic() - self.since, None
        self._log.log(min(self.level, logging.WARNING), message + " (after %.1f s)", *args, lasted)
        self.last, self.unlogged = -LOG_EVERY_S, 0


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
