"""Prometheus metrics with Triton's names, for the whole deployment, rendered from Redis.

Workers count into one statistics hash per model version (workers/stats.py); gateways count what
they enqueue and refuse. Rendering those hashes gives Triton's `nv_inference_*` families summed over
every process on every host, the same numbers the statistics API answers. Host metrics (CPU,
memory) describe the machine of the process serving /metrics; GPU metrics (through NVML) describe its
GPUs and those every live worker reports with its heartbeat (both read by host_metrics.py).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import msgpack
import orjson
import redis.asyncio as aioredis

from . import cache_metrics, custom_metrics, summaries
from .contract.catalog import CatalogEntry
from .contract.keys import Keys
from .contract.policy import batch_policy
from .host_metrics import HostMetrics, Sample
from .workers.stats import COLD_START_BUCKETS_S, LATENCY_BUCKETS_US

# Triton's counters: name, help (Triton 2.51's, word for word), statistics field, scale from its unit
COUNTS = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     "success_count", 1),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     "inference_count", 1),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     "execution_count", 1),
)
# and its latency counters, which --metrics-config counter_latencies=false leaves out
LATENCY_COUNTERS = (
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds "
     "(includes cached requests)", "success_ns", 1e-3),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds "
     "(includes cached requests)", "queue_ns", 1e-3),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds "
     "(does not include cached requests)", "compute_input_ns", 1e-3),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds "
     "(does not include cached requests)", "compute_infer_ns", 1e-3),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in "
     "microseconds (does not include cached requests)", "compute_output_ns", 1e-3),
)
# the response cache (response_cache.py), as Triton shows it: only for the versions whose config enables it
# (counter_latencies=false leaves these out too, the counts with the durations, as Triton 2.51 does)
CACHE_COUNTERS_PER_MODEL = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", "cache_hit_count", 1),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     "cache_hit_ns", 1e-3),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", "cache_miss_count", 1),
    ("nv_cache_miss_duration_per_model", "Total cache miss (insert+lookup) duration per model, in "
     "microseconds", "cache_miss_ns", 1e-3),
)
# Triton's latency summaries (--metrics-config summary_latencies=true): name, help (Triton 2.51's), the
# statistics fields of its count and sum, the quantity of the workers' windows (summaries.py)
SUMMARIES = (
    ("nv_inference_request_summary_us", "Summary of inference request duration in microseconds (includes "
     "cached requests)", "success", "request"),
    ("nv_inference_queue_summary_us", "Summary of inference queuing duration in microseconds (includes "
     "cached requests)", "queue", "queue"),
    ("nv_inference_compute_input_summary_us", "Cumulative compute input duration in microseconds (does not "
     "include cached requests)", "compute_input", "compute_input"),
    ("nv_inference_compute_infer_summary_us", "Cumulative compute inference duration in microseconds (does "
     "not include cached requests)", "compute_infer", "compute_infer"),
    ("nv_inference_compute_output_summary_us", "Cumulative inference compute output duration in "
     "microseconds (does not include cached requests)", "compute_output", "compute_output"),
)
# and of the response cache, for the versions whose config enables it
CACHE_SUMMARIES = (
    ("nv_cache_hit_summary_per_model", "Summary of cache hit counts/durations per model, in microseconds.",
     "cache_hit", "cache_hit"),
    ("nv_cache_miss_summary_per_model", "Summary of cache miss counts/durations per model, in microseconds.",
     "cache_miss", "cache_miss"),
)
REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


class Exposition:
    """Prometheus text format, written family by family."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: set[str] = set()  # the families written

    def family(self, name: str, kind: str, help_: str) -> None:
        self.names.add(name)
        self.lines += [f"# HELP {name} {_escape_help(help_)}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        number = _number(value)
        self.lines.append(f"{name}{{{text}}} {number}" if text else f"{name} {number}")

    def text(self) -> bytes:
        return ("\n".join(self.lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample's value as the text format writes it: an integer's digits, else Python's shortest form;
    NaN and infinities (a model's gauge may hold them) as Prometheus spells them."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{int(value)}" if value == int(value) else repr(float(value))


async def collect(redis: aioredis.Redis, keys: Keys) -> dict[str, Any]:
    """One consistent read of what the metrics need: catalog, statistics, backlogs, workers (and, for the
    status page, the catalog's entries and the live workers' heartbeat hashes as read)."""
    raw = cast(dict[bytes, bytes], await redis.hgetall(keys.catalog))
    catalog = {k.decode(): CatalogEntry.loads(v) for k, v in raw.items()}
    targets: list[tuple[str, int, list[str]]] = []
    for name, entry in sorted(catalog.items()):
        levels = max(batch_policy(entry.config).priority_levels, 1) if entry.config else 1
        for version in entry.versions:
            streams = [keys.request_stream(name, version, level) for level in range(1, levels + 1)]
            targets.append((name, version, streams))
    pipe = redis.pipeline(transaction=False)
    for name, version, streams in targets:
        pipe.hgetall(keys.stats(name, version))
        for stream in streams:
            pipe.xlen(stream)
    pipe.smembers(keys.workers)
    pipe.smembers(keys.gateways)
    results = await pipe.execute()
    gateways = results.pop()
    workers = sorted(results.pop())
    pipe = redis.pipeline(transaction=False)
    for wid in workers:
        pipe.hgetall(keys.worker(wid.decode()))
    for gid in gateways:
        pipe.hmget(keys.gateway(gid.decode()), "response_cache", "connections", "summaries")
    got = await pipe.execute() if workers or gateways else []
    hashes, reports = got[:len(workers)], got[len(workers):]
    # a worker's hash is there while its heartbeat has not expired
    heartbeats = {wid.decode(): h for wid, h in zip(workers, hashes) if h}
    cache = {wid: orjson.loads(h[b"cache"]) for wid, h in heartbeats.items() if h.get(b"cache")}
    gpus = [reading for h in heartbeats.values() if h.get(b"gpus") for reading in orjson.loads(h[b"gpus"])]
    # response caches: each worker's (its heartbeat) and each gateway's (its report, gone when it is)
    responses = {wid: orjson.loads(h[b"response_cache"]) for wid, h in heartbeats.items()
                 if h.get(b"response_cache")}
    reported = {f"gateway:{gid.decode()}": r for gid, r in zip(gateways, reports)}
    responses.update({p: orjson.loads(r[0]) for p, r in reported.items() if r[0]})
    clients = {p: orjson.loads(r[1]) for p, r in reported.items() if r[1]}  # each gateway's connections
    stale = [gid for gid, r in zip(gateways, reports) if r == [None, None, None]]
    if stale:
        await redis.srem(keys.gateways, *stale)
    executing: dict[tuple[str, str], int] = {}  # requests in batches executing now, over every worker
    for h in heartbeats.values():
        for name, versions in (orjson.loads(h[b"executing"]) if h.get(b"executing") else {}).items():
            for version, n in versions.items():
                executing[name, version] = executing.get((name, version), 0) + n
    models = []
    cursor = 0
    for name, version, streams in targets:
        stats = {k.decode(): int(v) for k, v in results[cursor].items()}
        backlog = results[cursor + 1: cursor + 1 + len(streams)]
        cursor += 1 + len(streams)
        config = catalog[name].config or {}
        models.append({"model": name, "version": str(version), "stats": stats, "backlog": backlog,
                       "executing": executing.get((name, str(version)), 0),
                       "cached": bool(config.get("response_cache", {}).get("enable", False))})
    # the metrics Python models made themselves, as each worker reports those of the versions it serves
    custom = [msgpack.unpackb(h[b"custom_metrics"]) for _, h in sorted(heartbeats.items())
              if h.get(b"custom_metrics")]
    # each worker's recent latencies by model and version, where summaries are on (summaries.py)
    latencies = [msgpack.unpackb(h[b"summaries"]) for _, h in sorted(heartbeats.items())
                 if h.get(b"summaries")]
    latencies += [f["summaries"] for _, f in sorted(responses.items()) if f.get("summaries")]
    latencies += [orjson.loads(r[2]) for _, r in sorted(reported.items()) if r[2]]  # gateways' ensembles
    return {"models": models, "workers_alive": len(heartbeats), "cache": cache, "gpus": gpus,
            "custom": custom, "summaries": latencies,
            "response_cache": {p: f for p, f in responses.items() if f}, "clients": clients,
            "catalog": catalog, "heartbeats": heartbeats}  # as read, for the status page


# the artifact cache (models fetched from S3) of each worker and of the control plane, counted since
# that process started; `process` is the worker's id, or "control"
CACHE_COUNTERS = (
    ("despina_artifact_cache_downloads", "downloads", "Files a process fetched into its artifact cache"),
    ("despina_artifact_cache_downloaded_bytes", "downloaded_bytes", "Bytes a process fetched into its cache"),
    ("despina_artifact_cache_reused", "reused", "Files a process found in its artifact cache"),
    ("despina_artifact_cache_evicted_bytes", "evicted_bytes",
     "Bytes a process's cache trims removed (model folders used least recently, past the cache limit)"),
)


# each process's response cache (DESPINA_RESPONSE_CACHE_BYTES): `process` is "gateway:<id>" or a worker's id
RESPONSE_CACHE = (
    ("despina_response_cache_entries", "gauge", "entries", "Answers a process's response cache holds"),
    ("despina_response_cache_bytes", "gauge", "bytes", "Bytes a process's response cache holds"),
    ("despina_response_cache_capacity_bytes", "gauge", "capacity_bytes",
     "The bound of a process's response cache, in bytes"),
    ("despina_response_cache_evictions_total", "counter", "evictions",
     "Answers a process's response cache let go for room (least recently used first)"),
)


# each gateway's client connections (gateway/connection.py's Clients): `process` is "gateway:<id>"
CLIENTS = (
    ("despina_gateway_connections", "gauge", "held", "Client connections a gateway holds"),
    ("despina_gateway_connection_limit", "gauge", "limit", "The client connections a gateway holds at most "
     "(DESPINA_MAX_CONNECTIONS, or its open-files limit less what it keeps for Redis)"),
    ("despina_gateway_connections_refused_total", "counter", "refused",
     "Client connections a gateway answered 503 and closed, past its connection limit"),
)


def render(data: dict[str, Any], host: Iterable[Sample] = (), quantiles: tuple[float, ...] | None = None,
           latency_counters: bool = True) -> bytes:
    """`quantiles`: those of Triton's latency summaries, None when they are off; `latency_counters`: False
    leaves out the latency counters and the per-model cache counters, as Triton's counter_latencies=false."""
    out = Exposition()
    models = data["models"]
    for name, help_, field, scale in COUNTS + LATENCY_COUNTERS if latency_counters else COUNTS:
        out.family(name, "counter", help_)
        for m in models:
            out.sample(name, _labels(m), m["stats"].get(field, 0) * scale)
    out.family("nv_inference_request_failure", "counter",
               "Number of failed inference requests, all batch sizes")
    for m in models:
        for reason in REASONS:
            out.sample("nv_inference_request_failure", {**_labels(m), "reason": reason},
                       m["stats"].get(f"fail:{reason}", 0))
    cached = [m for m in models if m.get("cached")]
    for name, help_, field, scale in CACHE_COUNTERS_PER_MODEL if cached and latency_counters else ():
        out.family(name, "counter", help_)
        for m in cached:
            out.sample(name, _labels(m), m["stats"].get(field, 0) * scale)
    out.family("nv_inference_pending_request_count", "gauge",
               "Instantaneous number of pending requests awaiting execution per-model.")
    for m in models:
        s = m["stats"]
        # requests a gateway refused (queue full) were never enqueued, nor were those it answered from its
        # response cache; as in Triton, those in a batch being executed are no longer pending (the
        # workers' heartbeats tell them, up to a beat late)
        answered = s.get("success_count", 0) + s.get("fail_count", 0) - s.get("refused", 0) \
            - s.get("cache_hit_count", 0)
        waiting = s.get("enqueued", 0) - answered - m.get("executing", 0)
        out.sample("nv_inference_pending_request_count", _labels(m), max(0, waiting))
    if quantiles is not None:
        _summaries(out, models, data.get("summaries", ()), quantiles)
    out.family("despina_stream_backlog", "gauge", "Entries in a model version's request streams "
               "(queued or being worked on; one entry may carry several requests)")
    for m in models:
        for level, n in enumerate(m["backlog"], start=1):
            out.sample("despina_stream_backlog", {**_labels(m), "priority": str(level)}, n)
    _batch_histogram(out, models)
    _latency_histogram(out, models, "despina_request_latency_seconds", "lat",
                       "Request latency from enqueue to reply, as workers measure it")
    _latency_histogram(out, models, "despina_queue_latency_seconds", "qlat",
                       "Time requests waited before their batch started executing")
    out.family("despina_model_load_duration_seconds", "summary", "Time to load a model version on a worker")
    for m in models:
        out.sample("despina_model_load_duration_seconds_count", _labels(m), m["stats"].get("load_count", 0))
        out.sample("despina_model_load_duration_seconds_sum", _labels(m), m["stats"].get("load_ns", 0) / 1e9)
    out.family("nv_model_load_duration_secs", "gauge", "Model load time in seconds")
    for m in models:  # the latest load of the version on any worker; none before one was recorded
        if "load_last_ns" in m["stats"]:
            out.sample("nv_model_load_duration_secs", _labels(m), m["stats"]["load_last_ns"] / 1e9)
    _cold_start_histogram(out, models)
    out.family("despina_workers_alive", "gauge", "Workers whose heartbeat is current")
    out.sample("despina_workers_alive", {}, data["workers_alive"])
    for name, field, help_ in CACHE_COUNTERS:
        out.family(name, "counter", help_)
        for process, stats in sorted(data.get("cache", {}).items()):
            out.sample(name, {"process": process}, stats.get(field, 0))
    cache_metrics.render(out, data.get("response_cache", {}), models)
    for name, kind, field, help_ in RESPONSE_CACHE:
        out.family(name, kind, help_)
        for process, figures in sorted(data.get("response_cache", {}).items()):
            out.sample(name, {"process": process}, figures.get(field, 0))
    for name, kind, field, help_ in CLIENTS:
        out.family(name, kind, help_)
        for process, figures in sorted(data.get("clients", {}).items()):
            out.sample(name, {"process": process}, figures.get(field, 0))
    families: dict[str, list[Sample]] = {}  # a family's samples together, as the text format wants them
    for sample in host:
        families.setdefault(sample[0], []).append(sample)
    for name, samples in families.items():
        out.family(name, samples[0][1], samples[0][2])
        for _, _, _, labels, value in samples:
            out.sample(name, labels, value)
    for name, kind, help_, series in custom_metrics.families(data.get("custom", ())):
        if name in out.names:  # a model's family named as one of Despina's: Despina's is the one shown
            continue
        out.family(name, kind, help_)
        for sample_name, labels, value in series:
            out.sample(sample_name, labels, value)
    return out.text()


def _labels(m: dict[str, Any]) -> dict[str, str]:
    return {"model": m["model"], "version": m["version"]}


def _summaries(out: Exposition, models: list[dict[str, Any]], windows: Iterable[dict[str, Any]],
               quantiles: tuple[float, ...]) -> None:
    """Count and sum from the statistics (the counters' own, as Triton's documentation says they are); the
    quantiles from every worker's window of the version. As in Triton, a model with the response cache on
    shows no request summary."""
    cached = [m for m in models if m.get("cached")]
    for name, help_, field, quantity in SUMMARIES + (CACHE_SUMMARIES if cached else ()):
        out.family(name, "summary", help_)
        for m in cached if quantity.startswith("cache") else models:
            if quantity == "request" and m.get("cached"):
                continue
            exports = [w[m["model"]][m["version"]] for w in windows
                       if m["version"] in w.get(m["model"], {})]
            out.sample(f"{name}_count", _labels(m), m["stats"].get(f"{field}_count", 0))
            out.sample(f"{name}_sum", _labels(m), m["stats"].get(f"{field}_ns", 0) * 1e-3)
            for q, value in zip(quantiles, summaries.quantiles(exports, quantity, quantiles), strict=True):
                out.sample(name, {**_labels(m), "quantile": f"{q:g}"}, value)


def _batch_histogram(out: Exposition, models: list[dict[str, Any]]) -> None:
    out.family("despina_batch_size", "histogram", "Rows per model execution (the batch actually formed)")
    bounds = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    for m in models:
        sizes = {int(k.split(":", 1)[1]): v for k, v in m["stats"].items() if k.startswith("batch:")}
        for bound in bounds:
            out.sample("despina_batch_size_bucket", {**_labels(m), "le": str(bound)},
                       sum(v for size, v in sizes.items() if size <= bound))
        out.sample("despina_batch_size_bucket", {**_labels(m), "le": "+Inf"}, sum(sizes.values()))
        out.sample("despina_batch_size_sum", _labels(m), sum(size * v for size, v in sizes.items()))
        out.sample("despina_batch_size_count", _labels(m), sum(sizes.values()))


def _latency_histogram(out: Exposition, models: list[dict[str, Any]], name: str, field: str,
                       help_: str) -> None:
    out.family(name, "histogram", help_)
    for m in models:
        counts = [m["stats"].get(f"{field}:{i}", 0) for i in range(len(LATENCY_BUCKETS_US) + 1)]
        running = 0
        for bound, n in zip(LATENCY_BUCKETS_US, counts, strict=False):
            running += n
            out.sample(f"{name}_bucket", {**_labels(m), "le": f"{bound / 1e6:g}"}, running)
        out.sample(f"{name}_bucket", {**_labels(m), "le": "+Inf"}, sum(counts))
        total_ns = m["stats"].get("success_ns" if field == "lat" else "queue_ns", 0)
        out.sample(f"{name}_sum", _labels(m), total_ns / 1e9)
        out.sample(f"{name}_count", _labels(m), sum(counts))


def _cold_start_histogram(out: Exposition, models: list[dict[str, Any]]) -> None:
    name = "despina_cold_start_duration_seconds"
    out.family(name, "histogram", "Time from a request for a model scaled to zero to the model being ready")
    for m in models:
        stats = m["stats"]
        running = 0
        for i, bound in enumerate(COLD_START_BUCKETS_S):
            running += stats.get(f"cold:{i}", 0)
            out.sample(f"{name}_bucket", {**_labels(m), "le": f"{bound:g}"}, running)
        # cold starts recorded before the buckets were are in the count alone: +Inf holds them
        out.sample(f"{name}_bucket", {**_labels(m), "le": "+Inf"}, stats.get("cold_count", 0))
        out.sample(f"{name}_sum", _labels(m), stats.get("cold_ns", 0) / 1e9)
        out.sample(f"{name}_count", _labels(m), stats.get("cold_count", 0))
    name = "despina_cold_start_failures_total"
    out.family(name, "counter", "Cold starts whose load failed (the model went back to scaled to zero, tried "
               "again by a request after a backoff)")
    for m in models:
        out.sample(name, _labels(m), m["stats"].get("cold_failed", 0))
    name = "despina_model_load_crashes_total"
    out.family(name, "counter", "Workers that died while loading the model version (a crash, the OOM "
               "killer); after 2 it fails and is placed on no worker")
    for m in models:
        out.sample(name, _labels(m), m["stats"].get("load_crashes", 0))


async def metrics_text(redis: aioredis.Redis, keys: Keys, host: HostMetrics,
                       own_cache: dict[str, int] | None = None, quantiles: tuple[float, ...] | None = None,
                       latency_counters: bool = True) -> bytes:
    """`own_cache`: the control plane's artifact cache counters, when it has a cache; `quantiles`: those of
    the latency summaries, None when they are off; `latency_counters`: as render's."""
    data = await collect(redis, keys)
    if own_cache is not None:
        data["cache"]["control"] = own_cache
    return render(data, host.samples(data["gpus"]), quantiles, latency_counters)
