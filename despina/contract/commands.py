"""Commands to the control plane and its answers: the repository API and cold starts.

A gateway appends a Command to the control plane's command stream (`Keys.control_commands`) and waits
for its Answer on the list the command names (`reply`: one list per gateway, `Keys.control_answers`),
where the control plane pushes it with the command's id. A command without `reply` (from a gateway of an
earlier version) is answered on a list of its own, `Keys.control_reply(id)`. Gateways stay stateless:
every change of the catalog is the control plane's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from .errors import Code, DespinaError, InvalidArgument

INDEX, LOAD, UNLOAD, WAKE = "index", "load", "unload", "wake"
OPS = (INDEX, LOAD, UNLOAD, WAKE)


@dataclass(frozen=True)
class Command:
    id: str
    op: str                                  # one of OPS
    model: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    deadline: float = 0.0                    # wall-clock seconds; past it nobody waits for the answer
    reply: str = ""                          # the list the answer goes to; "": control_reply(id)

    def dumps(self) -> bytes:
        return orjson.dumps({"id": self.id, "op": self.op, "model": self.model, "params": self.params,
                             "deadline": self.deadline, "reply": self.reply})

    @classmethod
    def loads(cls, raw: bytes) -> Command:
        try:
            d = orjson.loads(raw)
            command = cls(str(d["id"]), str(d["op"]), str(d.get("model", "")), dict(d.get("params") or {}),
                          float(d.get("deadline", 0.0)), str(d.get("reply") or ""))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed control command: {exc}") from None
        if command.op not in OPS:
            raise InvalidArgument(f"unknown control command '{command.op}'")
        return command


@dataclass(frozen=True)
class Answer:
    data: Any = None
    code: str = ""                           # an error's Code; empty on success
    message: str = ""
    id: str = ""                             # the command's, on a list shared by several commands
    retry_after: float = 0.0                 # an error's DespinaError.retry_after

    @classmethod
    def error(cls, exc: DespinaError) -> Answer:
        return cls(None, exc.code.value, exc.message, retry_after=exc.retry_after)

    def result(self) -> Any:
        """The data, or the error raised again on the caller's side."""
        if self.code:
            raise DespinaError(self.message, Code(self.code), self.retry_after)
        return self.data

    def dumps(self) -> bytes:
        return orjson.dumps({"data": self.data, "code": self.code, "message": self.message, "id": self.id,
                             **({"retry_after": self.retry_after} if self.retry_after else {})})

    @classmethod
    def loads(cls, raw: bytes) -> Answer:
        d = orjson.loads(raw)
        return cls(d.get("data"), d.get("code", ""), d.get("message", ""), str(d.get("id") or ""),
                   float(d.get("retry_after") or 0.0))
