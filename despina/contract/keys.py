"""Every Redis key Despina uses, in one place. Nobody spells a key anywhere else."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "despina"
GROUP = "workers"  # the consumer group on every request stream: replicas of a model share it
FIELD = b"m"  # the one field of every stream entry: a msgpack payload


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix, so that several deployments (or test runs) share a Redis."""

    prefix: str = DEFAULT_PREFIX

    def request_stream(self, model: str, version: int) -> str:
        return f"{self.prefix}:req:{model}:{version}"

    def reply_stream(self, gateway_id: str) -> str:
        return f"{self.prefix}:rep:{gateway_id}"

    @property
    def catalog(self) -> str:
        """Hash: model name -> catalog entry (JSON), written by the control plane."""
        return f"{self.prefix}:catalog"

    @property
    def events(self) -> str:
        """Pub/sub channel announcing catalog and worker changes, so readers refresh at once."""
        return f"{self.prefix}:events"

    @property
    def workers(self) -> str:
        """Set of worker ids; each one's liveness is its own key's TTL."""
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """Hash describing one worker (info, models and their states); expires without heartbeats."""
        return f"{self.prefix}:worker:{worker_id}"

    def stats(self, model: str, version: int) -> str:
        """Hash of cumulative statistics counters for one model version, all workers together."""
        return f"{self.prefix}:stats:{model}:{version}"

    def pattern(self) -> str:
        return f"{self.prefix}:*"
