"""Messages on the streams, as frozen records with an explicit msgpack codec.

Tensors travel as (name, datatype, shape, raw bytes), never as Python lists. A stream entry holds
a list of records: the gateway writes every request that arrived in one event-loop tick as one entry,
a worker writes every reply of one batch for one gateway as one entry.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import numpy as np

from .datatypes import to_numpy
from .errors import Code, InvalidArgument

# What unpacking a record of the wrong shape can raise: wrong types or lengths, a map where a list
# belongs (KeyError), a float infinity where an integer belongs (OverflowError).
MALFORMED = (TypeError, ValueError, KeyError, IndexError, OverflowError)

# A request's or a response's custom parameters (V2 "parameters"): names to scalars.
Parameters = dict[str, str | int | float | bool]
# The parameters of every record that has none: shared, so read and never changed. A record packs its
# parameters only when it has some, as a last element an older reader never sees.
NO_PARAMETERS: Parameters = {}
_SCALARS = (str, int, float, bool)


def _no_parameters() -> Parameters:
    return NO_PARAMETERS


def _parameters(raw: Any) -> Parameters:
    if type(raw) is not dict:
        raise TypeError("parameters must be a map")
    for name, value in raw.items():
        if type(name) is not str or type(value) not in _SCALARS:
            raise TypeError("parameters must map names to strings, numbers or booleans")
    return raw or NO_PARAMETERS


def _sequence(raw: Any) -> tuple[int | str, int]:
    correlation, flags = raw
    if type(correlation) not in (int, str) or type(flags) is not int or not 0 <= flags <= 3:
        raise TypeError("a sequence is [correlation ID, flags]")
    return correlation, flags


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
    parameters: Parameters = field(default_factory=_no_parameters)  # for the model (Python backend)
    request_id: str = ""         # the client's V2 "id", for the model (Python backend)
    sequence: tuple[int | str, int] | None = None  # (correlation ID, START|END flags): contract/sequence.py
    timed: bool = False          # its reply carries its batch's compute split (InferReply.split): a request
    #                              Triton's tracing traces, a step of an ensemble the gateway runs

    def pack(self) -> list[Any]:
        packed = [self.id, self.reply_to, self.deadline, [t.pack() for t in self.inputs],
                  list(self.outputs), self.priority, self.timeout_us, self.enqueued, self.trace]
        if self.timed:
            packed += [self.parameters, self.request_id,
                       None if self.sequence is None else list(self.sequence), True]
        elif self.sequence is not None:
            packed += [self.parameters, self.request_id, list(self.sequence)]
        elif self.request_id:
            packed += [self.parameters, self.request_id]
        elif self.parameters:
            packed.append(self.parameters)
        return packed

    @classmethod
    def unpack(cls, raw: Any) -> InferRequest:
        try:
            n = len(raw)  # 9; a newer gateway's may end with its parameters, request_id, sequence and timed
            head = raw if n == 9 else raw[:9]
            rid, reply_to, deadline, inputs, outputs, priority, timeout_us, enqueued, trace = head
            if type(rid) is not str or type(reply_to) is not str or type(trace) is not str:
                raise TypeError("id, reply_to and trace must be strings")
            for o in outputs:
                if type(o) is not str:
                    raise TypeError("output names must be strings")
            parameters, request_id, sequence, timed = NO_PARAMETERS, "", None, False
            if n > 9:
                if n > 13 or (n >= 11 and type(raw[10]) is not str) or (n == 13 and raw[12] is not True):
                    raise TypeError("a request record ends with its parameters, request_id, sequence, timed")
                parameters = _parameters(raw[9])
                request_id = raw[10] if n >= 11 else ""
                sequence = _sequence(raw[11]) if n >= 12 and (n == 12 or raw[11] is not None) else None
                timed = n == 13
            return cls(rid, reply_to, float(deadline), tuple([Tensor.unpack(t) for t in inputs]),
                       tuple(outputs), int(priority), int(timeout_us), float(enqueued), trace,
                       parameters, request_id, sequence, timed)
        except MALFORMED as exc:
            raise InvalidArgument(f"malformed request record: {exc}") from None


# An ensemble's step as the worker that ran the ensemble timed it (InferReply.steps): its model and version,
# when it was queued and answered (ns after the ensemble's request was enqueued, InferRequest.enqueued), its
# reply's queue_us and compute_us, and its compute's split (input, infer, output ns; all 0: none).
StepTimes = tuple[str, int, int, int, int, int, int, int, int]


def _step_times(raw: Any) -> StepTimes:
    model, version, *times = raw
    if type(model) is not str or len(times) != 7 or any(type(t) is not int for t in (version, *times)):
        raise TypeError("a step's times are [model, version, queued, answered, queue_us, compute_us, split]")
    return (model, version, *times)  # type: ignore[return-value]


@dataclass(slots=True)
class InferReply:
    """A worker's answer to one request: outputs, or an error code and message.

    A decoupled model answers a request with any number of responses: `index` counts them from 0 and
    `final` marks the last (which may carry no response at all: `empty`). Every other answer is one
    response, index 0, final."""

    id: str
    outputs: tuple[Tensor, ...] = ()
    error: tuple[Code, str] | None = None
    queue_us: int = 0
    compute_us: int = 0
    parameters: Parameters = field(default_factory=_no_parameters)  # the model's response parameters
    index: int = 0
    final: bool = True
    empty: bool = False  # a decoupled model's last word with no response in it (only the FINAL flag)
    # its batch's compute input, infer and output ns (an ensemble's: its steps' sums), for a request that
    # asks (InferRequest.timed) or made in the worker: Triton's COMPUTE_INPUT_END and _OUTPUT_START, and
    # an ensemble's statistics; None: not measured (then compute_us is all infer)
    split: tuple[int, int, int] | None = None
    # a timed request's to an ensemble a worker runs: each step's StepTimes (a traced request's child traces)
    steps: tuple[StepTimes, ...] = ()

    def pack(self) -> list[Any]:
        err = [self.error[0].value, self.error[1]] if self.error else None
        # (Tensor.pack, inline: every output of every reply)
        outputs = [[t.name, t.datatype, list(t.shape), t.data] for t in self.outputs]
        packed: list[Any] = [self.id, outputs, err, self.queue_us, self.compute_us]
        if self.steps:
            split = None if self.split is None else list(self.split)
            packed += [self.parameters, [self.index, self.final, self.empty], split,
                       [list(s) for s in self.steps]]
        elif self.split is not None:
            packed += [self.parameters, [self.index, self.final, self.empty], list(self.split)]
        elif self.index or not self.final or self.empty:
            packed += [self.parameters, [self.index, self.final, self.empty]]
        elif self.parameters:
            packed.append(self.parameters)
        return packed

    @classmethod
    def unpack(cls, raw: Any) -> InferReply:
        try:
            n = len(raw)  # 5; a newer worker's may end with the response's parameters, place, split and steps
            if n > 9:
                raise TypeError(f"a reply record has 5 to 9 elements, not {n}")
            rid, outputs, err, queue_us, compute_us = raw if n == 5 else raw[:5]
            if type(rid) is not str:
                raise TypeError("the id must be a string")
            error = (Code(err[0]), str(err[1])) if err else None
            parameters = _parameters(raw[5]) if n >= 6 else NO_PARAMETERS
            index, final, empty, split = 0, True, False, None
            steps = tuple(_step_times(s) for s in raw[8]) if n == 9 else ()
            if n >= 8 and raw[7] is not None:  # (None: not measured, beside a worker-run ensemble's steps)
                split = raw[7][0], raw[7][1], raw[7][2]
                if len(raw[7]) != 3 or any(type(ns) is not int for ns in split):
                    raise TypeError("a reply's split is [input ns, infer ns, output ns]")
            if n >= 7:
                index, final, empty = raw[6]
                if type(index) is not int or index < 0 or type(final) is not bool or type(empty) is not bool:
                    raise TypeError("a reply's place is [index, final, empty]")
            return cls(rid, tuple([Tensor.unpack(t) for t in outputs]), error, int(queue_us), int(compute_us),
                       parameters, index, final, empty, split, steps)
        except MALFORMED as exc:
            raise InvalidArgument(f"malformed reply record: {exc}") from None


# A gateway sends the requests of one tick that differ in nothing but their ids and data as one request:
# its id names them all, GROUPED then "id:rows" for each, comma-separated (a gateway's own ids are hex),
# its tensors hold their rows end to end. A worker runs it as one request of that many rows; every answer
# to it (an error included) goes back under that id, and the gateway cuts it into each one's answer.
GROUPED = "*"


def grouped_id(members: list[tuple[str, int]]) -> str:
    return GROUPED + ",".join([f"{rid}:{rows}" for rid, rows in members])


def members(rid: str) -> list[tuple[str, int]]:
    """The (id, rows) of the requests a grouped id names; InvalidArgument when it is malformed."""
    try:
        out = []
        for part in rid[1:].split(","):
            one, rows = part.rsplit(":", 1)
            out.append((one, int(rows)))
        return out
    except ValueError:
        raise InvalidArgument(f"malformed grouped request id {rid[:40]!r}") from None


def split(req: InferRequest) -> list[InferRequest]:
    """A grouped request as the requests it holds, each with its own rows of every input (and the group's
    deadline and outputs); any other request as itself. InvalidArgument when its id or rows do not add up."""
    if req.id[:1] != GROUPED:
        return [req]
    parts = members(req.id)
    total = sum(rows for _, rows in parts)
    if not total or any(not t.shape or t.shape[0] != total or len(t.data) % total for t in req.inputs):
        raise InvalidArgument(f"grouped request {req.id[:40]!r}: its inputs do not hold its members' rows")
    sizes = [len(t.data) // total for t in req.inputs]
    out, row = [], 0
    for rid, rows in parts:
        inputs = tuple(Tensor(t.name, t.datatype, (rows, *t.shape[1:]),
                              t.data[row * size:(row + rows) * size]) for t, size in zip(req.inputs, sizes))
        out.append(InferRequest(rid, req.reply_to, req.deadline, inputs, req.outputs, enqueued=req.enqueued))
        row += rows
    return out


def requests_in(rid: str) -> int:
    """How many requests an id answers for: 1, or the members of a grouped one."""
    return rid.count(",") + 1 if rid[:1] == GROUPED else 1


def encode(records: list[InferRequest] | list[InferReply]) -> bytes:
    return packb([r.pack() for r in records])


R = TypeVar("R", InferRequest, InferReply)


def fitting(records: list[R], payload: bytes, limit: int, alone: Callable[[R, int], list[bytes]]
            ) -> list[bytes]:
    """The messages of `records` (`payload`: encode(records)) at most `limit` bytes each (Redis's
    proto-max-bulk-len: a longer value closes the connection, failing every command sent on it): halves of
    them until each fits. One record over the limit alone is `alone`'s (with its size): it says what goes."""
    if len(payload) <= limit:
        return [payload]
    if len(records) > 1:
        half = len(records) // 2
        return [p for part in (records[:half], records[half:])
                for p in fitting(part, encode(part), limit, alone)]
    return alone(records[0], len(payload))


# One Packer kept, not one made per call as msgpack.packb does: 0.4 µs a call less, and a gateway and a
# worker pack several messages per batch. It holds the GIL throughout (no `default` hook calls back into
# Python), so threads cannot interleave in it, and it resets itself when packing fails. Its buffer keeps
# the largest size it packed: one that grew past KEPT_BYTES is let go.
KEPT_BYTES = 1 << 20
_packer = msgpack.Packer(use_bin_type=True)


def packb(obj: Any) -> bytes:
    """msgpack.packb(obj, use_bin_type=True), with a kept Packer."""
    global _packer
    out: bytes = _packer.pack(obj)
    if len(out) > KEPT_BYTES:
        _packer = msgpack.Packer(use_bin_type=True)
    return out


def _decode_list(payload: bytes) -> list[Any]:
    try:
        raw = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise InvalidArgument(f"undecodable message: {exc}") from None
    if not isinstance(raw, list):
        raise InvalidArgument("a stream entry must hold a list of records")
    return raw


def encode_ids(ids: list[str]) -> bytes:
    """Request ids as a stream entry carries them (keys.IN_HAND)."""
    return packb(ids)


def decode_ids(payload: bytes) -> list[str]:
    """encode_ids' ids; InvalidArgument when the payload is not a list of strings."""
    ids = _decode_list(payload)
    if not all(isinstance(i, str) for i in ids):
        raise InvalidArgument("a list of request ids must hold strings only")
    return ids


def decode_requests(payload: bytes) -> list[InferRequest]:
    return [InferRequest.unpack(r) for r in _decode_list(payload)]


def decode_replies(payload: bytes) -> list[InferReply]:
    return [InferReply.unpack(r) for r in _decode_list(payload)]
