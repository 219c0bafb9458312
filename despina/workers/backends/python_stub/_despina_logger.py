"""pb_utils' Logger: a model's log lines, in the worker's look and following the server's log settings.

Part of `triton_python_backend_utils`, which re-exports Logger; a model imports it from there. The
model's name and the log settings live in that module, where the stub sets them.
"""
from __future__ import annotations

import enum
import json
import os
import sys
import time

import triton_python_backend_utils as pb_utils


class Logger:
    """Log lines from a model; they land in the worker's log with the model's name. As in Triton, each
    level follows the server's log settings (`/v2/logging`): log_info, log_warning and log_error switch
    theirs, and VERBOSE lines show only at a log_verbose_level of 1 or more."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        if type(level) is bool or not isinstance(level, int) or level not in _LOG_SWITCHES:
            raise TypeError(f"Logger.log: level must be a pb_utils.Logger.LogLevel (INFO, WARNING, ERROR or "
                            f"VERBOSE), not {level!r}")
        if not _shows(level):
            return
        print(_log_line(Logger.LogLevel(level).name, str(message)), file=sys.stderr, flush=True)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.VERBOSE)


# which of the server's log settings lets each level's lines through (a count for VERBOSE, else a switch)
_LOG_SWITCHES: dict[int, str] = {Logger.INFO: "log_info", Logger.WARNING: "log_warning",
                                 Logger.ERROR: "log_error", Logger.VERBOSE: "log_verbose_level"}


def _log_line(label: str, message: str) -> str:
    """A line as the worker's own look (despina/logs.py): the time (ISO8601 in UTC, or local with
    milliseconds), the process, the level, the model, the message; a JSON object where the worker writes
    JSON lines (--log-format json), so that a log shipper reads the model's lines as the server's."""
    now = time.time()
    if pb_utils._log_settings.get("log_format") == "ISO8601":
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
    model = pb_utils._model_name
    if pb_utils._log_settings.get("json"):
        return json.dumps({"time": stamp, "level": label, "role": "model", "pid": os.getpid(),
                           "logger": f"model.{model}", "model": model, "message": message})
    return f"{stamp} model[{os.getpid()}] {label} model '{model}': {message}"


def _shows(level: int) -> bool:
    switch = _LOG_SWITCHES[level]
    if level == Logger.VERBOSE:
        return int(pb_utils._log_settings.get(switch, 0)) >= 1
    return bool(pb_utils._log_settings.get(switch, True))
