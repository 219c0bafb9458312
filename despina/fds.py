"""A process's file descriptors: each connection a gateway holds, to a client or to Redis, takes one.

Processes start with a soft open-files limit (`ulimit -n`) of 1024 in most shells and under systemd, whose
hard limit is far above it (524288). A gateway at its limit fails to accept: libuv then accepts and closes
the connections waiting at once (the clients see a reset; nothing is logged), and the gateway cannot open a
connection to Redis either, so that requests on the connections it holds are answered 503. So each role
raises its soft limit to the hard one at start (as Go's runtime, nginx's worker_rlimit_nofile and Valkey do),
and a gateway answers the connections past its connection limit 503 at once, keeping RESERVE descriptors
for Redis and the rest.
"""
from __future__ import annotations

import errno
import resource
from pathlib import Path

# descriptors a gateway keeps from its clients' connections: its Redis pool's (64 at most), the listening
# socket, the event loop's, logs, trace files, shared-memory regions, and the connections answered 503 as
# they close
RESERVE = 128


def raise_limit() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard limit (capped where the kernel caps it); return the soft
    limit before and after. A limit that cannot be raised is left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = _kernel_ceiling()
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a sandbox that forbids it: the limit stays
            return soft, soft
        return soft, target
    return soft, soft


def open_files_limit() -> int:
    """The soft open-files limit, a large number for none."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _kernel_ceiling() if soft == resource.RLIM_INFINITY else soft


def connection_limit(configured: int) -> int:
    """The client connections a gateway holds at once: `configured` (DESPINA_MAX_CONNECTIONS), or for 0 what
    the open-files limit leaves after RESERVE (half of it, for a limit under twice the reserve)."""
    if configured:
        return configured
    soft = open_files_limit()
    return max(soft - RESERVE, soft // 2)


def shortage(exc: BaseException) -> str | None:
    """Where `exc`, or an error it was raised from, is the want of a file descriptor (EMFILE: this process's
    open-files limit; ENFILE: the system's): what ran out, and the limit to raise; else None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.EMFILE:
            return (f"out of file descriptors: its open-files limit ({open_files_limit()}) is reached; raise "
                    "the hard limit (LimitNOFILE= under systemd, docker run --ulimit nofile=, ulimit -Hn)")
        if isinstance(cause, OSError) and cause.errno == errno.ENFILE:
            return "out of file descriptors: the system's limit is reached; raise it (sysctl fs.file-max)"
        cause = cause.__cause__ or cause.__context__
    return None


def _kernel_ceiling() -> int:
    """The most descriptors a process may have (Linux: fs.nr_open; elsewhere a safe 10240, macOS's
    OPEN_MAX, which setrlimit refuses to go past)."""
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 10240
