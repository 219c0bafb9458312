"""Every Redis key Despina uses, in one place. Nobody spells a key anywhere else."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "despina"
GROUP = "workers"  # the consumer group on every request stream: replicas of a model share it
CONTROL_GROUP = "control"  # the consumer group on the control plane's command stream
FIELD = b"m"  # the field of every stream entry that holds its msgpack payload
# Requests per request-stream entry at most: gateways pack what arrives in one tick into entries of
# this size; workers, which read whole entries, size their reads by it.
ENTRY_REQUESTS = 16
ATTEMPTS = b"a"  # on a redelivered request entry: deliveries of it that ended with its worker's death
# On a gateway's request entry: the requests for that model version the gateway had queued and not yet
# seen answered when it wrote the entry, the entry's own included (workers/inflight.py)
IN_FLIGHT = b"n"
# The field of a gateway's reply-stream entry that a worker writes, instead of FIELD, once it finds Redis
# lost its data: the ids of that gateway's requests it still has in hand (records.encode_ids), whose answers
# will come (gateway/reply_reader.py keeps them waiting, and gives the rest up)
IN_HAND = b"h"
# On the events channel: a gateway found Redis lost its data; each worker looks for its own mark at once
DATA_LOST_EVENT = b"lost"


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix, so that several deployments (or test runs) share a Redis."""

    prefix: str = DEFAULT_PREFIX

    def request_stream(self, model: str, version: int, level: int = 1) -> str:
        """A model version's requests; with priority levels, one stream per level (1 = highest)."""
        base = f"{self.prefix}:req:{model}:{version}"
        return base if level <= 1 else f"{base}:p{level}"

    def queued(self, model: str, version: int, level: int = 1) -> str:
        """Counter of requests queued at one priority level (on its stream, or read and waiting for a
        batch; not those in a batch that started: workers/queued.py), kept where the model's queue policy
        sets max_queue_size: gateways refuse past it."""
        return f"{self.prefix}:queued:{model}:{version}:{level}"

    def dead_letters(self, model: str, version: int) -> str:
        """Stream of the requests given up after max_attempts deliveries (trimmed, MAXLEN ~)."""
        return f"{self.prefix}:dead:{model}:{version}"

    def reply_stream(self, gateway_id: str) -> str:
        return f"{self.prefix}:rep:{gateway_id}"

    @staticmethod
    def cancelled(reply_stream: str) -> str:
        """Set of the ids of a gateway's requests whose clients went away (a decoupled model's worker asks
        with each response); it expires with the gateway's replies. Named after the reply stream, which
        a worker knows from the request."""
        return f"{reply_stream}:cancelled"

    def gateway_mark(self, gateway_id: str) -> str:
        """String a gateway keeps while it runs (expiring with its replies): found missing, Redis lost the
        gateway's data (restarted without it, flushed, or failed over to a replica that had none), and the
        requests it waits on with it."""
        return f"{self.prefix}:mark:{gateway_id}"

    def worker_mark(self, worker_id: str) -> str:
        """String a worker keeps while it runs, renewed with its heartbeat (expiring after the gateways'
        replies would): found missing, Redis lost its data, and the worker tells the gateways of the
        requests it still holds (workers/in_hand.py). Its heartbeat hash would not do: it expires too when
        the worker only stalled."""
        return f"{self.prefix}:mark:worker:{worker_id}"

    def executing(self, worker_id: str) -> str:
        """Set of the redelivered entries a worker is running (each alone): should it die, only they
        are charged an attempt; and of the entries of levels with max_queue_size whose batch started, which
        a redelivery counts as queued again."""
        return f"{self.prefix}:executing:{worker_id}"

    @property
    def sagemaker_models(self) -> str:
        """Hash: a SageMaker multi-model endpoint's model name -> {"url": where SageMaker unpacked it}."""
        return f"{self.prefix}:sagemaker:models"

    def sagemaker_loading(self, name: str) -> str:
        """String, while a SageMaker load of `name` runs (it expires): one load of a name at a time."""
        return f"{self.prefix}:sagemaker:loading:{name}"

    def given_files(self, model: str) -> str:
        """Hash: `<digest>/<path>` -> the bytes of a file a load API call gave for `model` (its `file:`
        entries), kept while the model is loaded from them (registry/given.py)."""
        return f"{self.prefix}:given:{model}"

    @property
    def catalog(self) -> str:
        """Hash: model name -> catalog entry (JSON), written by the control plane."""
        return f"{self.prefix}:catalog"

    @property
    def catalog_generation(self) -> str:
        """String: a number the control plane increments in every transaction that changes the catalog, so
        that readers read the catalog again only when it moved; missing, they read it every time. Made
        afresh (a random start, not 1) where it is missing: a Redis that lost its data must not start again
        at a number a reader has seen. It expires unless the control plane that leads renews it."""
        return f"{self.prefix}:catalog:gen"

    @property
    def catalog_published(self) -> str:
        """String set by the control plane once it has read the repository, in the transaction that
        publishes the catalog: until then an empty catalog means "not read yet", and gateways are not
        ready."""
        return f"{self.prefix}:catalog:published"

    @property
    def events(self) -> str:
        """Pub/sub channel announcing catalog and worker changes, so readers refresh at once."""
        return f"{self.prefix}:events"

    @property
    def log_settings(self) -> str:
        """String: the log settings every process follows (Triton's logging extension, JSON), set through
        POST /v2/logging; its change is announced on the events channel as b"logging"."""
        return f"{self.prefix}:logging"

    @property
    def trace_settings(self) -> str:
        """String: the trace settings (Triton's trace extension, JSON {"global": ..., "models": {...}}), set
        through POST /v2[/models/{m}]/trace/setting; a change is announced on the events channel as
        b"trace"."""
        return f"{self.prefix}:trace"

    def trace_left(self, counter: str) -> str:
        """Integer: how many traces are left of a trace_count, the server's (all its gateways claim from
        it): `counter` names the settings it counts for and their arming (gateway/trace.py _counter)."""
        return f"{self.prefix}:trace:left:{counter}"

    @property
    def gateways(self) -> str:
        """Set of gateway ids that report their figures; each one's report expires (gateway())."""
        return f"{self.prefix}:gateways"

    def gateway(self, gateway_id: str) -> str:
        """Hash: a gateway's figures for the metrics, each field JSON: connections (its client connections:
        held, limit, refused) and, with a response cache, response_cache; expires unless renewed."""
        return f"{self.prefix}:gateway:{gateway_id}"

    @property
    def workers(self) -> str:
        """Set of worker ids; each one's liveness is its own key's TTL."""
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """Hash describing one worker (info, models and their states); expires without heartbeats."""
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def placed(self) -> str:
        """Set of the worker ids the control plane's last placement saw, written after the catalog it placed
        them in: a worker in it has its placements in the catalog (its readiness, workers/health.py)."""
        return f"{self.prefix}:placed"

    def stats(self, model: str, version: int) -> str:
        """Hash of cumulative statistics counters for one model version, all workers together."""
        return f"{self.prefix}:stats:{model}:{version}"

    def stats_base(self, model: str, version: int) -> str:
        """Copy of stats() taken when a load last made the version anew: the statistics API counts from it
        (Triton's start again at a load), the Prometheus metrics from nothing (Triton's go on)."""
        return f"{self.prefix}:stats0:{model}:{version}"

    @property
    def control_commands(self) -> str:
        """Stream of repository commands (index, load, unload, wake) for the control plane."""
        return f"{self.prefix}:control:cmd"

    def control_reply(self, command_id: str) -> str:
        """List holding the control plane's answer to one command that names no `reply` list (a gateway of
        an earlier version sends such); the caller BLPOPs it, it expires."""
        return f"{self.prefix}:control:reply:{command_id}"

    def control_answers(self, client_id: str) -> str:
        """List of the control plane's answers to one gateway's commands (each names it as its `reply`),
        each carrying its command's id; one reader of that gateway waits on it. It expires with the
        gateway's last answer."""
        return f"{self.prefix}:control:answers:{client_id}"

    @property
    def control_leader(self) -> str:
        """String: the id of the control plane that holds the lease; the others wait."""
        return f"{self.prefix}:control:leader"

    @property
    def cold_starts(self) -> str:
        """Hash: model name -> JSON of its cold starts (last and total milliseconds, count)."""
        return f"{self.prefix}:coldstart"

    def pattern(self) -> str:
        return f"{self.prefix}:*"
