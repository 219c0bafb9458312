"""Grouped requests (records.GROUPED): the plain requests a gateway writes together for a model that
dynamic-batches them as the rows of one tensor go to its stream as one request, its id naming each
request and its rows, its tensors their rows end to end; the one answer is cut back into each one's.

Which models (group_rows), which requests and runs of them (group_key, grouped), stream entries of at
most ENTRY_REQUESTS requests (entries), and the answer cut apart (ungrouped). The worker needs nothing of
this: it runs a grouped request as one request of that many rows, and counts its members
(records.requests_in).
"""
from __future__ import annotations

import logging

from ..contract import records
from ..contract.ensemble import PLATFORM
from ..contract.errors import Code, DespinaError
from ..contract.keys import ENTRY_REQUESTS
from ..contract.modelspec import ModelSpec
from ..contract.records import NO_PARAMETERS, InferReply, InferRequest, Tensor

log = logging.getLogger("despina.gateway")

GROUPING_BACKENDS = frozenset({"onnxruntime", "pytorch", "tensorflow"})


def group_rows(spec: ModelSpec) -> int:
    """The most rows this gateway may send a model's plain requests in as one (records.GROUPED): for a
    model that dynamic-batches its requests as the rows of one tensor, its largest batch (its largest
    preferred one, so that batches form as they would); 0 for every other (one that sees each request:
    Python; states, streams, ensembles, ragged batches, a response cache, BYTES outputs). Worked out once
    per spec by infer.lane, which keeps it."""
    policy = spec.policy
    plain = (policy.batching and spec.backend in GROUPING_BACKENDS and spec.platform != PLATFORM
             and spec.sequence is None and not spec.decoupled and not spec.response_cache
             and not spec.batch_inputs and not spec.batch_outputs and not any(t.ragged for t in spec.inputs)
             and all(t.datatype != "BYTES" for t in spec.outputs))
    return (max(policy.preferred) if policy.preferred else spec.max_batch_size) if plain else 0


def group_key(req: InferRequest) -> tuple[object, ...] | None:
    """What requests must share to go as one: their outputs asked and their inputs' names, datatypes and
    shapes past the batch dimension. None: the request goes alone (it carries what the model sees of it,
    or BYTES, whose rows are not of one size)."""
    if req.parameters is not NO_PARAMETERS or req.sequence is not None or req.priority or req.timeout_us \
            or req.trace or req.request_id or not req.inputs:
        return None
    inputs = req.inputs
    if len(inputs) == 1:  # the usual case, without a list
        t = inputs[0]
        shape = t.shape
        if t.datatype == "BYTES" or not shape or not shape[0]:
            return None
        return req.outputs, t.name, t.datatype, shape[1:]
    rows = inputs[0].shape[0] if inputs[0].shape else 0
    key: list[object] = [req.outputs]
    for t in inputs:
        if t.datatype == "BYTES" or not t.shape or t.shape[0] != rows or not rows:
            return None
        key.append((t.name, t.datatype, t.shape[1:]))
    return tuple(key)


def grouped(batch: list[InferRequest], limit: int) -> list[InferRequest]:
    """The requests, each run of alike ones (at most ENTRY_REQUESTS of them, `limit` rows) as one."""
    out: list[InferRequest] = []
    run: list[InferRequest] = []
    key: tuple[object, ...] | None = None
    rows = 0
    for req in batch:
        k = group_key(req)
        n = req.inputs[0].shape[0] if k is not None else 0
        if run and (k != key or rows + n > limit or len(run) == ENTRY_REQUESTS):
            out.append(merged(run))
            run, rows = [], 0
        if k is None:
            out.append(req)
            continue
        key = k
        run.append(req)
        rows += n
    if run:
        out.append(merged(run))
    return out


def merged(run: list[InferRequest]) -> InferRequest:
    if len(run) == 1:
        return run[0]
    first = run[0]
    # lists, not generators, over the requests: a generator's every step is a call of its frame (five a
    # request here, in ungrouped and in grouped_id, where a small request makes 60-odd calls in all)
    members = [(r.id, r.inputs[0].shape[0]) for r in run]
    rows = sum([n for _, n in members])
    inputs = tuple(Tensor(t.name, t.datatype, (rows, *t.shape[1:]), b"".join([r.inputs[i].data for r in run]))
                   for i, t in enumerate(first.inputs))
    # timed when one is (an ensemble's step run from here, a traced request): the batch's split comes back
    # for all, and each reply carries it (ungrouped)
    return InferRequest(records.grouped_id(members), first.reply_to, min([r.deadline for r in run]), inputs,
                        first.outputs, enqueued=first.enqueued, timed=any([r.timed for r in run]))


def entries(requests: list[InferRequest]) -> list[list[InferRequest]]:
    """Stream entries of at most ENTRY_REQUESTS requests each, a grouped one counted as all it holds."""
    entries: list[list[InferRequest]] = [[]]
    held = 0
    for req in requests:
        n = records.requests_in(req.id)
        if entries[-1] and held + n > ENTRY_REQUESTS:
            entries.append([])
            held = 0
        entries[-1].append(req)
        held += n
    return entries


def ungrouped(reply: InferReply) -> tuple[InferReply, ...]:
    """A grouped request's answer cut into each of its requests': their rows of every output, or its
    error for each."""
    try:
        members = records.members(reply.id)
    except DespinaError as exc:
        log.error("dropping a reply with a malformed grouped id: %s", exc)
        return ()
    error = reply.error
    total = sum([rows for _, rows in members])
    if error is None:
        for t in reply.outputs:
            if not t.shape or t.shape[0] != total or len(t.data) % total:
                error = (Code.BACKEND, f"the model returned {t.name} with batch dimension "
                                       f"{t.shape[0] if t.shape else 'none'} for a batch of {total}")
                break
    if error is not None:
        return tuple(InferReply(rid, (), error) for rid, _ in members)
    cut = [(t.name, t.datatype, t.shape[1:], len(t.data) // total) for t in reply.outputs]
    queue_us, compute_us = reply.queue_us, reply.compute_us
    out = []
    row = 0
    if len(cut) == 1:  # the usual case: one output, one tensor each
        name, datatype, rest, size = cut[0]
        data = reply.outputs[0].data
        for rid, rows in members:
            tensor = Tensor(name, datatype, (rows, *rest), data[row * size:(row + rows) * size])
            out.append(InferReply(rid, (tensor,), None, queue_us, compute_us, NO_PARAMETERS))
            row += rows
    else:
        for rid, rows in members:
            tensors = [Tensor(name, datatype, (rows, *rest), t.data[row * size:(row + rows) * size])
                       for (name, datatype, rest, size), t in zip(cut, reply.outputs)]
            out.append(InferReply(rid, tuple(tensors), None, queue_us, compute_us, NO_PARAMETERS))
            row += rows
    if reply.split is not None:  # a timed group's: its batch's, each member's too
        for r in out:
            r.split = reply.split
    return tuple(out)
