"""A sub-millisecond alarm for the event loop.

uvloop's (libuv's) timers count whole milliseconds: `call_at` 500 µs ahead rounds down to the next
loop iteration, so a batcher waiting out what is left of Triton's usual 500 µs queue delay (or a
gateway holding its requests for 200 µs, gateway/dispatch.py) would spin through the loop until the
deadline, taking the core from the processes that bring the next requests in. On Linux a timerfd
armed at the absolute deadline wakes the loop on time without the spin; elsewhere (or if the timerfd
cannot be made) `Alarm.create` returns None and callers keep `call_at`, or do without.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger("despina.alarm")

_CLOCK_MONOTONIC = 1          # what time.monotonic() reads on Linux
_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                             ctypes.c_void_p]
            _libc = libc
        except (OSError, AttributeError):
            return None
    return _libc


class Alarm:
    """Calls `fire` on the event loop at the time.monotonic() instant last given to `arm`.

    One pending instant at a time: arming again moves it. A fired alarm stays quiet until armed again.
    Arming costs a system call, and ~8 µs on a virtual machine when the instant is the CPU's nearest
    timer (reprogramming it goes through the hypervisor): arming again for the instant already pending
    makes no call.
    """

    def __init__(self, libc: ctypes.CDLL, fd: int, loop: asyncio.AbstractEventLoop,
                 fire: Callable[[], None]) -> None:
        self._libc, self._fd, self._loop, self._fire = libc, fd, loop, fire
        self._spec = _Itimerspec()
        self._ref = ctypes.byref(self._spec)
        self._pending: float | None = None  # the instant armed and not yet fired
        loop.add_reader(fd, self._ready)

    @classmethod
    def create(cls, fire: Callable[[], None]) -> Alarm | None:
        libc = _load()
        if libc is None:
            return None
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            log.debug("timerfd_create failed (errno %d): millisecond timers it is", ctypes.get_errno())
            return None
        try:
            return cls(libc, fd, asyncio.get_running_loop(), fire)
        except (NotImplementedError, OSError):  # a loop that cannot watch file descriptors
            os.close(fd)
            return None

    def arm(self, when: float) -> None:
        if when == self._pending:
            return
        seconds = int(when)
        value = self._spec.it_value
        value.tv_sec = seconds
        value.tv_nsec = max(1, int((when - seconds) * 1e9))  # 0 would disarm it
        self._pending = None  # until the kernel has it: a failed call must not make the next one a no-op
        self._settime(_TFD_TIMER_ABSTIME)
        self._pending = when

    def _settime(self, flags: int) -> None:
        if self._libc.timerfd_settime(self._fd, flags, self._ref, None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def _ready(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # re-armed or disarmed since it became readable
            return
        self._pending = None
        self._fire()

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
