"""The pipe between the worker and a Python model's process (python_process.Stub), its worker end: reads
and writes that wait on a socket left non-blocking, and messages pickled plainly."""
from __future__ import annotations

import os
import pickle
import select
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def _wait(fd: int, event: int) -> None:
    poller = select.poll()
    poller.register(fd, event)
    poller.poll()


def _write(fd: int, data: Any) -> int:
    """os.write, waiting where the socket is non-blocking and full."""
    while True:
        try:
            return os.write(fd, data)
        except BlockingIOError:
            _wait(fd, select.POLLOUT)


def _read(fd: int, size: int) -> bytes:
    """os.read, waiting where the socket is non-blocking and the rest has not come yet."""
    while True:
        try:
            return os.read(fd, size)
        except BlockingIOError:
            _wait(fd, select.POLLIN)


class PatientConnection(Connection):
    """multiprocessing's connection, whose reads and writes wait on a socket left non-blocking: uvloop's
    add_reader (call_async) sets O_NONBLOCK on the socket and leaves it so, and a message larger than the
    socket's buffer (a 1 MiB input or parameter, say) then broke off with BlockingIOError in the next call,
    taken for the process's death."""

    def _send(self, buf: Any, write: Callable[[int, Any], int] = _write) -> None:
        super()._send(buf, write)  # type: ignore[misc]  # private, so not in typeshed

    def _recv(self, size: int, read: Callable[[int, int], bytes] = _read) -> Any:
        return super()._recv(size, read)  # type: ignore[misc]


def dumps(message: Any) -> bytes:
    """A message for the pipe: plain pickle (Connection.send's ForkingPickler costs several times more
    for these small messages, for reductions they never need)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
