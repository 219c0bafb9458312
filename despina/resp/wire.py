"""Commands in RESP, the Redis protocol's encoding (arrays of bulk strings): packed by hiredis in C, and
the parts of a hot loop's commands that repeat packed once and kept (Prefix, prefix, packed).
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Iterable, Sequence

from hiredis import pack_command

Arg = bytes | str | int | float
Command = Sequence[Arg] | bytes  # bytes, or Parts: a command packed already (`Prefix`)
LARGE = 1 << 16  # an argument this long is written as it is, never copied into its command's bytes


class Parts(list[bytes]):
    """A command packed in parts, its large arguments (LARGE) among them as they are: `gather` and the
    connection's write pass them on without copying them (a 100 MB tensor was copied twice here)."""


def pack(commands: Iterable[Command]) -> bytes:
    """Commands in RESP (arrays of bulk strings), packed by hiredis in C: a worker's reply pipeline
    of some 60 arguments costs 11 µs this way and 30 in Python. hiredis takes str, bytes, int and
    float (repr's digits, as redis-py writes them); a command with anything else (a bool, a numpy
    integer) is packed here, each argument as its int or float value. A command given as bytes or
    Parts was packed already (`Prefix`)."""
    packed = gather(commands)
    return packed if isinstance(packed, bytes) else b"".join(packed)


def gather(commands: Iterable[Command]) -> bytes | list[bytes]:
    """`pack`'s bytes; or, where a command holds a large argument (Parts), the parts to write one after
    the other: each large argument alone, what lies between them joined."""
    out = []
    large = False
    for command in commands:
        if type(command) is bytes:
            out.append(command)
            continue
        if type(command) is Parts:
            out += command
            large = True
            continue
        try:  # the ignore: hiredis's stub types the command as a 1-tuple
            out.append(pack_command(command if type(command) is tuple  # type: ignore[arg-type]
                                    else tuple(command)))
        except TypeError:
            out.append(_pack_slowly(command))
    if not large:
        return b"".join(out)
    parts: list[bytes] = []
    small: list[bytes] = []
    for part in out:
        if len(part) < LARGE:
            small.append(part)
            continue
        if small:
            parts.append(b"".join(small))
            small = []
        parts.append(part)
    if small:
        parts.append(b"".join(small))
    return parts


class Prefix:
    """A command's leading arguments, packed once, for a command a hot loop sends again and again with
    only its last arguments new (a reply stream's XADD, a statistics hash's EVAL): `command(*rest)`
    packs just those. hiredis spends ~1,800 instructions an argument, most of them in sprintf writing
    its length; a worker's pipeline repeats some 25 of its arguments every batch. `prefix` keeps them."""

    __slots__ = ("_count", "_packed")

    def __init__(self, *args: Arg) -> None:
        self._count = len(args)
        self._packed = pack([args]).split(b"\r\n", 1)[1]  # the arguments, without "*N"

    def command(self, *rest: Arg) -> bytes | Parts:
        out = [b"*%d\r\n" % (self._count + len(rest)), self._packed]
        large = False
        for arg in rest:
            data = arg if type(arg) is bytes else _data(arg)
            if len(data) < 1024:  # a small one formatted in one go; a large one not copied for it
                out.append(b"$%d\r\n%b\r\n" % (len(data), data))
            else:
                out += (b"$%d\r\n" % len(data), data, b"\r\n")
                large = large or len(data) >= LARGE
        return Parts(out) if large else b"".join(out)


@functools.lru_cache(maxsize=1024, typed=True)  # typed: 1 and 1.0 are packed apart
def prefix(*args: Arg) -> Prefix:
    """The Prefix of these leading arguments, kept for the next command that repeats them (Batch's)."""
    return Prefix(*args)


@functools.lru_cache(maxsize=1024, typed=True)
def packed(*command: Arg) -> bytes:
    """A command with nothing new in it, packed once and kept (a reply stream's PEXPIRE, a worker's read)."""
    return pack([command])


def _pack_slowly(command: Sequence[Arg]) -> bytes:
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        data = _data(arg)
        out += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(out)


def _data(arg: Arg) -> bytes:
    """An argument's bytes: str as UTF-8, an integer (a bool, a numpy one) as its value, anything else as
    a float's repr."""
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, numbers.Integral):
        return b"%d" % int(arg)
    return repr(float(arg)).encode()
