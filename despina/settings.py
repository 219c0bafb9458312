"""Settings: one frozen object, built once at start-up from arguments and DESPINA_* variables."""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import cpus


class BadSetting(ValueError):
    """A setting the process cannot start with: the message names it and says what it takes."""


@dataclass(frozen=True)
class Settings:
    redis_url: str | None = None            # None: start an embedded Valkey
    key_prefix: str = "despina"
    # at start, check that the Redis is one Despina can use (redis_check.py): not a cluster, a replica or a
    # Sentinel, its ACL user allowed every command and key; serve checks once, for its children too
    redis_check: bool = True
    model_repository: str = "./model_repository"
    host: str = "127.0.0.1"
    http_port: int = 8000
    metrics_port: int = 8002                # Prometheus /metrics of the control plane; 0 = off
    worker_health_port: int = 0             # `despina worker`'s /livez and /readyz (Kubernetes); 0 = off
    workers: int = 1
    gateways: int = 1                       # serve: gateway processes sharing the HTTP port
    colocate: bool = False                  # a gateway runs a worker in its own process (roles.run_gateway)
    reuse_port: bool = False                # bind the HTTP port with SO_REUSEPORT (serve sets it for 2+)
    request_timeout_s: float = 60.0         # default deadline of a request
    header_timeout_s: float = 30.0          # a request's line and headers must all come this soon (408)
    body_timeout_s: float = 30.0            # the longest a request's body may pause between reads (408)
    write_timeout_s: float = 60.0           # the longest a client may read none of the answers owed to it
    keep_alive_timeout_s: float = 5.0       # an idle connection closes after this (advertised: Keep-Alive)
    # client connections a gateway holds at once; past it a new one is answered 503 (0: what the open-files
    # limit leaves, fds.connection_limit)
    max_connections: int = 0
    max_body_bytes: int = 64 * 1024 * 1024
    max_tensor_elements: int = 1 << 27      # per input tensor; larger shapes get 400 before any allocation
    model_control_mode: str = "none"        # as Triton's: none, explicit or poll
    load_model: str = ""                    # explicit mode: models loaded at start, comma-separated; * = all
    # Triton's --exit-on-error: a --load-model model (not "*") that cannot be loaded stops the control plane's
    # start (cli.START_FAILED); false: it serves on without it. Models of the repository as a whole never do
    exit_on_error: bool = True
    # Triton's --strict-readiness: /v2/health/ready only while every model asked to load serves every version
    # (one whose load failed keeps it not ready); false: once each has a READY version or failed
    strict_readiness: bool = True
    repository_poll_secs: float = 15.0      # poll mode: seconds between two scans of the repository
    idle_timeout_s: float = 0.0             # scale-to-zero: unload a model idle this long; 0 = never
    model_replicas: int = 1                 # workers that load each model; 0 = every eligible worker
    load_timeout_s: float = 300.0           # how long a load (API, cold start) may take
    # the workers are a fixed set of `workers` (serve's own): once all have come, a model none of them can
    # hold fails at once rather than waiting for a worker to join. None: serve's (true) or control's (false)
    fixed_workers: bool | None = None
    worker_ttl_s: float = 5.0               # a worker silent this long is dead: its models move
    visibility_timeout_s: float = 60.0      # a request read and unanswered this long is redelivered
    max_attempts: int = 3                   # deliveries ended by the worker's death before dead-lettering
    reply_ttl_s: float = 120.0              # a reply stream nobody reads (a dead gateway's) expires
    # a process whose clock is off Redis's by more than this says so (log, worker status); 0: never
    clock_skew_warn_s: float = 1.0
    max_stream_length: int = 100_000        # entries on a request stream past which gateways refuse (503)
    worker_memory_mb: int = 0               # memory models may take on a worker; 0 = what it has
    cache_dir: str | None = None            # else TRITON_AWS_MOUNT_DIRECTORY, ~/.cache/despina
    cache_max_gb: float = 20.0              # the cache evicts unused model folders past this; 0 = no limit
    s3_endpoint_url: str | None = None      # else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS
    s3_region: str | None = None            # else AWS_REGION, else boto3's (AWS_DEFAULT_REGION, ~/.aws)
    s3_addressing_style: str = "auto"       # auto, path or virtual; auto = path with a custom endpoint
    s3_part_mb: int = 16                    # multipart transfers: files past this go in parts this big
    host_ensembles: bool = True             # a worker with every model an ensemble calls runs it itself
    full_queue_delay: bool = False          # batches wait out max_queue_delay even when nothing can join
    gateway_hold_us: int = 4000             # the longest a gateway holds answered clients' next requests
    response_cache_bytes: int = 0           # per gateway: memory for models with response_cache; 0 = off
    allow_client_shm: bool = False          # Triton's --allow-client-shm: clients' system shared memory
    intra_op_threads: int = 1               # per backend instance; 1 is fastest on a loaded machine
    # Triton's --rate-limit: execution_count, a worker runs an instance's batch once the resources of its
    # instance group's rate_limiter are free (workers/rate_limiter.py); off, rate_limiter is ignored
    rate_limit: str = "off"
    # Triton's --rate-limit-resource NAME:COUNT[:DEVICE], entries joined by ','; a resource not named here has
    # as many copies as the most any loaded instance needs
    rate_limit_resource: str = ""
    # backends a worker loads at once (Triton's --model-load-thread-count); the others wait their turn
    model_load_threads: int = 4
    worker_cpus: str | None = None          # CPUs the workers run on ("0-3,8"); serve's others run elsewhere
    # how much nicer serve starts its workers where they share CPUs with its gateways (no --worker-cpus, or
    # one naming every CPU): a gateway's reads come before a batch's work, and batches form larger; 0: alike
    worker_nice: int = 5
    worker_id: str | None = None
    # Triton's --metrics-config summary_latencies / summary_quantiles: workers keep their requests' recent
    # latencies (summaries.py) and /metrics shows them as summaries, at these quantiles
    summary_latencies: bool = False
    # Triton 2.51's default (its errors unused: summaries.py keeps every quantile within 1%)
    summary_quantiles: str = "0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001,0.999:0.000001"
    # Triton's --metrics-config counter_latencies: false leaves the latency counters
    # (nv_inference_*_duration_us, nv_cache_*_per_model) out of /metrics, as Triton 2.51 does; the
    # statistics API keeps them
    counter_latencies: bool = True
    log_level: str = "info"
    log_format: str = "text"                # or "json"
    # Triton's --trace-config triton,file=PATH: where a gateway writes traces ('': none, tracing refused).
    # Set at start only: the trace API may not change it (gateway/trace.py)
    trace_file: str = ""
    drain_timeout_s: float = 30.0
    # a worker told to stop serves on while its models load on other workers, at most this long (0: it drains
    # at once)
    worker_handover_s: float = 10.0
    # Security (see README "Security"): the secrets stay out of repr() so that no log line shows them.
    api_keys: str | None = field(default=None, repr=False)  # entries separated by ';' or newlines
    api_keys_file: str | None = None        # one entry a line: KEY or KEY: model1,model2
    auth_inference: bool = False            # with keys configured, inference needs a key too
    # Triton's --http-restricted-api: <api>[,<api>...]:<header>=<value>, groups separated by ';'
    http_restricted_api: str | None = field(default=None, repr=False)
    # Cross-origin requests from web pages (gateway/cors.py): allowed origins, comma-separated
    # ("https://demo.example.com"), or * for any; "": no CORS headers at all
    cors_origins: str = ""
    cors_allow_headers: str = ""            # request headers a page may send besides the API's own
    cors_max_age_s: int = 600               # how long a browser may reuse a preflight's answer
    # SageMaker's container contract (gateway/sagemaker.py, sagemaker_mme.py): /ping, /invocations, /models
    sagemaker: bool = False
    sagemaker_model: str | None = None      # what /invocations runs; else the repository's only model
    sagemaker_ping_mode: str = "ready"      # /ping answers as /v2/health/ready, or as .../live
    sagemaker_inference_type: str = "infer"  # /invocations is V2 infer, or generate / generate_stream

    def __post_init__(self) -> None:
        if self.gateways < 1:
            raise BadSetting(f"DESPINA_GATEWAYS (or --gateways) must be 1 or more, got {self.gateways}")
        if self.worker_cpus is not None:
            try:
                cpus.parse(self.worker_cpus)
            except cpus.CpuListError as exc:
                raise BadSetting(f"DESPINA_WORKER_CPUS (or --worker-cpus): {exc}") from None
        if self.colocate and self.worker_cpus is not None:
            raise BadSetting("DESPINA_COLOCATE and DESPINA_WORKER_CPUS (--colocate, --worker-cpus) do not go "
                             "together: a colocated worker runs where its gateway does")
        if "*" in (loads := [n.strip() for n in self.load_model.split(",") if n.strip()]) and len(loads) > 1:
            raise BadSetting(f"DESPINA_LOAD_MODEL (or --load-model): '*' loads every model and must be the "
                             f"only one named, as in Triton; got {self.load_model!r}")
        if self.model_load_threads < 1:
            raise BadSetting(f"DESPINA_MODEL_LOAD_THREADS (or --model-load-thread-count) must be 1 or more, "
                             f"got {self.model_load_threads}")
        if self.worker_nice > 19:
            raise BadSetting(f"DESPINA_WORKER_NICE (or --worker-nice) must be 0 to 19, got "
                             f"{self.worker_nice}")
        if self.redis_url is not None and not self.redis_url.lower().startswith(("redis://", "rediss://",
                                                                                 "unix://")):
            # not echoed: a URL may hold a password
            raise BadSetting("DESPINA_REDIS_URL (or REDIS_URL, --redis-url) must be a redis://, rediss:// or "
                             "unix:// URL")
        if self.redis_url is not None:
            from .redis_client import url_trouble

            if why := url_trouble(self.redis_url):
                raise BadSetting(f"DESPINA_REDIS_URL (or REDIS_URL, --redis-url): {why}")
        from .workers.rate_limiter import parse_resources

        try:
            parse_resources(self.rate_limit_resource)
        except ValueError as exc:
            raise BadSetting(f"DESPINA_RATE_LIMIT_RESOURCE (or --rate-limit-resource): {exc}") from None
        from .summaries import parse_quantiles

        try:
            parse_quantiles(self.summary_quantiles)
        except ValueError as exc:
            raise BadSetting(f"DESPINA_SUMMARY_QUANTILES (or --metrics-config summary_quantiles): {exc}") \
                from None
        if why := _cors_trouble(self.cors_origins, self.cors_allow_headers):
            raise BadSetting(why)
        if why := _prefix_trouble(self.key_prefix):
            raise BadSetting(f"DESPINA_KEY_PREFIX (or --key-prefix) {self.key_prefix!r}: {why}")
        for name in ("http_port", "metrics_port", "worker_health_port"):
            if getattr(self, name) > 65535:
                raise BadSetting(f"DESPINA_{name.upper()} (or --{name.replace('_', '-')}) must be a port "
                                 f"number, 65535 at most, got {getattr(self, name)}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if (value.lower() if name == "log_level" else value) not in choices:
                raise BadSetting(f"DESPINA_{name.upper()} must be one of {', '.join(choices)}, got {value!r}")
        # every number here is a size, a count, a port or a duration
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and (value < 0 or not math.isfinite(value)):
                raise BadSetting(f"DESPINA_{f.name.upper()} (or its command-line option) must be a number of "
                                 f"0 or more, got {value}")
        for name in POSITIVE:  # 0 would not mean "none" here: every request 504, constant redelivery...
            if getattr(self, name) == 0:
                raise BadSetting(f"DESPINA_{name.upper()} (or its command-line option) must be more than 0")

    @classmethod
    def from_sources(cls, args: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> Settings:
        """Arguments win over DESPINA_* variables, which win over defaults. REDIS_URL is honoured too."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = environ.get(f"DESPINA_{f.name.upper()}")
            if f.name == "redis_url" and env is None:
                env = environ.get("REDIS_URL")
            if env is not None and env != "":
                try:
                    values[f.name] = _coerce(f.type, env)
                except ValueError as exc:
                    raise BadSetting(f"DESPINA_{f.name.upper()}={env!r}: {exc}") from None
        for key, value in (args or {}).items():
            if value is not None and key in cls.__dataclass_fields__:
                values[key] = value
        _aws_defaults(values, environ)
        if values.get("sagemaker"):
            _sagemaker_defaults(values, environ)
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)


def _aws_defaults(values: dict[str, Any], environ: Mapping[str, str]) -> None:
    """What a Triton deployment's variables say where no DESPINA_* one did: the region from AWS_REGION,
    which the other AWS SDKs read and boto3 does not (it reads AWS_DEFAULT_REGION itself), and the folder
    that a remote repository's files are copied to from TRITON_AWS_MOUNT_DIRECTORY (Triton's, often a
    volume mounted for them), where the artifact cache then lives."""
    if not values.get("s3_region") and environ.get("AWS_REGION"):
        values["s3_region"] = environ["AWS_REGION"]
    if not values.get("cache_dir") and environ.get("TRITON_AWS_MOUNT_DIRECTORY"):
        values["cache_dir"] = environ["TRITON_AWS_MOUNT_DIRECTORY"]


SAGEMAKER_MODEL_DIR = "/opt/ml/model"             # where SageMaker puts a single-model endpoint's artifacts
SAGEMAKER_MME_REPOSITORY = "/tmp/despina-sagemaker"  # a multi-model endpoint's models, staged as loaded
SAGEMAKER_REQUEST_TIMEOUT_S = 55.0  # under the 60 s SageMaker waits for an invocation


def _sagemaker_defaults(values: dict[str, Any], environ: Mapping[str, str]) -> None:
    """What SageMaker's own variables say, where no DESPINA_* variable or option said otherwise: the
    port (SAGEMAKER_BIND_TO_PORT, else 8080), every address, a request timeout under SageMaker's 60 s,
    the metrics port (the first of SAGEMAKER_SAFE_PORT_RANGE), a body limit that takes batch transform's
    payloads (SAGEMAKER_MAX_PAYLOAD_IN_MB), the artifacts' folder, what /ping answers by (as Triton's
    image: SAGEMAKER_TRITON_OVERRIDE_PING_MODE, else ready, or live on a multi-model endpoint), the model
    that /invocations runs (SAGEMAKER_TRITON_DEFAULT_MODEL_NAME) and how (SAGEMAKER_TRITON_INFERENCE_TYPE),
    and for a multi-model endpoint (SAGEMAKER_MULTI_MODEL=true) explicit model control over a folder the
    endpoint's loads fill."""
    try:
        values.setdefault("http_port", int(environ.get("SAGEMAKER_BIND_TO_PORT") or 8080))
    except ValueError:
        raise BadSetting(f"SAGEMAKER_BIND_TO_PORT={environ['SAGEMAKER_BIND_TO_PORT']!r}: expected a port "
                         "number") from None
    values.setdefault("host", "0.0.0.0")
    # SageMaker gives an invocation 60 s: a request that cannot make it gets Despina's 504 (saying why)
    # before SageMaker's own timeout answers the client with nothing of the kind
    values.setdefault("request_timeout_s", SAGEMAKER_REQUEST_TIMEOUT_S)
    if environ.get("SAGEMAKER_SAFE_PORT_RANGE") and "metrics_port" not in values:
        # the ports besides SageMaker's own that a container may listen on ("23000-23999"): 8002 may not be
        ports = re.fullmatch(r"\s*([0-9]{1,5})\s*-\s*([0-9]{1,5})\s*", environ["SAGEMAKER_SAFE_PORT_RANGE"])
        if ports is None or int(ports[1]) > int(ports[2]):
            raise BadSetting(f"SAGEMAKER_SAFE_PORT_RANGE={environ['SAGEMAKER_SAFE_PORT_RANGE']!r}: expected "
                             "LOW-HIGH, two port numbers")
        values["metrics_port"] = int(ports[1])
    payload = environ.get("SAGEMAKER_MAX_PAYLOAD_IN_MB", "").strip()
    if payload and "max_body_bytes" not in values:
        # batch transform's largest body (MaxPayloadInMB, up to 100): past 64 MiB every mini-batch got 413
        if not (payload.isascii() and payload.isdigit()):
            raise BadSetting(f"SAGEMAKER_MAX_PAYLOAD_IN_MB={payload!r}: expected a whole number of MB")
        values["max_body_bytes"] = max(int(payload) * 1024 * 1024, Settings.max_body_bytes)
    multi_model = environ.get("SAGEMAKER_MULTI_MODEL", "").strip().lower() in TRUE_WORDS
    if "sagemaker_ping_mode" not in values:
        # as Triton's serve script: SAGEMAKER_TRITON_OVERRIDE_PING_MODE, else ready on a single-model
        # endpoint and live on a multi-model one (a failed load must not fail /ping: SageMaker would load
        # nothing more); it sets tritonserver's own SAGEMAKER_TRITON_PING_MODE, taken where it is not set
        values["sagemaker_ping_mode"] = (
            _choice(environ, "SAGEMAKER_TRITON_OVERRIDE_PING_MODE", "sagemaker_ping_mode")
            or _choice(environ, "SAGEMAKER_TRITON_PING_MODE", "sagemaker_ping_mode")
            or ("live" if multi_model else "ready"))
    if "sagemaker_inference_type" not in values:  # as Triton's image, refused at start if unknown
        if kind := _choice(environ, "SAGEMAKER_TRITON_INFERENCE_TYPE", "sagemaker_inference_type"):
            values["sagemaker_inference_type"] = kind
    if environ.get("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"):
        values.setdefault("sagemaker_model", environ["SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"])
    if multi_model:
        values.setdefault("model_control_mode", "explicit")
        if "model_repository" not in values:  # empty until the first load: it must exist to be read
            os.makedirs(SAGEMAKER_MME_REPOSITORY, exist_ok=True)
            values["model_repository"] = SAGEMAKER_MME_REPOSITORY
    else:
        values.setdefault("model_repository", SAGEMAKER_MODEL_DIR)


def _choice(environ: Mapping[str, str], variable: str, setting: str) -> str:
    """A SageMaker variable that takes one of a setting's words ("" when unset); BadSetting for another."""
    value = environ.get(variable, "").strip()
    words = CHOICES[setting]
    if value and value not in words:
        raise BadSetting(f"{variable}={value!r}: expected {', '.join(words[:-1])} or {words[-1]}")
    return value


# durations whose 0 would not mean "none": every request 504 at once, requests redelivered (and run again)
# every millisecond, workers taken for dead, loads failing at once, replies expiring unread, requests 408,
# connections cut as soon as the client's socket buffers are full
POSITIVE = ("request_timeout_s", "visibility_timeout_s", "worker_ttl_s", "load_timeout_s", "reply_ttl_s",
            "header_timeout_s", "body_timeout_s", "write_timeout_s", "keep_alive_timeout_s")

# the settings that take one of a few words (the command line's choices too; the log level in any case)
CHOICES = {"log_level": ("debug", "info", "warning", "error"), "log_format": ("text", "json"),
            "model_control_mode": ("none", "explicit", "poll"),
            "s3_addressing_style": ("auto", "path", "virtual"), "sagemaker_ping_mode": ("ready", "live"),
            "sagemaker_inference_type": ("infer", "generate", "generate_stream"),
            "rate_limit": ("off", "execution_count")}
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


# Not in a key prefix: the special characters of Redis's glob patterns (the ACL rule `~PREFIX:*` that grants
# a deployment its keys would then grant others too, or miss its own), and braces (a cluster proxy's hash tag)
PREFIX_SPECIAL = "*?[]\\{}"


def _prefix_trouble(prefix: str) -> str | None:
    """Why `prefix` cannot begin every Redis key, or None. Empty gave keys like ':req:...', outside any
    ACL pattern a deployment would write, and whitespace breaks ACL rules and KEDA's stream names."""
    if not prefix:
        return "must not be empty"
    if any(c.isspace() or not c.isprintable() for c in prefix):
        return "must have no spaces or control characters"
    if special := "".join(sorted({c for c in prefix if c in PREFIX_SPECIAL})):
        return f"must not hold {special!r}: Redis patterns (ACL key patterns) and hash tags read them"
    return None


# an origin as a browser sends it: scheme://host[:port], no path, not even a final '/'
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@\s,*]+", re.IGNORECASE)
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")  # RFC 9110 token


def _cors_trouble(origins: str, headers: str) -> str | None:
    """Why the CORS settings cannot be used, or None."""
    listed = [o.strip() for o in origins.split(",") if o.strip()]
    if "*" in listed and len(listed) > 1:
        return (f"DESPINA_CORS_ORIGINS (or --cors-origins): '*' allows every origin and must be alone, "
                f"got {origins!r}")
    for origin in listed:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            return (f"DESPINA_CORS_ORIGINS (or --cors-origins): {origin[:80]!r} is not an origin: expected "
                    "scheme://host[:port] with no path, as 'https://demo.example.com'")
    for name in (h.strip() for h in headers.split(",")):
        if name and not _HEADER_NAME.fullmatch(name):
            return f"DESPINA_CORS_ALLOW_HEADERS (or --cors-allow-headers): {name[:80]!r} is not a header name"
    return None


def _coerce(annotation: Any, raw: str) -> Any:
    kind = str(annotation)
    if kind in ("bool", "bool | None"):
        word = raw.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise ValueError(f"expected true or false, got {raw!r}")
        return word in TRUE_WORDS
    try:
        if "int" in kind and "str" not in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except ValueError:
        raise ValueError("expected " + ("a whole number" if "int" in kind else "a number")) from None
    return raw
