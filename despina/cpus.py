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
        if not first.isdigit() or (dash and not last.isdigit()):
            raise CpuListError(f"expected a CPU list such as 0-3,8, got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise CpuListError(f"the range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8"."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def available() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: taskset, a container's cpuset)."""
    if not hasattr(os, "sched_getaffinity"):
        raise CpuListError("pinning processes to CPUs needs Linux")
    return frozenset(os.sched_getaffinity(0))


def count() -> int:
    """How many CPUs this process may run on (all of the machine's where affinity is not known)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check(cpus: frozenset[int]) -> None:
    """Raise unless every CPU of `cpus` is one this process may run on."""
    missing = cpus - available()
    if missing:
        raise CpuListError(f"CPU {format_list(missing)} is not available here (this process may run on "
                           f"{format_list(available())})")


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
