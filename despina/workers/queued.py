"""The queued counters of a model version's bounded priority levels (those whose queue policy sets
max_queue_size), as a worker keeps them: Triton's max_queue_size counts its scheduler's queue, and the batch
being executed is out of it. A gateway counts a request in as it queues it (gateway/request_writer.py); the
worker counts it out when its batch starts, or when it is answered without running (past its deadline, its
queue timeout). What a worker counts out goes with the next pipeline it sends (`QueueMoves.into`): the
replies of a batch before it, or its own write when none goes soon (runner.py).

An entry whose requests started is named in the worker's executing set (redelivery.marker) by the same
script that counts it out: should the worker die, the redelivery finds it there and counts its requests in
again as it puts them back on the stream (redelivery.py); those it finds unnamed were still counted."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..contract.keys import Keys
from ..contract.modelspec import ModelSpec
from ..contract.records import InferRequest
from ..resp import Batch
from .redelivery import EXECUTING_TTL_S, marker

if TYPE_CHECKING:
    from .intake import Pending

# KEYS[1]: a level's queued counter; KEYS[2]: the worker's executing set. ARGV[1]: requests answered that
# never started, off the counter; ARGV[2]: n, how many of the markers after it name entries whose requests
# started now: off the counter too, and into the set; the markers after those name started entries now
# answered: out of the set; ARGV's last: the set's time to live (s). Runs while Redis is full too (allow_oom:
# the counter exists, and shrinks): else Redis refused it, and the requests stayed counted for good, until
# the level refused every request as full on an empty queue.
QUEUE_MOVES = """
local n = tonumber(ARGV[2])
local off = tonumber(ARGV[1]) + n
if off ~= 0 then redis.call('DECRBY', KEYS[1], off) end
local function each(command, from, to)
  for i = from, to, 1000 do redis.call(command, KEYS[2], unpack(ARGV, i, math.min(i + 999, to))) end
end
if n > 0 then
  each('SADD', 3, 2 + n)
  redis.call('EXPIRE', KEYS[2], ARGV[#ARGV])
end
if #ARGV > 3 + n then each('SREM', 3 + n, #ARGV - 1) end
"""


def bounded_levels(spec: ModelSpec) -> set[int]:
    """The priority levels whose queue policy sets max_queue_size: gateways count what they queue there."""
    return {level for level in range(1, max(spec.policy.priority_levels, 1) + 1)
            if spec.policy.queue_policy(level).max_queue_size}


class QueueMoves:
    """What a runner has to tell its bounded levels' counters, waiting for the next pipeline it sends."""

    __slots__ = ("spec", "counters", "executing", "started", "unstarted", "finished")

    def __init__(self, keys: Keys, spec: ModelSpec, version: int, consumer: str) -> None:
        self.spec = spec
        self.counters = {level: keys.queued(spec.name, version, level) for level in bounded_levels(spec)}
        self.executing = keys.executing(consumer)
        self.started: dict[int, list[str]] = {}
        self.unstarted: dict[int, int] = {}
        self.finished: dict[int, list[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.started or self.unstarted or self.finished)

    def _level(self, request: InferRequest) -> int:
        """Its bounded level, or 0: made in this process (never counted), or of a level not bounded."""
        if not request.reply_to:
            return 0
        level = self.spec.policy.level(request.priority)
        return level if level in self.counters else 0

    def start(self, pendings: Iterable[Pending]) -> None:
        """A batch of these requests starts: out of the queue."""
        for p in pendings:
            if p.entry is not None and (level := self._level(p.request)):
                self.started.setdefault(level, []).append(marker(*p.entry))

    def answered(self, requests: Iterable[InferRequest], pendings: Iterable[Pending], started: bool) -> None:
        """These requests are answered: those that never `started` are out of the queue now; the entries of
        those that did leave the executing set."""
        if not started:
            for req in requests:
                if level := self._level(req):
                    self.unstarted[level] = self.unstarted.get(level, 0) + 1
            return
        for p in pendings:
            if p.entry is not None and (level := self._level(p.request)):
                self.finished.setdefault(level, []).append(marker(*p.entry))

    def into(self, pipe: Batch, script: str = QUEUE_MOVES) -> None:
        """Every move waiting into `pipe`, one `script` (QUEUE_MOVES as allow_oom made it) per level."""
        for level, counter in self.counters.items():  # (mostly one)
            started, unstarted, finished = self.started.get(level, ()), self.unstarted.get(level, 0), \
                self.finished.get(level, ())
            if started or unstarted or finished:
                pipe.eval(script, 2, counter, self.executing, unstarted, len(started), *started, *finished,
                          EXECUTING_TTL_S)
        self.started, self.unstarted, self.finished = {}, {}, {}
