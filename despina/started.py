"""How a role under `despina serve` tells serve that it has started: one byte on a pipe.

serve must tell a role that could not start (a repository it cannot read, another program's key where
Despina keeps its own, an import error: restarted, it fails again) from one that crashed once up (a
restart is the cure). It used to judge by the time since the spawn, which a loaded machine makes long
and a fast crash short. Now each role writes a byte on a pipe that serve gives it (its write end's
number in READY_FD) once it is up: a gateway serving, a worker that joined, a control plane that leads
or stands by. The byte stays in the pipe after the role's death, even a SIGKILL's, so serve reads it then
without a race; a pipe whose writer closed without a byte never will say it.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

READY_FD = "DESPINA_READY_FD"


def from_environ() -> Callable[[], None]:
    """The role's side: what it calls once it is up (a second call does nothing). Taken out of the
    environment at once, so that a process the role starts (a model's stub) does not write on it too; a
    role started by hand has none, and the call does nothing."""
    fd: int | None = None
    with contextlib.suppress(ValueError):
        fd = int(os.environ.pop(READY_FD, ""))
    if fd is not None:
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)

    def say() -> None:
        nonlocal fd
        if fd is None:
            return
        with contextlib.suppress(OSError):  # serve is gone: nobody to tell
            os.write(fd, b"1")
        with contextlib.suppress(OSError):
            os.close(fd)
        fd = None
    return say


class Listener:
    """serve's side, for one start of one role: `fd` is to select on, `env` to start the role with, and
    `write_fd` to pass to it (and close here once it is started)."""

    def __init__(self) -> None:
        self.fd, self.write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        self.up = False  # it said it started
        self.done = False  # it said so, or can no longer (its write end closed): fd is closed

    def env(self) -> dict[str, str]:
        return {READY_FD: str(self.write_fd)}

    def spawned(self) -> None:
        """The role has its copy of the write end: serve's goes, so that the role's end is the pipe's end."""
        os.close(self.write_fd)

    def listen(self) -> bool:
        """Whether the role said it started (by now): reads what came, without waiting."""
        if self.done:
            return self.up
        try:
            said = os.read(self.fd, 16)
        except BlockingIOError:  # nothing yet, and the role (or a process it started) holds the write end
            return False
        self.up = bool(said)
        self.close()
        return self.up

    def close(self) -> None:
        if not self.done:  # once only: the number may be another file's by now
            self.done = True
            os.close(self.fd)
