"""A lean Redis connection for the hot loops: the gateway's request writes and reply reads, and a
worker's stream reads and reply writes.

redis-py's asyncio pipeline spends about 140 µs of CPU per round trip on this machine (command
objects, the connection pool, retries, event hooks); the same two commands packed by hand and parsed
by hiredis cost 60, and the hot loops make one or two round trips per batch. Commands are written in
one `transport.write` and their replies matched in order, so one connection carries pipelines from
several callers; a blocking read needs a connection of its own. Errors are redis-py's exception
types (ConnectionError, TimeoutError, ResponseError), so callers handle both clients alike. Every
other use of Redis stays on redis-py (redis_client.connect).

wire packs the commands, connection is the connection (Resp), pipeline holds what the hot loops build
on it (Batch, ReadAlong, fields).
"""
from __future__ import annotations

from .connection import Resp
from .pipeline import Batch, ReadAlong, fields
from .wire import Arg, Command, Parts, Prefix, gather, pack, packed, prefix

__all__ = ["Arg", "Batch", "Command", "Parts", "Prefix", "ReadAlong", "Resp", "fields", "gather", "pack",
           "packed", "prefix"]
