"""Messages on the streams, as frozen records with an explicit msgpack codec.

Tensors travel as (name, datatype, shape, raw bytes), never as Python lists. A stream entry holds
a list of records: the gateway writes every request that arrived in one event-loop tick as one entry,
a worker writes every reply of one batch for one gateway as one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from .datatypes import to_numpy
from .errors import Code, InvalidArgument

# What unpacking a record of the wrong shape can raise: wrong types or lengths, a map where a list
# belongs (KeyError), a float infinity where an integer belongs (OverflowError).
MALFORMED = (TypeError, ValueError, KeyError, IndexError, OverflowError)


@dataclass(slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes

    def numpy(self) -> np.ndarray:
        return to_numpy(self.datatype, self.shape, self.data)

    def pack(self) -> list[Any]:
        return [self.name, self.datatype, list(self.shape), self.data]

    @classmethod
    def unpack(cls, raw: Any) -> Tensor:
        name, datatype, shape, data = raw
        if type(name) is not str or type(datatype) is not str or type(data) is not bytes \
                or type(shape) is not list:
            raise InvalidArgument("malformed tensor record")
        for d in shape:
            if type(d) is not int or d < 0:
                raise InvalidArgument("malformed tensor record")
        return cls(name, datatype, tuple(shape), data)


@dataclass(slots=True)
class InferRequest:
    """One inference request as a worker sees it."""

    id: str                      # unique per gateway; replies are matched by it
    reply_to: str                # the gateway's reply stream
    deadline: float              # wall-clock seconds (time.time()); past it the request is not run
    inputs: tuple[Tensor, ...]
    outputs: tuple[str, ...] = ()  # requested outputs; empty = all
    priority: int = 0
    timeout_us: int = 0          # queue timeout asked for by the client (0 = the model's default)
    enqueued: float = 0.0        # wall-clock seconds when the gateway wrote it
    trace: str = ""              # X-Request-Id, for logs

    def pack(self) -> list[Any]:
        return [self.id, self.reply_to, self.deadline, [t.pack() for t in self.inputs],
                list(self.outputs), self.priority, self.timeout_us, self.enqueued, self.trace]

    @classmethod
    def unpack(cls, raw: Any) -> InferRequest:
        try:
            rid, reply_to, deadline, inputs, outputs, priority, timeout_us, enqueued, trace = raw
            if type(rid) is not str or type(reply_to) is not str or type(trace) is not str:
                raise TypeError("id, reply_to and trace must be strings")
            for o in outputs:
                if type(o) is not str:
                    raise TypeError("output names must be strings")
            return cls(rid, reply_to, float(deadline), tuple([Tensor.unpack(t) for t in inputs]),
                       tuple(outputs), int(priority), int(timeout_us), float(enqueued), trace)
        except MALFORMED as exc:
            raise InvalidArgument(f"malformed request record: {exc}") from None


@dataclass(slots=True)
class InferReply:
    """A worker's answer to one request: outputs, or an error code and message."""

    id: str
    outputs: tuple[Tensor, ...] = ()
    error: tuple[Code, str] | None = None
    queue_us: int = 0
    compute_us: int = 0

    def pack(self) -> list[Any]:
        err = [self.error[0].value, self.error[1]] if self.error else None
        return [self.id, [t.pack() for t in self.outputs], err, self.queue_us, self.compute_us]

    @classmethod
    def unpack(cls, raw: Any) -> InferReply:
        try:
            rid, outputs, err, queue_us, compute_us = raw
            if type(rid) is not str:
                raise TypeError("the id must be a string")
            error = (Code(err[0]), str(err[1])) if err else None
            return cls(rid, tuple([Tensor.unpack(t) for t in outputs]), error, int(queue_us), int(compute_us))
        except MALFORMED as exc:
            raise InvalidArgument(f"malformed reply record: {exc}") from None


def encode(records: list[InferRequest] | list[InferReply]) -> bytes:
    return msgpack.packb([r.pack() for r in records], use_bin_type=True)


def _decode_list(payload: bytes) -> list[Any]:
    try:
        raw = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise InvalidArgument(f"undecodable message: {exc}") from None
    if not isinstance(raw, list):
        raise InvalidArgument("a stream entry must hold a list of records")
    return raw


def decode_requests(payload: bytes) -> list[InferRequest]:
    return [InferRequest.unpack(r) for r in _decode_list(payload)]


def decode_replies(payload: bytes) -> list[InferReply]:
    return [InferReply.unpack(r) for r in _decode_list(payload)]
