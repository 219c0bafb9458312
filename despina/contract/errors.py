"""Domain errors carry a code; the gateway maps codes to HTTP statuses in one place."""
from __future__ import annotations

import enum


class Code(str, enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    BACKEND = "BACKEND"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"  # its client went away (Triton's CANCELED failure reason)
    ALREADY_EXISTS = "ALREADY_EXISTS"  # a name taken already (a shared memory region's)
    UNSUPPORTED_ENCODING = "UNSUPPORTED_ENCODING"  # a request body in a Content-Encoding not read
    UNIMPLEMENTED = "UNIMPLEMENTED"  # what a model does not do (a Python model's TritonError UNSUPPORTED)


class DespinaError(Exception):
    """An error with a code that every component understands."""

    code: Code = Code.INTERNAL
    # seconds after which a retry may succeed, where that is known (a failed cold start's backoff): the
    # gateway's Retry-After; 0: not known
    retry_after: float = 0.0

    def __init__(self, message: str, code: Code | None = None, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retry_after:
            self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message


class InvalidArgument(DespinaError):
    code = Code.INVALID_ARGUMENT


class NotFound(DespinaError):
    code = Code.NOT_FOUND


class Unavailable(DespinaError):
    code = Code.UNAVAILABLE


class DeadlineExceeded(DespinaError):
    code = Code.DEADLINE_EXCEEDED


class ConfigError(DespinaError):
    """A model's configuration cannot be used; the message names the model and the field."""

    code = Code.INVALID_ARGUMENT


class BackendError(DespinaError):
    code = Code.BACKEND


class FailedPrecondition(DespinaError):
    """The call is valid but the system is not in a state to run it (e.g. a model that is unloaded)."""

    code = Code.FAILED_PRECONDITION


class ResourceExhausted(DespinaError):
    code = Code.RESOURCE_EXHAUSTED


class Cancelled(DespinaError):
    code = Code.CANCELLED


class ReplyError(DespinaError):
    """The error a request's reply carried, with the code its worker gave: the request was taken, and
    the model (or its worker) failed it. Triton's generate endpoint answers these differently."""
