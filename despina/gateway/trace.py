"""Triton's request tracing (the trace extension, `--trace-config`): one request in every `trace_rate` of a
model is traced at level TIMESTAMPS, `trace_count` of them at most (-1: no limit), and written to the server's
trace file (`--trace-file`, the setting trace_file) in Triton's form, a JSON array of

    {"id": N, "model_name": ..., "model_version": V, "request_id": ...,
     "timestamps": [{"name": ..., "ns": ...}, ...]}

with Triton 2.51's timestamps, on the wall clock: HTTP_RECV_START and HTTP_RECV_END (the request's message
began, its body was whole: the gateway's HTTP protocol, protocol.py), REQUEST_START (the gateway has the
request), QUEUE_START (it goes to the model's stream), COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START
and COMPUTE_END (the batch that ran it, as the worker timed it, from QUEUE_START: a traced request's record
says so, and its reply carries the batch's input, infer and output times), INFER_RESPONSE_COMPLETE (the answer
is back), HTTP_SEND_START and HTTP_SEND_END (around its writing) and REQUEST_END (answered). (A request the
ASGI stack serves, an escaped path say, has no HTTP stamps.) An ensemble the gateway runs (ensemble.py) has no
compute of its own, and each step a trace of its own with "parent_id" (Triton's child traces: taken with their
parent, neither sampled nor counted); of an ensemble a worker runs, the worker times each step and its reply
carries those times, from which the gateway writes the child traces (Tracer._steps). Triton writes each stamp
as an entry of its own ({"id", "timestamps": [one]} after {"id", "model_name", ...}); Despina one entry per
trace, which Triton's tools read the same, as they merge the entries of an id. With `log_frequency` N a
gateway writes each N traces (an ensemble's with its steps' child traces, before it, as one) to
`${trace_file}.0`, `.1`, ...; with 0, all it collected to `${trace_file}` when
its settings change and when it stops; and, as Triton's, those to the next part once the last trace that
trace_count allows is done. Each gateway traces and writes its own requests (one in trace_rate of those it
has); of `serve --gateways N` gateway i writes `${trace_file}-i` (and `-i.0`, ...). trace_count is the
server's, as one Triton's: each trace is claimed from a count in Redis that all the gateways share
(Keys.trace_left), once for all the models on the global settings, and apart for each model with settings of
its own.

The settings (trace_settings.py) are the deployment's: global ones and each model's own, kept in Redis
(Keys.trace_settings) and announced on the events channel, as the log settings are. A model's own settings
override the global ones, which it follows for the rest as they change; a null clears one (a global one: back
to its default). trace_file is the server's alone, set at start: as Triton's, the API refuses to change it
(else whoever reaches the API could overwrite any file the server may write). At level TENSORS a trace has an
entry {"id", "activity": "TENSOR_QUEUE_INPUT" or "TENSOR_BACKEND_OUTPUT", "tensor": tensor_entry(...)} for
each input and output, as Triton's (not the steps of an ensemble a worker runs: their tensors stay in the
worker); with TENSORS alone, no timestamps entry. trace_mode opentelemetry is refused: not supported.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ..contract.datatypes import deserialize_bytes
from ..contract.records import InferReply, Tensor
from .trace_settings import effective, problem

log = logging.getLogger("despina.gateway")

EVENT = b"trace"  # on the events channel: the trace settings changed
KEPT_MAX = 100_000  # traces a gateway keeps for a log_frequency of 0; past it they are counted, not kept


@dataclass
class _Sampling:
    """One model's settings (or the global ones) as this gateway follows them, and their counts."""

    on: bool
    rate: int
    left: int  # traces still to take, as far as this gateway knows; -1: no limit
    counter: str = ""  # the server's count it claims each trace from (Keys.trace_left); '': none
    first: int = 0  # what that count starts at (the first claim sets it)
    seen: int = 0
    open: int = 0  # traces taken and not yet done
    timestamps: bool = True  # its levels: TIMESTAMPS, TENSORS (the tensors' contents)
    tensors: bool = False


@dataclass
class Trace:
    """One traced request's timestamps; `parent` the id of the ensemble's trace whose step it is (0: none)."""

    id: int
    model: str
    version: int
    request_id: str
    of: _Sampling
    parent: int = 0
    claim: asyncio.Future[bool] | None = None  # its claim on the server's trace_count: whether it is kept
    queued: int = 0  # QUEUE_START: the worker's queue time counts from there
    stamps: list[tuple[str, int]] = field(default_factory=list)
    tensors: list[tuple[str, Tensor]] = field(default_factory=list)  # (activity, tensor): level TENSORS
    settled: bool = False  # Tracer._settled took it: a step's trace opened later goes alone

    def inputs(self, tensors: Sequence[Tensor]) -> None:
        """TENSOR_QUEUE_INPUT of each input, at level TENSORS."""
        if self.of.tensors:
            self.tensors += [("TENSOR_QUEUE_INPUT", t) for t in tensors]

    def stamp(self, name: str, ns: int | None = None) -> None:
        self.stamps.append((name, time.time_ns() if ns is None else ns))

    def queue(self) -> None:
        """QUEUE_START: it goes to the model's stream now (or its ensemble's steps begin)."""
        self.queued = time.time_ns()
        self.stamps.append(("QUEUE_START", self.queued))

    def over_http(self, ex: Any) -> None:
        """HTTP_RECV_START and _END of the exchange it came in, when the gateway's HTTP protocol took them
        (protocol.TracedHotRequest, which then stamps HTTP_SEND_START and _END as it answers)."""
        began = getattr(ex, "began", 0)
        if began:
            self.stamps += [("HTTP_RECV_START", began), ("HTTP_RECV_END", ex.received)]
            ex.traced = self

    def ended(self, result: Any, computes: bool, ns: int | None = None) -> None:
        """COMPUTE_START, _INPUT_END, _OUTPUT_START and _END of the batch that ran it (from its reply: its
        worker measures the split for a traced request), its outputs at level TENSORS, and REQUEST_END (now,
        or at `ns`)."""
        if self.of.tensors and isinstance(result, InferReply):
            self.tensors += [("TENSOR_BACKEND_OUTPUT", t) for t in result.outputs]
        if computes and isinstance(result, InferReply) and result.compute_us and self.queued:
            start = self.queued + result.queue_us * 1000
            split = result.split
            if split is None:
                self.stamps += [("COMPUTE_START", start), ("COMPUTE_END", start + result.compute_us * 1000)]
            else:
                inputs = start + split[0]
                self.stamps += [("COMPUTE_START", start), ("COMPUTE_INPUT_END", inputs),
                                ("COMPUTE_OUTPUT_START", inputs + split[1]),
                                ("COMPUTE_END", inputs + split[1] + split[2])]
        self.stamp("REQUEST_END", ns)


class Tracer:
    """This gateway's tracing: which requests, and the traces, to `trace_file` (the server's; '': none)."""

    def __init__(self, trace_file: str, index: int | None = None) -> None:
        self.on = False  # any model traced: the hot path looks at this alone
        self.file = trace_file
        self._doc: dict[str, Any] = {}
        self._sampling: dict[str | None, _Sampling] = {}  # None: the global settings' models
        self._ids = itertools.count(1)
        self._kept: list[list[dict[str, Any]]] = []  # traces not yet written, each its entries
        # an ensemble's trace id, until it ends -> its steps' child traces' entries, to go with it
        self._children: dict[int, list[dict[str, Any]]] = {}
        self._parts = 0  # the next ${trace_file}.N: it goes on as the settings change (as Triton's)
        self._dropped = 0
        self._suffix = f"-{index}" if index is not None else ""
        # claims one of a server's trace_count (counter, what it starts at) -> what is left after, -1: none
        # was (trace_api sets it: the count in Redis); None: each gateway counts its own
        self.claimer: Callable[[str, int], Awaitable[int]] | None = None
        self._claims: set[asyncio.Future[bool]] = set()

    def settings(self, model: str | None = None) -> dict[str, Any]:
        """The settings that apply (to a model, or the global ones)."""
        return effective(self._doc, model, self.file)

    def follow(self, doc: dict[str, Any]) -> None:
        """New settings (global and per model): what was kept under the old ones is written first. The same
        settings again (the event of this gateway's own change) change nothing: the counts go on. As
        Triton's, a trace_count that did not change goes on from what is left of it (a model given settings
        of its own, from what the global ones left)."""
        if doc == self._doc:
            return
        sampled: dict[str | None, _Sampling] = {}
        for key in [None, *doc.get("models", {})]:
            s = effective(doc, key, self.file)
            levels = s["trace_level"]
            sampling = sampled[key] = _Sampling(levels != ["OFF"] and not problem(s), int(s["trace_rate"]),
                                                int(s["trace_count"]), timestamps="TIMESTAMPS" in levels,
                                                tensors="TENSORS" in levels)
            was = key if key in self._doc.get("models", {}) else None
            if was in self._sampling and self.settings(was)["trace_count"] == s["trace_count"] \
                    and _armed(doc, key) == _armed(self._doc, key):
                sampling.left = self._sampling[was].left
            if sampling.left > 0:
                sampling.counter, sampling.first = _counter(doc, key, s["trace_count"]), sampling.left
        self.flush()
        self._doc, self._sampling = doc, sampled
        self.on = any(s.on for s in sampled.values())

    def _of(self, model: str) -> _Sampling:
        # as Triton's: the models on the global settings sample and count together, on the global ones
        return self._sampling[model if model in self._doc.get("models", {}) else None]

    def shown(self, doc: dict[str, Any], model: str | None) -> dict[str, Any]:
        """The settings `doc` gives a model (or the global ones), as Triton's GET answers them: trace_count
        what is left of it as this gateway knows (when it follows these settings; trace_api answers the
        server's count)."""
        settings = effective(doc, model, self.file)
        sampling = self._sampling.get(model if model in doc.get("models", {}) else None)
        if doc == self._doc and sampling is not None:
            settings["trace_count"] = str(sampling.left)
        return settings

    def counter(self, doc: dict[str, Any], model: str | None) -> str:
        """The server's count the settings `doc` gives a model (or the global ones) claim from, when this
        gateway follows them and their trace_count is limited; else ''."""
        sampling = self._sampling.get(model if model in doc.get("models", {}) else None)
        return sampling.counter if doc == self._doc and sampling is not None else ""

    def begin(self, model: str, version: int, request_id: str, started_ns: int) -> Trace | None:
        """A trace of this request (REQUEST_START when it arrived), when it is one to trace, else None."""
        sampling = self._of(model)
        if not sampling.on or sampling.left == 0:
            return None
        sampling.seen += 1
        if sampling.seen % sampling.rate:  # the rate-th, the 2 x rate-th... as Triton's SampleTrace
            return None
        sampling.open += 1
        trace = Trace(next(self._ids), model, version, request_id, sampling)
        if sampling.left > 0:
            sampling.left -= 1
            if self.claimer is not None:  # the count is the server's: claimed while the request runs
                trace.claim = asyncio.ensure_future(self._claim(sampling))
                self._claims.add(trace.claim)
                trace.claim.add_done_callback(self._claims.discard)
        trace.stamp("REQUEST_START", started_ns)
        return trace

    async def _claim(self, sampling: _Sampling) -> bool:
        """Take one of the server's trace_count (its gateways share it, as Triton's one server counts);
        False: none was left, the trace is dropped, and this gateway takes no more."""
        assert self.claimer is not None
        try:
            left = await self.claimer(sampling.counter, sampling.first)
        except Exception as exc:  # (Redis out of reach) this gateway's own count decides meanwhile
            log.debug("trace: claiming one of trace_count failed (%s)", exc)
            return True
        sampling.left = max(min(sampling.left, left), 0)
        return left >= 0

    async def settle(self) -> None:
        """Wait for the claims under way (before Redis goes: then flush), a Redis out of reach a while."""
        if self._claims:
            await asyncio.wait(self._claims, timeout=SETTLE_S)

    def child(self, parent: Trace, model: str, version: int) -> Trace:
        """The trace of an ensemble's step, as Triton's: a trace of its own (REQUEST_START now), with its
        parent's id and request_id, taken whenever its parent is (neither sampled nor counted)."""
        parent.of.open += 1
        if not parent.settled:
            self._children.setdefault(parent.id, [])
        trace = Trace(next(self._ids), model, version, parent.request_id, parent.of, parent.id, parent.claim)
        trace.stamp("REQUEST_START")
        return trace

    def ending(self, trace: Trace, done: Callable[[Any], None], computes: bool = True
               ) -> Callable[[Any], None]:
        """`done` that records the request's end (and its batch's compute, from a reply). A request's
        answer is INFER_RESPONSE_COMPLETE as it comes, its REQUEST_END once answered; an ensemble step's
        request ends as its answer comes, before its ensemble goes on. `computes` False: an ensemble, whose
        trace, as Triton's, has no compute of its own (its steps compute; its reply's compute is theirs,
        summed, no span of time)."""
        if trace.parent:
            def step_end(result: Any) -> None:
                trace.ended(result, computes)
                self._steps(trace, result)
                self._finished(trace)
                done(result)
            return step_end

        def end(result: Any) -> None:
            trace.stamp("INFER_RESPONSE_COMPLETE")
            try:
                done(result)
            finally:
                trace.ended(result, computes)
                self._steps(trace, result)
                self._finished(trace)
        return end

    def _steps(self, parent: Trace, result: Any) -> None:
        """The child traces of an ensemble a worker ran, from the steps' times its reply carries (timed from
        the request's enqueueing, its QUEUE_START here), written before their parent's, as Triton's."""
        if not isinstance(result, InferReply) or not result.steps:
            return
        self._children.setdefault(parent.id, [])
        for model, version, queued, answered, queue_us, compute_us, *split in result.steps:
            parent.of.open += 1
            child = Trace(next(self._ids), model, version, parent.request_id, parent.of, parent.id,
                          parent.claim)
            start = parent.queued + queued
            child.stamps += [("REQUEST_START", start), ("QUEUE_START", start)]
            child.queued = start
            child.ended(InferReply("", queue_us=queue_us, compute_us=compute_us,
                                   split=(split[0], split[1], split[2]) if any(split) else None),
                        True, parent.queued + answered)
            self._finished(child)

    def _finished(self, trace: Trace) -> None:
        record: list[dict[str, Any]] = []
        if trace.of.timestamps:  # (level TENSORS alone: the tensors' entries alone, as Triton's)
            head: dict[str, Any] = {"id": trace.id, "model_name": trace.model, "model_version": trace.version}
            if trace.request_id:
                head["request_id"] = trace.request_id
            if trace.parent:
                head["parent_id"] = trace.parent
            head["timestamps"] = [{"name": n, "ns": ns} for n, ns in sorted(trace.stamps, key=lambda s: s[1])]
            record.append(head)
        record += [{"id": trace.id, "activity": activity, "tensor": tensor_entry(t)}
                   for activity, t in trace.tensors]
        claim = trace.claim
        if claim is None or claim.done():
            if claim is not None and trace.id in self._children:
                # its steps' traces wait for the claim's callbacks, which may not have run yet: after them
                asyncio.get_running_loop().call_soon(self._settled, trace, record)
            else:
                self._settled(trace, record)
        else:  # (its claim is usually back long before it is answered)
            claim.add_done_callback(lambda _: self._settled(trace, record))

    def _settled(self, trace: Trace, record: list[dict[str, Any]]) -> None:
        """Keep a finished trace whose claim was granted (or that needed none)."""
        trace.of.open -= 1
        trace.settled = True
        claim = trace.claim
        kept = claim is None or claim.cancelled() or claim.result()
        # as Triton's, a request's trace is one with its steps' child traces (which end first, and share
        # its claim): they go with it, before it, to the same part, and log_frequency counts them as one
        # (a step that outlives its ensemble, one answering after another step failed, goes alone)
        record = self._children.pop(trace.id, []) + record
        if trace.parent and (held := self._children.get(trace.parent)) is not None:
            if kept:
                held.extend(record)
            return
        frequency = int(self.settings(trace.model)["log_frequency"])
        if kept and not frequency and len(self._kept) >= KEPT_MAX:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("trace: %d traces kept for %s already (log_frequency 0); further ones are "
                            "dropped until the settings change or the gateway stops", KEPT_MAX, self.file)
            return
        if kept:
            self._kept.append(record)
        # as Triton's: each log_frequency traces, and the last that trace_count allows, to the next part
        if (frequency and len(self._kept) >= frequency) or (trace.of.left == 0 and not trace.of.open
                                                             and (kept or self._kept)):
            self._parts += 1
            self._write(f".{self._parts - 1}")

    def flush(self) -> None:
        """Write what is kept (log_frequency 0: every trace since the last write) to ${trace_file}."""
        if self._kept:
            self._write("")
        self._dropped = 0

    def _write(self, part: str) -> None:
        records, self._kept = [entry for kept in self._kept for entry in kept], []
        path = Path(f"{self.file}{self._suffix}{part}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            partial.write_bytes(orjson.dumps(records))
            os.replace(partial, path)
        except OSError as exc:
            log.error("trace: writing %d traces to %s failed: %s", len(records), path, exc)


def tensor_entry(t: Tensor) -> dict[str, str]:
    """A tensor as Triton's level TENSORS writes it: its elements comma-separated as C++ streams them (a
    float's 6 significant digits, a BOOL 1 or 0, a BYTES element in double quotes), its shape too. (Triton
    2.51 writes an FP16 tensor's data as "": Despina writes its values.)"""
    try:
        if t.datatype == "BYTES":
            data = ",".join(f'"{b.decode("utf-8", "replace")}"' for b in deserialize_bytes(t.data))
        elif t.datatype in ("FP16", "FP32", "FP64"):
            data = ",".join([format(v, "g") for v in t.numpy().ravel().tolist()])
        else:  # integers, and BOOL as 1 and 0
            data = ",".join([str(int(v)) for v in t.numpy().ravel().tolist()])
    except Exception:  # (BF16, which Despina has no numpy type for, say)
        data = ""
    return {"name": t.name, "data": data, "shape": ",".join(map(str, t.shape)), "dtype": t.datatype}


def _counter(doc: dict[str, Any], model: str | None, count: str) -> str:
    """The name of the server's count of a model's settings (None: the global ones): a POST naming
    trace_count arms a new one."""
    armed = _armed(doc, model)
    return f"{armed[0]}.{armed[1]}.{count}:{model or ''}"


CLAIM = """local left = redis.call('GET', KEYS[1])
if not left then left = ARGV[1] end
left = tonumber(left)
if left <= 0 then return -1 end
redis.call('SET', KEYS[1], left - 1, 'EX', ARGV[2])
return left - 1"""  # Tracer._claim: one of the count, which starts at ARGV[1]; kept ARGV[2] s from the last
COUNT_KEPT_S = 7 * 86400
SETTLE_S = 2.0  # the longest a stopping gateway waits for its traces' claims


def _armed(doc: dict[str, Any], model: str | None) -> tuple[int, int]:
    """How many times a POST named trace_count, globally and for `model` (trace_api.changed): a change
    starts the count again, even at the value it had."""
    armed = doc.get("armed", {})
    if model is None:
        return armed.get("", 0), 0
    if "trace_count" in doc.get("models", {}).get(model, {}):  # its own count: the global one's POSTs not
        return 0, armed.get(model, 0)
    return armed.get("", 0), armed.get(model, 0)
