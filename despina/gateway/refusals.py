"""What Redis refused of a pipeline of requests (RequestWriter._write's), read from its commands as they
went: nothing is kept for it on the way out, where nearly every pipeline is taken whole.

A stream entry Redis refused fails its requests with Redis's error (refusal); the requests of the entries
it added run as usual. The statistics follow what was queued: a model stream's `enqueued` HINCRBY that went
through for entries refused is taken back, one refused for entries added is made good, and the gateway's
own counters that rode along (counters.Deferred) go again.

A request that could not reach Redis at all hears so (unreachable), unless the gateway had no file
descriptor left to connect with: then that, which Redis is not at fault for and an operator can fix.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import hiredis
import msgpack
from hiredis import ReplyError
from redis.exceptions import ResponseError

from .. import fds
from ..contract import records
from ..contract.errors import Code, DespinaError, Unavailable
from ..contract.keys import FIELD
from ..logs import Throttled
from ..redis_client import trouble
from ..resp import Command, Parts, fields

# the first word of errors that end when Redis recovers (memory freed, a failover over, a dataset loaded,
# a script done): the client may retry (503); any other says Redis is not as Despina needs it (500)
PASSING = frozenset({"OOM", "READONLY", "MISCONF", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN",
                     "CLUSTERDOWN", "NOREPLICAS"})

_short_of_fds = Throttled(logging.getLogger("despina.gateway"), logging.ERROR)

Refused = list[tuple[str, DespinaError]]  # (request id, its error)
Counts = dict[bytes, dict[str, int]]  # statistics hash -> counters to add


def refusal(reply: ReplyError) -> DespinaError:
    """The error of a request whose entry Redis refused with `reply`."""
    said = str(reply).split(" script: ", 1)[0]  # a script's error ends with where in the script it was
    if said.split(" ", 1)[0] in PASSING:
        return Unavailable(f"the request queue (Redis) refused the request: {said}")
    return DespinaError(f"queueing the request failed: {trouble(ResponseError(said))}", Code.INTERNAL)


def unreachable(what: str, exc: BaseException) -> Unavailable:
    """The error of a request for which `what` (Redis, in the part it plays) could not be reached, for `exc`:
    where the gateway had no descriptor left for the connection, that, logged (once in a while)."""
    short = fds.shortage(exc)
    if short is None:
        return Unavailable(f"{what}: {exc}")
    said = f"the gateway is {short}, or lower DESPINA_MAX_CONNECTIONS (the client connections it holds)"
    _short_of_fds.log("%s", said)
    return Unavailable(said)


def read(commands: Sequence[Command], results: list[Any]) -> tuple[Refused, Counts]:
    """The requests of the stream entries refused among `commands` (a model stream's XADDs, then its
    `enqueued` HINCRBY, stream after stream; then counters.HINCRBY_MANY's EVALs), each with its error; and
    the counters that put the statistics right. Only commands refused, and the HINCRBYs, are read."""
    refused: Refused = []
    fixes: Counts = {}
    lost = 0  # requests of the current stream's refused entries
    for command, result in zip(commands, results):
        error = type(result) is ReplyError
        if not error and type(result) is not int:
            continue  # an entry added (its id), or counters written (nil)
        args = _args(command)
        name = args[0].upper()
        if name == b"XADD":
            failed = refusal(result)
            for req in records.decode_requests(fields(args[3:])[FIELD]):
                ids = [m for m, _ in records.members(req.id)] if req.id[:1] == records.GROUPED else [req.id]
                refused += [(rid, failed) for rid in ids]
                lost += len(ids)
        elif name == b"HINCRBY":  # the stream's requests, less those too large to send
            added = int(args[3]) - lost
            fix = added - (0 if error else int(args[3]))
            if fix:
                _add(fixes, args[1], {args[2].decode(): fix})
            lost = 0
        elif name == b"EVAL" and error:
            _add(fixes, args[3], msgpack.unpackb(args[4], strict_map_key=True))
    return refused, fixes


def _add(counts: Counts, key: bytes, added: dict[str, int]) -> None:
    mine = counts.setdefault(key, {})
    for field, n in added.items():
        mine[field] = n if field == "last_inference" else mine.get(field, 0) + n


def _args(command: Command) -> list[bytes]:
    """A command's arguments, read back from it as it was packed (resp.wire), or as it was given."""
    if isinstance(command, bytes):
        parts: list[bytes] = [command]
    elif isinstance(command, Parts):
        parts = command
    else:
        return [a if isinstance(a, bytes) else str(a).encode() for a in command]
    reader = hiredis.Reader()
    for part in parts:
        reader.feed(part)
    args: list[bytes] = reader.gets()
    return args
