"""CPU lists, as `taskset -c` writes them ("0-3,8"), and pinning a process to one (Linux)."""
from __future__ import annotations

import os


class CpuListError(ValueError):
    """A CPU list that cannot be parsed, or names CPUs this process may not run on."""


def parse(text: str) -> frozenset[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}; ranges are inclusive, spaces are ignored."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not _number(first) or (dash and not _number(last)):
            raise CpuListError(f"expected a CPU list such as 0-3,8, got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise CpuListError(f"the range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()  # str.isdigit() alone takes '²', which int() refuses


def format_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def available() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: taskset, a container's cpuset)."""
    if not hasattr(os, "sched_getaffinity"):
        raise CpuListError("pinning processes to CPUs needs Linux")
    return frozenset(os.sched_getaffinity(0))


def count() -> int:
    """How many CPUs this process may run on (all of the machine's where affinity is not known)."""
    try:
        return len(available())
    except CpuListError:
        return os.cpu_count() or 1


def check(cpus: frozenset[int]) -> None:
    """Raise unless every CPU of `cpus` is one this process may run on."""
    here = available()
    if cpus - here:
        raise CpuListError(f"CPU {format_list(cpus - here)} is not available here (this process may run "
                           f"on {format_list(here)})")


def pin(cpus: frozenset[int]) -> None:
    """Run this process on `cpus` only: each of its threads (an affinity is a thread's), and so every
    thread it starts from now on."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
