"""pb_utils' errors: TritonModelException, which a model raises, and TritonError, which fails one response.

Part of `triton_python_backend_utils`, which re-exports these names; a model imports them from there.
"""
from __future__ import annotations


class TritonModelException(Exception):
    """Raised by a model (or by pb_utils) for an error in initialize, execute or finalize."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


class TritonError:
    """The error of one response: `InferenceResponse(error=TritonError("..."))` fails that request."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        self._msg = msg
        self._code = code

    def __str__(self) -> str:
        return self._msg

    def __repr__(self) -> str:
        return f"TritonError({self._msg!r}, {self._code})"

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code

