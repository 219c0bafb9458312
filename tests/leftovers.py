"""What a test leaves behind once its cleanup ran: keys under its prefix (written by a process that outlived
its test, or that took another database than the test's), and Despina processes. conftest.py's session guard
turns either into an error, so that a stray writer cannot fill a shared Redis silently."""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import redis

PATTERN = "despina-test-"  # how every test's key prefix starts (conftest.new_prefix)
# prefix -> the test (or module) that owned it: every prefix this process has deleted
DELETED: dict[str, str] = {}


def deleted(prefix: str, owner: str) -> None:
    """`prefix` is no longer in use: any key under it from now on is a leftover."""
    DELETED[prefix] = owner


def clients(redis_url: str) -> list[redis.Redis]:
    """The test Redis's database, and its database 0 where the tests use another: a process started
    without the test's database (a URL without one, or REDIS_URL taken from the environment) writes there."""
    client = redis.Redis.from_url(redis_url)
    kwargs = client.connection_pool.connection_kwargs
    if not kwargs.get("db"):
        return [client]
    pool = redis.ConnectionPool(connection_class=client.connection_pool.connection_class, **{**kwargs, "db": 0})
    return [client, redis.Redis(connection_pool=pool)]


def left_keys(redis_url: str) -> list[str]:
    """Each key found under a deleted prefix, "<db> <key> (<owner>)"; deleted as found."""
    found: list[str] = []
    for client in clients(redis_url):
        try:
            db = client.connection_pool.connection_kwargs.get("db", 0)
            keys = [k for k in client.scan_iter(f"{PATTERN}*", count=1000)
                    if k.split(b":", 1)[0].decode(errors="replace") in DELETED]
            found += [f"db {db}: {k.decode(errors='replace')} (left by {DELETED[k.split(b':', 1)[0].decode()]})"
                      for k in keys]
            if keys:
                client.delete(*keys)
        finally:
            client.close()
    return found


def live_roles(pids: set[int]) -> dict[int, str]:
    """The Despina processes among `pids` (its roles, serve, model stubs) still running: pid -> command line."""
    alive = {}
    for pid in sorted(pids):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            args = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if state != "Z" and (b"-m\0despina" in args or b"/despina/" in args):
            alive[pid] = " ".join(a.decode(errors="replace") for a in args.split(bytes(1))).strip()
    return alive


def stop_roles(pids: set[int]) -> list[str]:
    """Kill the Despina processes among `pids` still running; "<pid>: <command line>" of each."""
    alive = live_roles(pids)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return [f"{pid}: {args}" for pid, args in alive.items()]
