"""One way to connect to Redis, used by every role."""
from __future__ import annotations

import logging
import re
import socket
import weakref
from urllib.parse import parse_qs, urlparse

import redis
import redis.asyncio as aioredis
import redis.retry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ConnectionError,
    MaxClientsReachedError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import fds

log = logging.getLogger("despina")

# A dead Redis must fail a request within a second, not hang it: connecting gives up after this.
CONNECT_TIMEOUT_S = 0.5

# A Redis whose host vanished without a word (a node lost, packets dropped: no reset comes) leaves every
# connection to it open, and commands waiting on it, until the kernel gives up on it (~15 min): keepalive
# probes find an idle connection dead within ~11 s, and sent data unacknowledged for 10 s ends one. A
# Redis that only stalls (its host's kernel still acknowledges) is not affected. Linux's options; the
# ones another system lacks are left out.
KEEPALIVE = {getattr(socket, name): value for name, value in
             (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 10_000))
             if hasattr(socket, name)}


def keep_alive(sock: socket.socket) -> None:
    """KEEPALIVE's options on a TCP connection to Redis."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE.items():
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


# A worker's models share its pool, and a worker of more models than the pool has connections sends a
# command for each at once: as they load together (their consumer groups), stop together (CLIENT UNBLOCK,
# leaving the groups), reclaim together. Past the pool's size redis-py refuses a command ("Too many
# connections"): 400 models loading at once failed to load. A worker's command waits for a connection
# instead, this long at most.
WORKER_POOL_WAIT_S = 30.0


def connect(url: str, max_connections: int = 64, wait_s: float = 0.0) -> aioredis.Redis:
    """A client of `max_connections` connections at most; with `wait_s`, a command that finds them all in
    use waits up to that long for one (ConnectionError after), else it fails at once."""
    # socket_timeout=None avoids a timeout object per read; TCP keepalive finds dead connections.
    # One immediate retry on a broken connection: after Redis restarts, the pool's idle connections are
    # dead and the first command on each would fail; a connect timeout is not retried.
    tcp = {} if url.lower().startswith("unix://") else {"socket_keepalive": True,
                                                        "socket_keepalive_options": KEEPALIVE}
    pool_class = aioredis.BlockingConnectionPool if wait_s else aioredis.ConnectionPool
    waits = {"timeout": wait_s} if wait_s else {}
    pool = pool_class.from_url(
        url, max_connections=max_connections, socket_timeout=None, socket_connect_timeout=CONNECT_TIMEOUT_S,
        health_check_interval=0, retry_on_timeout=False,
        retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)), **waits, **tcp)
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose closes its connections


def connect_worker(url: str, max_connections: int = 64) -> aioredis.Redis:
    """A worker's client: its commands wait for a free connection (WORKER_POOL_WAIT_S)."""
    return connect(url, max_connections, wait_s=WORKER_POOL_WAIT_S)


# A blocking client's commands give up after this: its thread must not wait on a Redis that stopped answering
# for ever, nor keep the role waiting as it stops (the thread is joined).
SYNC_TIMEOUT_S = 2.0


def connect_sync(url: str) -> redis.Redis:
    """A blocking client of one connection (opened at its first command), for a thread of a role's own: the
    same URL as the role's client, and so the same database, credentials and TLS."""
    tcp = {} if url.lower().startswith("unix://") else {"socket_keepalive": True,
                                                        "socket_keepalive_options": KEEPALIVE}
    return redis.Redis.from_url(
        url, max_connections=1, socket_timeout=SYNC_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=0, retry_on_timeout=False,
        retry=redis.retry.Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)), **tcp)


def url_trouble(url: str) -> str | None:
    """What is wrong with a Redis URL that redis-py would take and fail on only at its first command (in
    every role at once, each with a traceback), or would quietly read otherwise: None when nothing is."""
    try:
        connect(url).connection_pool.make_connection()
    except TypeError as exc:  # a query parameter the connection does not take
        said = re.search(r"keyword argument '(.*)'", str(exc))
        return f"unknown parameter {said[1]!r}" if said else str(exc)
    except (ValueError, RedisError) as exc:  # no password in these: the port, a parameter's value
        return str(exc)
    parsed = urlparse(url)
    if parsed.scheme.lower() == "unix":
        return None if parsed.path else "a unix:// URL names the socket's path (unix:///path/to/redis.sock)"
    db = parsed.path.strip("/")
    if db and not db.isdigit() and "db" not in parse_qs(parsed.query):
        return f"the database (the URL's path) must be a number, got {db!r}"
    return None


_PIPELINED = re.compile(r"Command # \d+ \((.*)\) of pipeline caused error: (.*)", re.DOTALL)


def trouble(exc: BaseException) -> str:
    """What a failed Redis call says in a log. Redis that answered with an error is not unreachable: a
    WRONGTYPE error means a key where Despina keeps its own holds another kind of value, most likely
    another program's key under the same key prefix. Nor is an entry that Redis returned but that cannot
    be read (JSON that does not parse, a field missing): the entry is named as the trouble."""
    if isinstance(exc, ResponseError):
        said = str(exc)
        piped = _PIPELINED.match(said)  # redis-py's words for a pipeline's: the command, then the error
        if piped:
            said = f"{piped[2]}; the command: {piped[1]}"
        hint = ": another program's key under this key prefix? (--key-prefix)" if "WRONGTYPE" in said else ""
        return f"Redis refused a command ({said}){hint}"
    short = fds.shortage(exc)
    if short is not None:  # no fault of Redis's: the process had no descriptor for the connection
        return f"this process is {short} ({exc})"
    # redis-py's ConnectionErrors that Redis answered: a password, the ACL, its maxclients; its data loading
    if isinstance(exc, (AuthenticationError, AuthorizationError, MaxClientsReachedError)):
        return f"Redis refused the connection ({exc})"
    if isinstance(exc, BusyLoadingError):
        return f"Redis is loading its data ({exc})"
    if isinstance(exc, (ConnectionError, RedisTimeoutError, OSError)):  # (builtin TimeoutError is an OSError)
        return f"Redis unreachable ({exc})"
    if isinstance(exc, RedisError):
        return f"a Redis call failed ({type(exc).__name__}: {exc})"
    if isinstance(exc, (ValueError, KeyError, TypeError)):  # (JSON's decode errors are ValueErrors)
        kind = "" if type(exc) is ValueError else f"{type(exc).__name__}: "
        return f"an entry read from Redis is malformed ({kind}{exc})"
    return f"unexpected {type(exc).__name__} ({exc})"


# A Lua script's first line that lets it write while Redis is at its maxmemory (policy noeviction refuses
# every write that may grow memory): for the few small writes that keep the cluster coherent then, such as
# heartbeats, never for requests. Redis 7+ and Valkey read it; an older Redis refuses the script.
ALLOW_OOM = "#!lua flags=allow-oom\n"
_reads_flags: weakref.WeakKeyDictionary[aioredis.Redis, bool] = weakref.WeakKeyDictionary()


async def allow_oom(redis: aioredis.Redis, body: str) -> str:
    """The script `body` flagged to run while Redis is full, where the server reads script flags; else
    `body` as it is (refused while Redis is full, as any write is). The server is asked once per client."""
    flags = _reads_flags.get(redis)
    if flags is None:
        try:
            await redis.eval(ALLOW_OOM + "return 1", 0)
            flags = True
        except ResponseError as exc:  # Redis 6: "Error compiling script ... near '#'"; 7+: "... shebang ..."
            said = str(exc)
            if "shebang" not in said and "compiling script" not in said.lower():
                raise
            log.warning("Redis does not read script flags (%s): heartbeats too are refused while it is full "
                        "(maxmemory); Redis 7 or Valkey take them", said)
            flags = False
        _reads_flags[redis] = flags
    return ALLOW_OOM + body if flags else body


# Redis's proto-max-bulk-len by default: the most bytes one argument of a command may have. A longer one
# is a protocol error, and Redis closes the connection, failing every command sent on it.
BULK_DEFAULT = 512 * 1024 * 1024


async def bulk_limit(redis: aioredis.Redis) -> int:
    """The most bytes a stream entry's payload may have on this Redis: its proto-max-bulk-len, or Redis's
    default where the server does not say (a managed service refuses CONFIG) or cannot be asked now."""
    try:
        found = await redis.config_get("proto-max-bulk-len")
        return int(found["proto-max-bulk-len"] or BULK_DEFAULT)
    except (RedisError, OSError, KeyError, ValueError, TypeError):
        return BULK_DEFAULT
