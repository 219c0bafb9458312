"""Triton's trace settings (the trace extension's, trace.py): their defaults, each checked as a POST gives it,
merged into those kept, and those that apply to a model."""
from __future__ import annotations

from typing import Any

from ..contract.errors import Code, DespinaError, InvalidArgument

# in the order Triton's answers list them
DEFAULTS: dict[str, Any] = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                            "log_frequency": "0", "trace_file": "", "trace_mode": "triton"}
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
INT_MAX = 2**31 - 1
# Triton's words (its L0_trace tests look for them) and status (501), then where the file is set
FILE_FIXED = ("trace file location can not be updated through network protocol: it is set when the server "
              "starts, with --trace-file (DESPINA_TRACE_FILE)")


def _number(name: str, value: Any, least: int) -> str:
    raw = value[0] if type(value) is list and len(value) == 1 else value
    if type(raw) is int and not isinstance(raw, bool):
        raw = str(raw)
    # Triton reads them with stoi: at most INT_MAX, and no int() of thousands of digits
    if type(raw) is not str or not raw.removeprefix("-").isdecimal() or len(raw) > 11 \
            or not least <= int(raw) <= INT_MAX:
        raise InvalidArgument(f"trace setting '{name}' must be an integer of at least {least} and at most "
                              f"{INT_MAX} (as a string)")
    return str(int(raw))


def checked(name: str, value: Any) -> Any:
    """A setting's value as kept (strings, trace_level a list); InvalidArgument names a bad one."""
    if name == "trace_level":
        levels = [value] if type(value) is str else value
        if type(levels) is not list or not levels or any(type(v) is not str for v in levels):
            raise InvalidArgument("trace setting 'trace_level' must be a list of levels (OFF, TIMESTAMPS, "
                                  "TENSORS)")
        bad = [v for v in levels if v not in LEVELS]
        if bad:
            raise InvalidArgument(f"unknown trace level {bad[0]!r} (known: OFF, TIMESTAMPS, TENSORS)")
        if "OFF" in levels and len(levels) > 1:  # Triton's words: OFF beside TIMESTAMPS was taken as on
            raise InvalidArgument("Expect only one trace level 'OFF' is specified")
        return levels
    if name == "trace_rate":
        return _number(name, value, 1)
    if name == "trace_count":
        return _number(name, value, -1)
    if name == "log_frequency":
        return _number(name, value, 0)
    if name == "trace_file":
        raise DespinaError(FILE_FIXED, Code.UNIMPLEMENTED)  # Triton's UNSUPPORTED: a 501
    if name == "trace_mode":
        if value not in ("triton", ["triton"]):
            raise InvalidArgument("trace setting 'trace_mode': only \"triton\" is supported (not "
                                  "opentelemetry)")
        return "triton"
    raise InvalidArgument(f"unknown trace setting '{name}' (known: {', '.join(DEFAULTS)})")


def merged(current: dict[str, Any], update: Any) -> dict[str, Any]:
    """`current` with the settings a POST gives; a null clears one (a model's: the global one applies again;
    a global one: its default does, as Triton's clears it; trace_file: nothing, it is the server's). No
    levels (trace_level []) change nothing, as Triton 2.51's."""
    if not isinstance(update, dict):
        raise InvalidArgument("the trace settings must be a JSON object")
    out = dict(current)
    for name, value in update.items():
        if value is None and name in DEFAULTS:
            out.pop(name, None)
        elif name == "trace_level" and value == []:
            continue
        else:
            out[name] = checked(name, value)
    return out


def effective(doc: dict[str, Any], model: str | None, trace_file: str) -> dict[str, Any]:
    """The settings that apply: the global ones, under a model's own, and the server's trace file (whatever
    the settings kept in Redis say: one a Despina before --trace-file took through the API is not used)."""
    settings = {**DEFAULTS, **doc.get("global", {})}
    if model is not None:
        settings.update(doc.get("models", {}).get(model, {}))
    settings["trace_file"] = trace_file
    return settings


def problem(settings: dict[str, Any]) -> str:
    """Why these settings cannot trace ('' when they can, or trace nothing)."""
    if settings["trace_level"] != ["OFF"] and not settings["trace_file"]:
        return "tracing needs a trace file, which this server was started without: start it with " \
               "--trace-file PATH (or DESPINA_TRACE_FILE)"
    return ""
