"""How a model's requests are queued and batched: Triton's dynamic_batching settings as records.

Built from the model config by ModelSpec; consumed by the worker's batcher.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class QueuePolicy:
    timeout_action: str = "REJECT"          # or "DELAY"
    default_timeout_us: int = 0             # 0: no timeout
    allow_timeout_override: bool = False    # a request may shorten a default timeout, never lengthen it
    max_queue_size: int = 0                 # 0: unbounded

    def timeout_us(self, requested_us: int) -> int:
        """Triton's rule: with no default timeout (0) a request's own is ignored, override or not."""
        if self.allow_timeout_override and 0 < requested_us < self.default_timeout_us:
            return requested_us
        return self.default_timeout_us


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 0                 # 0: the model has no batch dimension; never batch
    preferred: tuple[int, ...] = ()         # empty: (max_batch_size,)
    max_queue_delay_us: int = 0
    dynamic: bool = False                   # False: each request runs alone
    priority_levels: int = 0                # 0: one level
    default_priority: int = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: dict[int, QueuePolicy] = field(default_factory=dict)
    preserve_ordering: bool = False         # replies go out in the order the requests were taken

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError("max_batch_size must be >= 0")
        if any(p <= 0 or p > self.max_batch_size for p in self.preferred):
            raise ValueError("preferred batch sizes must be within 1..max_batch_size")
        if self.max_queue_delay_us < 0:
            raise ValueError("max_queue_delay_us must be >= 0")
        if self.priority_levels and not 1 <= self.default_priority <= self.priority_levels:
            raise ValueError("default_priority_level must be within 1..priority_levels")

    @property
    def batching(self) -> bool:
        return self.dynamic and self.max_batch_size > 0

    @property
    def preferred_sizes(self) -> frozenset[int]:
        return frozenset(self.preferred or (self.max_batch_size,))

    def level(self, priority: int) -> int:
        """Triton's rule: 0, or a value past priority_levels, means the default level."""
        if not self.priority_levels:
            return 1
        if 1 <= priority <= self.priority_levels:
            return priority
        return self.default_priority

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_queue_policy)


def _queue_policy(raw: dict[str, Any] | None) -> QueuePolicy:
    raw = raw or {}
    return QueuePolicy(timeout_action=str(raw.get("timeout_action", "REJECT")),
                       default_timeout_us=int(raw.get("default_timeout_microseconds", 0)),
                       allow_timeout_override=bool(raw.get("allow_timeout_override", False)),
                       max_queue_size=int(raw.get("max_queue_size", 0)))


def batch_policy(config: dict[str, Any]) -> BatchPolicy:
    """Triton's JSON config -> BatchPolicy (no dynamic_batching: each request runs alone)."""
    mbs = int(config.get("max_batch_size", 0))
    db = config.get("dynamic_batching")
    if db is None:
        return BatchPolicy(max_batch_size=mbs)
    levels = int(db.get("priority_levels", 0))
    # as in Triton, without priority levels every request takes the default policy: a priority_queue_policy
    # for level 1 would otherwise apply to all of them
    per_level = (db.get("priority_queue_policy") or {}) if levels else {}
    return BatchPolicy(
        max_batch_size=mbs,
        preferred=tuple(sorted(int(s) for s in db.get("preferred_batch_size", []))),
        max_queue_delay_us=int(db.get("max_queue_delay_microseconds", 0)),
        dynamic=True,
        priority_levels=levels,
        default_priority=int(db.get("default_priority_level", 0)),
        default_queue_policy=_queue_policy(db.get("default_queue_policy")),
        priority_queue_policy={int(k): _queue_policy(v) for k, v in per_level.items()},
        preserve_ordering=bool(db.get("preserve_ordering", False)),
    )
