"""Triton's response cache: a model with `response_cache { enable: true }` answers a request it has
answered before from memory, without running.

Two places keep answers, each process its own, bounded by DESPINA_RESPONSE_CACHE_BYTES: a gateway, for
the requests it takes (gateway/infer.py); a worker, for the requests its own ensembles and Python
models make of a model it runs (workers/runner.py: what Triton does for an ensemble's composing models).
An answer is kept under everything that decides it: the model, the version, which files answered it
(a gateway: the revision, ModelView.revision, and nothing kept while a rollout may answer from either
side; a worker: the runner that loaded them), the inputs (name, datatype, shape, bytes), the outputs
asked for and the request's parameters. The key is that tuple itself, so two requests share an answer
only when all of it is equal: unlike Triton's 64-bit hash, a collision cannot answer one request with
another's outputs. Only successful answers are kept, the least recently used going first past the
bound (Triton's `--cache-config local,size=`). Requests of a sequence (stateful models) are never
cached, as in Triton; decoupled models are refused at load.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from . import clock
from .contract.records import InferReply, Parameters, Tensor
from .summaries import Exported, LatencyWindow

ENTRY_BYTES = 400  # what an entry costs besides its tensors' bytes (the key's and the reply's objects)

Key = tuple[Any, ...]
LOADS = itertools.count(1)  # a worker's runners: each load of a model's files keys its answers apart


def cache_key(model: str, version: int, revision: str, inputs: list[Tensor] | tuple[Tensor, ...],
              outputs: tuple[str, ...], parameters: Parameters) -> Key:
    """What an answer depends on. Inputs in name order (a client may list them in any); parameters by
    name, type and value (a Python model may read them, and True, 1 and 1.0 are equal keys in Python)."""
    tensors = tuple(sorted((t.name, t.datatype, t.shape, bytes(t.data)) for t in inputs))
    return (model, version, revision, tensors, outputs,
            tuple(sorted((k, type(v).__name__, v) for k, v in parameters.items())) if parameters else ())


class ResponseCache:
    """A least-recently-used map from cache_key to the reply, bounded by bytes."""

    def __init__(self, max_bytes: int, summaries: bool = False) -> None:
        """`summaries`: keep its lookups' recent times by model version, for Triton's cache summaries."""
        self.max_bytes = max_bytes
        self.latencies: dict[tuple[str, int], LatencyWindow] | None = {} if summaries else None
        self.bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[Key, tuple[InferReply, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def figures(self) -> dict[str, Any]:
        """What the metrics show of it (despina_response_cache_*, and the cache summaries' quantiles)."""
        figures: dict[str, Any] = {"entries": len(self._entries), "bytes": self.bytes,
                                   "capacity_bytes": self.max_bytes, "evictions": self.evictions}
        if self.latencies is not None:
            latencies: dict[str, dict[str, Exported]] = {}
            for (model, version), window in self.latencies.items():
                latencies.setdefault(model, {})[str(version)] = window.export()
            figures["summaries"] = latencies
        return figures

    def took(self, key: Key, hit: bool, ns: int) -> None:
        """A lookup's time (and a miss's insert's), where summaries are kept."""
        assert self.latencies is not None
        window = self.latencies.get(key[:2])
        if window is None:
            window = self.latencies[key[:2]] = LatencyWindow()
        window.turn_if_due()
        window.add(window.cache_hit if hit else window.cache_miss, ns / 1000)

    def get(self, key: Key) -> InferReply | None:
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: Key, reply: InferReply) -> bool:
        """Keep the reply (its outputs and parameters); False when it alone is larger than the cache."""
        size = _entry_bytes(key, reply)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        # its own bytes: an output may be a view of the whole reply record it came in
        outputs = tuple(Tensor(t.name, t.datatype, t.shape, bytes(t.data)) for t in reply.outputs)
        kept = InferReply("", outputs, None, parameters=reply.parameters)
        self._entries[key] = (kept, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, gone) = self._entries.popitem(last=False)
            self.bytes -= gone
            self.evictions += 1
        return True


def _entry_bytes(key: Key, reply: InferReply) -> int:
    """What an entry weighs: its inputs' and outputs' bytes, and the parameters of the request (part of
    its key) and of the reply, whose strings may be of any length."""
    return (ENTRY_BYTES + sum(len(t[3]) for t in key[3]) + sum(len(t.data) for t in reply.outputs)
            + sum(len(name) + len(str(value)) for name, _, value in key[5])
            + sum(len(name) + len(str(value)) for name, value in reply.parameters.items()))


def through(cache: ResponseCache, key: Key, answer: Callable[[Any], object],
            count: Callable[[dict[str, int]], None], keeps: Callable[[Any], bool]
            ) -> Callable[[Any], None] | None:
    """A request's way through the cache: answered from it (then None), or the answer that also keeps
    the result where `keeps(result)` says so. `count` gets what to add to the model's statistics, as
    Triton counts: a hit is a success that ran nothing (cache_hit, the lookup's time, and queue; no
    inference or execution), a miss adds its lookup's and insert's time to cache_miss."""
    started = time.perf_counter_ns()
    hit = cache.get(key)
    if hit is not None:
        took = time.perf_counter_ns() - started
        count({"success_count": 1, "success_ns": took, "queue_count": 1, "cache_hit_count": 1,
               "cache_hit_ns": took, "last_inference": int(clock.now() * 1000)})
        if cache.latencies is not None:
            cache.took(key, True, took)
        answer(hit)
        return None
    lookup = time.perf_counter_ns() - started

    def keeping(result: Any) -> None:
        took = lookup
        if keeps(result):
            started = time.perf_counter_ns()
            cache.put(key, result)
            took += time.perf_counter_ns() - started
        count({"cache_miss_count": 1, "cache_miss_ns": took})
        if cache.latencies is not None:
            cache.took(key, False, took)
        answer(result)
    return keeping
