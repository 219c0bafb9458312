"""What Despina needs of the Redis it is given, checked once at start-up (cli.main).

A server it cannot work with ends the process with one line that says why, where each role would
otherwise fail at its first command and be restarted without end, a traceback each time: a Redis
Cluster (MOVED: Despina's scripts and pipelines span a model's keys and the gateways' reply streams, and
its own connections, despina/resp/, follow no redirection), a read-only replica, a Sentinel, an ACL user
refused a command or a key Despina uses, a database the server does not have, credentials it refuses, a
rediss:// URL to a port that speaks no TLS. A server not reachable now passes: the roles wait for it.
"""
from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse

import redis
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    ExecAbortError,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from .contract.keys import CONTROL_GROUP, GROUP, Keys
from .embedded import host_port
from .redis_client import CONNECT_TIMEOUT_S

# a command at start-up waits this long at most: a Redis that accepts connections and answers nothing
# must not hold the start for ever
COMMAND_TIMEOUT_S = 5.0
PROBE = "despina-start-check"  # the model, worker and gateway name in the probe's keys (none is written)

# what a server answers for now, not for good: full (OOM at its maxmemory: the roles wait for room), loading
# its data, cut off from its primary, running a long script (BUSY, which redis-py gives no class); and
# EXECABORT, a transaction one of whose commands was refused. (redis-py takes the code off the message.)
PASSING = (OutOfMemoryError, BusyLoadingError, MasterDownError, TryAgainError, ExecAbortError)
PASSING_CODES = ("BUSY", "EXECABORT")

STANDALONE = ("a standalone Redis or Valkey, or the primary endpoint of a primary/replica one (a managed "
              "service's \"cluster mode disabled\")")


class Unusable(Exception):
    """A Redis Despina cannot work with: the message says why and what to use instead."""


@dataclass
class Found:
    """What the check saw besides what stops the start: warnings to log once."""

    warnings: list[str] = field(default_factory=list)


def probe_commands(keys: Keys) -> list[tuple[str, ...]]:
    """Every command Despina sends (its Lua scripts' calls too), each on a key of the kind it is used on:
    an ACL user must be allowed them all. Queued in a transaction that is discarded, none runs; the server
    checks each against the user's rights (and knows it: a renamed command is unknown) as it queues it.
    Kept in step with the code by tests/test_redis_check.py, which serves as a user allowed only these."""
    stream, dead = keys.request_stream(PROBE, 1), keys.dead_letters(PROBE, 1)
    replies, worker, queued = keys.reply_stream(PROBE), keys.worker(PROBE), keys.queued(PROBE, 1)
    return [
        ("XADD", stream, "*", "m", ""), ("XADD", dead, "*", "m", ""), ("XADD", replies, "*", "m", ""),
        ("XREADGROUP", "GROUP", GROUP, PROBE, "COUNT", "1", "STREAMS", stream, ">"),
        ("XREAD", "COUNT", "1", "STREAMS", replies, "0"), ("XACK", stream, GROUP, "0-1"),
        ("XDEL", stream, "0-1"), ("XLEN", stream), ("XRANGE", stream, "-", "+", "COUNT", "1"),
        ("XTRIM", replies, "MINID", "0-1"), ("XCLAIM", stream, GROUP, PROBE, "0", "0-1", "JUSTID"),
        ("XAUTOCLAIM", stream, GROUP, PROBE, "0", "0"), ("XPENDING", stream, GROUP),
        ("XGROUP", "CREATE", stream, GROUP, "0", "MKSTREAM"), ("XGROUP", "DELCONSUMER", stream, GROUP, PROBE),
        ("XGROUP", "CREATE", keys.control_commands, CONTROL_GROUP, "0", "MKSTREAM"),
        ("HSET", worker, "f", ""), ("HGET", worker, "f"), ("HMGET", worker, "f"), ("HGETALL", worker),
        ("HEXISTS", worker, "f"), ("HDEL", worker, "f"), ("HINCRBY", keys.stats(PROBE, 1), "f", "1"),
        ("COPY", keys.stats(PROBE, 1), keys.stats_base(PROBE, 1)),
        ("SADD", keys.workers, PROBE), ("SREM", keys.workers, PROBE), ("SMEMBERS", keys.workers),
        ("SISMEMBER", keys.cancelled(replies), PROBE),
        ("GET", keys.catalog_generation), ("SET", keys.control_leader, PROBE),
        ("INCR", keys.catalog_generation), ("INCRBY", queued, "1"), ("DECR", queued), ("DECRBY", queued, "1"),
        ("EXISTS", keys.catalog_published),
        ("DEL", replies), ("EXPIRE", replies, "1"), ("PEXPIRE", worker, "1"),
        ("RPUSH", keys.control_answers(PROBE), ""), ("LPUSH", keys.control_reply(PROBE), ""),
        ("LPOP", keys.control_answers(PROBE)), ("BLPOP", keys.control_reply(PROBE), "1"),
        ("EVAL", "return 1", "0"), ("PUBLISH", keys.events, ""), ("TIME",),
    ]


def check(url: str, prefix: str) -> Found:
    """What stops Despina working with the Redis at `url` under key `prefix`: raises Unusable saying it.
    Returns what is worth a warning (found.warnings)."""
    where = _where(url)
    client = _open(url, where)
    if client is None:
        return Found()  # not reachable now: each role says so, and waits for it
    try:
        _check_kind(_hello(client, where), where)
        _check_rights(client, Keys(prefix), where)
        return Found([w for w in (_eviction(client, where), _needless_password(client, url, where)) if w])
    except (ConnectionError, RedisTimeoutError, OSError):
        return Found()  # gone meanwhile: the roles say so
    finally:
        client.close()


def _where(url: str) -> str:
    """The server as a log may name it: no credentials, an IPv6 address in brackets ([::1]:6379)."""
    address = _address(url)
    return urlparse(url).path if address is None else host_port(*address)


def _address(url: str) -> tuple[str, int] | None:
    """The host (an IPv6 address without its brackets) and port of a TCP URL; None for unix://."""
    parsed = urlparse(url)
    if parsed.scheme.lower() == "unix":
        return None
    return parsed.hostname or "localhost", parsed.port or 6379


def _open(url: str, where: str) -> redis.Redis | None:
    """A client of one connection, connected (credentials and database taken); None when the server
    cannot be reached now."""
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                    socket_timeout=COMMAND_TIMEOUT_S, single_connection_client=True)
    except AuthenticationError as exc:
        raise Unusable(f"Redis at {where} refused the URL's credentials ({exc}): check the user name and "
                       "password in the URL (redis://USER:PASSWORD@host:port/db)") from None
    except ResponseError as exc:  # to SELECT the URL's database
        said = str(exc)
        if "cluster mode" in said.lower():
            raise _cluster(where) from None
        if "db index" in said.lower():
            raise Unusable(f"Redis at {where} has no database {client_db(url)} ({said}): its `databases` "
                           "setting says how many it has (16 by default), numbered from 0") from None
        raise Unusable(f"Redis at {where} refused the connection's set-up ({said})") from None
    except (ConnectionError, RedisTimeoutError, OSError):
        tls, address = urlparse(url).scheme.lower() == "rediss", _address(url)
        if tls and address and _answers_plain(*address):
            raise Unusable(f"{where} answers without TLS: use a redis:// URL (rediss:// is for a port that "
                           "speaks TLS)") from None
        if not tls and address and _speaks_tls(*address):
            raise Unusable(f"{where} speaks TLS: use a rediss:// URL") from None
        return None


def client_db(url: str) -> str:
    """The database a URL names, as redis-py reads it (its path, else ?db=)."""
    db = redis.connection.parse_url(url).get("db")
    return str(db if db is not None else 0)


def _hello(client: redis.Redis, where: str) -> dict[str, object]:
    """HELLO's description of the server (any user may ask: it is how a connection starts)."""
    try:
        reply = client.execute_command("HELLO")
    except ResponseError as exc:
        if "unknown command" in str(exc).lower():
            raise Unusable(f"Redis at {where} does not know HELLO: Despina needs Redis 6.2 or later, or "
                           "Valkey") from None
        raise Unusable(f"Redis at {where} refused HELLO ({exc})") from None
    if isinstance(reply, list):  # RESP2: a flat list of names and values
        reply = dict(zip(reply[::2], reply[1::2], strict=False))
    return {str(_text(k)): _text(v) for k, v in reply.items()}


def _text(value: object) -> object:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _cluster(where: str) -> Unusable:
    return Unusable(f"Redis at {where} runs in cluster mode, which Despina does not support (its scripts and "
                    f"transactions span keys of several hash slots); use {STANDALONE}")


def _check_kind(hello: dict[str, object], where: str) -> None:
    mode, role = hello.get("mode"), hello.get("role")
    if mode == "cluster":
        raise _cluster(where)
    if mode == "sentinel":
        raise Unusable(f"{where} is a Redis Sentinel, not a Redis: give the address of the primary it names "
                       f"(SENTINEL GET-MASTER-ADDR-BY-NAME); use {STANDALONE}")
    if role in ("replica", "slave"):
        raise Unusable(f"Redis at {where} is a read-only replica: give the primary's address; use "
                       f"{STANDALONE}")


def _check_rights(client: redis.Redis, keys: Keys, where: str) -> None:
    """Every command of probe_commands queued in a transaction, then discarded: the first the server
    refuses (no right to it, its key or channel, or no such command) stops the start."""
    commands = probe_commands(keys)
    sent: list[tuple[str, ...]] = [("MULTI",), *commands, ("DISCARD",)]
    conn = client.connection  # one connection (single_connection_client); replies as they come, no parsing
    assert conn is not None
    replies: list[object] = []
    try:
        conn.send_packed_command(conn.pack_commands(sent))
        for _ in sent:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:  # its reply read whole: the next is read after it
                replies.append(exc)
    except (ConnectionError, RedisTimeoutError, OSError):
        return  # gone meanwhile: the roles say so
    refused = [(c, r) for c, r in zip(sent, replies, strict=True)
               if isinstance(r, ResponseError) and not isinstance(r, PASSING)
               and not str(r).startswith(PASSING_CODES)]
    if refused:
        raise Unusable(_refusal(refused, keys, where))


def _refusal(refused: Sequence[tuple[tuple[str, ...], ResponseError]], keys: Keys, where: str) -> str:
    command, error = refused[0]
    said, denied = str(error), isinstance(error, NoPermissionError)
    name = " ".join(command[:2]) if command[0] in ("XGROUP",) else command[0]
    others = sorted({c[0] for c, _ in refused[1:]} - {command[0]})
    more = f" (and {', '.join(others)})" if others else ""
    key = next((a for a in command if a.startswith(f"{keys.prefix}:")), "")
    if denied and "key" in said:
        need = f"keys matching {keys.pattern()} (ACL ~{keys.pattern()}; refused: {name} {key})"
    elif denied and "channel" in said:
        need = f"the channel {keys.events} (ACL &{keys.pattern()}; Redis 7 gives a new user no channel)"
    elif denied:
        need = f"the command {name}{more} (ACL +{name.replace(' ', '|').lower()})"
    elif "unknown command" in said.lower():
        return (f"Redis at {where} does not know {name}{more} ({said}): Despina needs Redis 6.2 or later, or "
                "Valkey, with none of these commands renamed or disabled")
    else:
        return f"Redis at {where} refused {name} ({said})"
    return f"the Redis user of the URL may not use {need}, which Despina needs ({said})"


def _eviction(client: redis.Redis, where: str) -> str | None:
    """A warning where Redis evicts keys when full: Despina's request streams and replies among them,
    requests lost without a word. With noeviction Redis refuses writes instead, and clients get an
    error. Not known (INFO refused, as an ACL without @dangerous does): no warning."""
    try:
        memory = client.info("memory")
    except (ResponseError, AuthenticationError):  # INFO refused (ACL -@dangerous) or renamed
        return None
    policy, limit = memory.get("maxmemory_policy"), memory.get("maxmemory")
    if policy in (None, "noeviction") or str(limit) == "0":  # no limit: nothing is ever evicted
        return None
    return (f"Redis at {where} has maxmemory-policy {policy}: when it is full it deletes keys, and Despina's "
            "request streams and replies may go with them (requests lost without an answer); set "
            "maxmemory-policy noeviction (full, Redis then refuses new requests, and clients are told)")


def _needless_password(client: redis.Redis, url: str, where: str) -> str | None:
    """A warning where the URL gives a password and the server asks none: anyone reaching it may use it."""
    parsed = urlparse(url)
    if not parsed.password or parsed.username:
        return None
    try:
        client.execute_command("AUTH", parsed.password)
    except (AuthenticationError, ResponseError) as exc:  # redis-py takes this one for an AuthenticationError
        if "without any password configured" in str(exc) or "no password is set" in str(exc):
            return (f"the URL gives a password, but Redis at {where} asks for none (its default user has "
                    "nopass): whoever reaches it can use it without one")
    except RedisError:
        pass
    return None


def _answers_plain(host: str, port: int) -> bool:
    """Whether host:port answers a plain-text PING as a Redis does (+PONG, or an error such as NOAUTH)."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as s:
            s.settimeout(1.0)
            s.sendall(b"PING\r\n")
            return s.recv(1)[:1] in (b"+", b"-")
    except (OSError, ValueError):
        return False


def _speaks_tls(host: str, port: int) -> bool:
    """Whether host:port answers a TLS handshake (a Redis with TLS on resets a plain-text client)."""
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE  # only whether it speaks TLS at all
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as s, \
                tls.wrap_socket(s, server_hostname=host or None):
            return True  # the handshake went through (it asks a client certificate only later)
    except ssl.SSLError as exc:  # an alert is TLS too (a client certificate asked for, a version refused)
        return "alert" in str(exc).lower()
    except (OSError, ValueError):
        return False
