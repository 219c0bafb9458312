"""The `despina` command: serve (everything), or one role (gateway, worker, control)."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from . import cpus, logs
from .cli_worker import worker_args
from .embedded import START_FAILED
from .settings import CHOICES, FALSE_WORDS, TRUE_WORDS, BadSetting, Settings


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line that says what is wrong, not the command's whole usage first (serve's is thirty)."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _boolean(text: str) -> bool:
    """A flag's value as Triton's command line spells it: --exit-on-error=false."""
    word = text.strip().lower()
    if word in TRUE_WORDS | FALSE_WORDS:
        return word in TRUE_WORDS
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parser() -> argparse.ArgumentParser:
    """Every command and option of `despina` (deploy/'s command lines are checked against it)."""
    p = _Parser(prog="despina", description="Serverless ML model serving, Triton-compatible.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--redis-url", dest="redis_url", help="Redis/Valkey URL (default: $REDIS_URL; "
                        "serve starts an embedded Valkey when neither is set)")
        sp.add_argument("--key-prefix", dest="key_prefix", help="prefix of every Redis key (default despina)")
        sp.add_argument("--log-level", dest="log_level", choices=CHOICES["log_level"])
        sp.add_argument("--log-format", dest="log_format", choices=CHOICES["log_format"])

    def repo(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model-repository", dest="model_repository",
                        help="Triton model repository: a folder or s3://bucket/prefix "
                             "(default ./model_repository)")
        sp.add_argument("--model-control-mode", dest="model_control_mode",
                        choices=CHOICES["model_control_mode"],
                        help="as Triton's: none (load all at start), explicit (load/unload API), poll")
        sp.add_argument("--load-model", dest="load_model", action="append", metavar="NAME",
                        help="explicit mode: load this model at start (repeatable; * = all)")
        sp.add_argument("--exit-on-error", dest="exit_on_error", nargs="?", const=True, type=_boolean,
                        metavar="BOOL", help="as Triton's: a --load-model model that cannot be loaded stops "
                        "the start (default true; --exit-on-error=false serves on without it)")
        sp.add_argument("--repository-poll-secs", dest="repository_poll_secs", type=float,
                        help="poll mode: seconds between two looks at the repository (default 15; 0: "
                             "the look at start only, as in Triton)")
        sp.add_argument("--idle-timeout", dest="idle_timeout_s", type=float,
                        help="unload a model idle this many seconds; the next request loads it "
                             "(default 0: never)")
        sp.add_argument("--model-replicas", dest="model_replicas", type=int,
                        help="workers that load each model (default 1; 0 = every eligible worker)")

    def http(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--http-port", dest="http_port", type=int, help="HTTP port (default 8000)")
        sp.add_argument("--host", dest="host", help="address to bind (default 127.0.0.1; 0.0.0.0, every "
                        "IPv4 address; ::, every IPv6 and IPv4 address)")
        sp.add_argument("--request-timeout", dest="request_timeout_s", type=float,
                        help="default deadline of a request in seconds (default 60)")
        sp.add_argument("--header-timeout", dest="header_timeout_s", type=float,
                        help="seconds a request's line and headers may take to come in, from their first "
                             "byte (default 30; then 408)")
        sp.add_argument("--body-timeout", dest="body_timeout_s", type=float,
                        help="seconds a request's body may pause between two reads (default 30; then 408)")
        sp.add_argument("--keep-alive-timeout", dest="keep_alive_timeout_s", type=float,
                        help="seconds a connection may idle between requests before it is closed, said to "
                             "clients in a Keep-Alive header (default 5)")
        sp.add_argument("--write-timeout", dest="write_timeout_s", type=float,
                        help="seconds a client may leave the answers owed to it unread before its "
                             "connection is cut (default 60)")
        sp.add_argument("--strict-readiness", dest="strict_readiness", nargs="?", const=True, type=_boolean,
                        metavar="BOOL", help="as Triton's: /v2/health/ready is 200 only while every model "
                        "asked to load serves (default true: one that failed to load keeps it 400; false: "
                        "once each has loaded or failed)")
        sp.add_argument("--api-keys-file", dest="api_keys_file",
                        help="API keys, one a line: KEY or KEY: model1,model2 (keys themselves only "
                             "through this file or $DESPINA_API_KEYS, never on the command line)")
        sp.add_argument("--allow-client-shm", dest="allow_client_shm", action=argparse.BooleanOptionalAction,
                        help="as Triton's: clients on this host may register system shared memory and "
                             "pass tensors through it (default off)")
        sp.add_argument("--auth-inference", dest="auth_inference", action=argparse.BooleanOptionalAction,
                        help="with API keys configured, inference and metadata need a key too")
        sp.add_argument("--http-restricted-api", dest="http_restricted_api", action="append",
                        metavar="API[,API...]:HEADER=VALUE",
                        help="as Triton's: these APIs need the header HEADER: VALUE (repeatable)")
        sp.add_argument("--cors-origins", dest="cors_origins", metavar="ORIGIN[,ORIGIN...]",
                        help="web pages of these origins (https://demo.example.com), or of any with *, may "
                             "call the API from a browser (default: none, no CORS headers)")
        sp.add_argument("--cors-allow-headers", dest="cors_allow_headers", metavar="NAME[,NAME...]",
                        help="request headers such pages may send besides the API's own")
        sp.add_argument("--cors-max-age", dest="cors_max_age_s", type=int, metavar="SECONDS",
                        help="how long a browser may reuse a preflight's answer (default 600)")
        sp.add_argument("--trace-file", dest="trace_file", metavar="PATH",
                        help="where Triton's tracing writes traces (default: none, and the trace API refuses "
                             "to turn it on); of serve --gateways N gateway i writes PATH-i. Only here: the "
                             "trace API may not change it")
        sp.add_argument("--trace-config", dest="trace_config", action="append", metavar="triton,file=PATH",
                        help="Triton's spelling of --trace-file (its other settings are the trace API's)")
        sp.add_argument("--sagemaker", dest="sagemaker", action=argparse.BooleanOptionalAction,
                        help="serve SageMaker's container contract too: /ping, /invocations, /models "
                             "(and take SageMaker's defaults: port 8080, /opt/ml/model)")
        sp.add_argument("--sagemaker-model", dest="sagemaker_model", metavar="NAME",
                        help="the model /invocations runs (default: the repository's only model)")

    def cache(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--response-cache-bytes", dest="response_cache_bytes", type=int, metavar="BYTES",
                        help="memory each gateway and worker keeps answers in, for models with "
                             "response_cache { enable: true } (Triton's --cache-config local,size=BYTES; "
                             "default 0: off)")

    def metrics(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--metrics-port", dest="metrics_port", type=int,
                        help="Prometheus /metrics port of the control plane (default 8002; 0 = off)")

    def metrics_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--metrics-config", dest="metrics_config", action="append", metavar="SETTING=VALUE",
                        help="as Triton's: summary_latencies=true adds the latency summaries "
                             "(nv_inference_*_summary_us), summary_quantiles=Q:ERROR,... their quantiles, "
                             "counter_latencies=false leaves out the latency counters; histogram_latencies "
                             "is taken and adds nothing, as in Triton 2.51 "
                             "(repeatable; serve's workers take serve's, `despina worker` needs its own)")

    serve = sub.add_parser("serve", help="start control plane, workers and gateway on this machine")
    for add in (common, repo, http, worker_args, cache, metrics, metrics_config):
        add(serve)
    serve.add_argument("--worker-nice", dest="worker_nice", type=int, metavar="N",
                       help="the niceness of workers that share CPUs with the gateways, 0-19 (default 5: "
                            "a gateway's reads come before a batch's work, and batches form larger)")
    serve.add_argument("--workers", dest="workers", type=int, help="worker processes (default 1)")
    serve.add_argument("--gateways", dest="gateways", type=int,
                       help="gateway processes, sharing the HTTP port (default 1)")
    serve.add_argument("--colocate", dest="colocate", action=argparse.BooleanOptionalAction,
                       help="run each worker inside a gateway's process (gateway i runs worker i; workers "
                            "beyond the gateways run alone): one process fewer taking turns on a small "
                            "machine's cores; requests still go through the Redis streams")
    serve.add_argument("--fixed-workers", dest="fixed_workers", action=argparse.BooleanOptionalAction,
                       help="its workers are all there will be (default, with 1 or more): a model none of "
                            "them can hold (GPUs, memory) fails at once; --no-fixed-workers waits for a "
                            "worker that can take it to join (workers started by hand)")
    gw = sub.add_parser("gateway", help="run one HTTP gateway against a shared Redis")
    for add in (common, http, cache, metrics_config):
        add(gw)
    wk = sub.add_parser("worker", help="run one worker process against a shared Redis")
    for add in (common, worker_args, cache, metrics_config):
        add(wk)
    wk.add_argument("--worker-id", dest="worker_id",
                    help="a name for this worker; each process adds a suffix of its own")
    wk.add_argument("--worker-health-port", dest="worker_health_port", type=int, metavar="PORT",
                    help="serve /livez and /readyz here, for Kubernetes' probes: ready once the control "
                         "plane has placed this worker and its loads have ended (default 0: off)")
    wk.add_argument("--host", dest="host", help="address the health port binds (default 127.0.0.1; ::, "
                    "every IPv6 and IPv4 address)")
    ctl = sub.add_parser("control", help="run the control plane against a shared Redis")
    for add in (common, repo, metrics, metrics_config):
        add(ctl)
    ctl.add_argument("--host", dest="host", help="address the metrics port binds (default 127.0.0.1; ::, "
                     "every IPv6 and IPv4 address)")
    push = sub.add_parser("push", help="upload a model folder to a registry (s3://bucket/prefix or a folder)")
    push.add_argument("path", help="the model folder: config.pbtxt and version folders (or model files)")
    push.add_argument("registry", help="s3://bucket/prefix, or a local model repository")
    push.add_argument("--version", type=int, help="upload the folder's newest version as this version")
    push.add_argument("--name", help="the model's name in the registry (default: the folder's name)")
    ls = sub.add_parser("ls", help="list a registry's models and versions")
    ls.add_argument("registry", help="s3://bucket/prefix, or a local model repository")
    return p


def _registry_command(args: argparse.Namespace, settings: Settings) -> int:
    from .contract.errors import DespinaError
    from .registry import transfer

    try:
        if args.command == "push":
            transfer.push(args.path, args.registry, settings, args.version, args.name)
        elif why := _model_folder_trouble(args.registry):  # as serve refuses it
            print(f"despina ls: {why}", file=sys.stderr)
            return 1
        else:
            transfer.listing(args.registry, settings)
    except DespinaError as exc:
        print(f"despina {args.command}: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:  # a local folder it cannot read or write: the registry's errors are DespinaErrors
        print(f"despina {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def settings_of(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings a command line starts with (raises BadSetting): its options over DESPINA_* variables
    (os.environ unless given), the repeatable options joined as their variables spell them."""
    values: dict[str, Any] = dict(vars(args))
    if values.get("load_model"):
        values["load_model"] = ",".join(values["load_model"])
    if values.get("rate_limit_resource"):
        values["rate_limit_resource"] = ",".join(values["rate_limit_resource"])
    if values.get("http_restricted_api"):
        values["http_restricted_api"] = ";".join(values["http_restricted_api"])
    for entry in values.pop("trace_config", None) or []:
        setting, _, path = entry.removeprefix("triton,").partition("=")
        if setting != "file" or not path:
            raise BadSetting(f"--trace-config {entry!r}: only triton,file=PATH (the trace file) is taken at "
                             "start; the other trace settings are the trace API's (POST /v2/trace/setting)")
        if not vars(args).get("trace_file"):  # --trace-file wins; of several --trace-config the last
            values["trace_file"] = path
    values.update(_metrics_config(values.pop("metrics_config", None) or []))
    return Settings.from_sources(values, environ)


# Triton 2.51's --metrics-config settings. histogram_latencies it takes and does nothing with: 2.51 has no
# latency histogram (nv_inference_first_response_histogram_ms came in a later release), so neither here
METRICS_CONFIG = ("summary_latencies", "summary_quantiles", "counter_latencies", "histogram_latencies")


def _metrics_config(entries: list[str]) -> dict[str, Any]:
    """Triton's --metrics-config SETTING=VALUE entries as settings (the last of each wins). Triton 2.51
    takes any setting and value, using what it knows; here one it cannot use stops the start, in one line."""
    values: dict[str, Any] = {}
    for entry in entries:
        setting, sep, value = entry.partition("=")
        if setting not in METRICS_CONFIG or not sep:
            raise BadSetting(f"--metrics-config {entry!r}: only summary_latencies, counter_latencies, "
                             "histogram_latencies =true|false and summary_quantiles=<quantile>:<error>,... "
                             "are taken")
        if setting == "summary_quantiles":
            values[setting] = value
            continue
        try:
            on = _boolean(value)
        except argparse.ArgumentTypeError as exc:
            raise BadSetting(f"--metrics-config {entry!r}: {exc}") from None
        if setting != "histogram_latencies":
            values[setting] = on
    return values


def _unusable(repository: str) -> str | None:
    """Why the model repository cannot be served at all (a malformed s3:// URL, a local path that is no
    folder), or None. A store that is down, or a folder that goes later, is the control plane's to report."""
    if repository.startswith("s3://"):
        from .contract.errors import DespinaError
        from .registry.s3 import parse_url

        try:
            parse_url(repository)
        except DespinaError as exc:
            return exc.message
        return None
    folder = Path(repository).expanduser()
    if not folder.is_dir():
        return f"{repository} is not a folder"
    return _model_folder_trouble(repository)


def _model_folder_trouble(repository: str) -> str | None:
    """Why a local folder given as a repository is none: it is a model's own folder, whose version folders
    were taken for models named 1, 2, ... (serve failed them; ls listed nothing, or them). None: it is not."""
    folder = Path(repository).expanduser()
    if repository.startswith("s3://") or not folder.is_dir() or not _model_folder(folder):
        return None
    return (f"{repository} is a model's own folder (config.pbtxt or version folders at its top): give "
            f"the folder that holds it, {folder.parent} (a Triton repository holds one folder per model)")


def _model_folder(folder: Path) -> bool:
    """Whether `folder` is a model's own folder, not a repository: config.pbtxt, or version folders
    without a config.pbtxt of their own (models named "1" would have one), at its top."""
    from .registry.base import is_version

    versions = [p for p in folder.iterdir() if p.is_dir() and is_version(p.name)]
    return (folder / "config.pbtxt").is_file() or not all((p / "config.pbtxt").exists() for p in versions)


def _sagemaker_unusable(settings: Settings) -> str | None:
    """Why a single-model SageMaker endpoint cannot serve its repository, or None; Triton's SageMaker image
    stops at start for each. A model.tar.gz packed from inside the model's folder puts config.pbtxt and the
    version folders at the repository's top, where the model's folder belongs: served, it was a model '1'
    without config.pbtxt. A default model with no folder was never there to run; with none named, the
    repository's only model runs, and of none or several there is none to. /ping said 400 for ever."""
    repo = Path(settings.model_repository).expanduser()
    if not settings.sagemaker or settings.model_control_mode == "explicit" or not repo.is_dir():
        return None
    from .contract.errors import DespinaError
    from .contract.modelconfig import parse_text

    config = repo / "config.pbtxt"
    folders = sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith("."))
    if _model_folder(repo):
        name = settings.sagemaker_model or "MODEL_NAME"
        try:
            name = parse_text(name, config.read_bytes()).name or name
        except (DespinaError, OSError):
            pass  # no config (or a broken one): the placeholder says it well enough
        return (f"{repo} is a model's own folder (config.pbtxt or version folders at its top): a "
                f"single-model endpoint's model.tar.gz must hold the model's folder, {name}/config.pbtxt "
                f"and {name}/1/..., as Triton's SageMaker image requires (tar it from the folder above the "
                f"model's)")
    found = ", ".join(p.name for p in folders[:8]) + (", ..." if len(folders) > 8 else "")
    if settings.sagemaker_model and not (repo / settings.sagemaker_model).is_dir():
        return (f"the model /invocations runs, '{settings.sagemaker_model}' "
                "(SAGEMAKER_TRITON_DEFAULT_MODEL_NAME, DESPINA_SAGEMAKER_MODEL or --sagemaker-model), has no "
                f"folder in {repo}; its folders: {found or 'none'}")
    if not settings.sagemaker_model and not folders:
        return (f"{repo} holds no model: a single-model endpoint's model.tar.gz must hold the model's "
                "folder, MODEL_NAME/config.pbtxt and MODEL_NAME/1/..., as Triton's SageMaker image requires")
    if not settings.sagemaker_model and len(folders) > 1:
        return (f"{repo} holds {len(folders)} models ({found}): name the one /invocations runs with "
                "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME, DESPINA_SAGEMAKER_MODEL or --sagemaker-model, as "
                "Triton's SageMaker image requires")
    return None


def _redis_unusable(settings: Settings) -> str | None:
    """Why the Redis of the settings cannot serve Despina (redis_check.py), or None; warnings are logged."""
    from .redis_check import Unusable, check

    assert settings.redis_url
    try:
        found = check(settings.redis_url, settings.key_prefix)
    except Unusable as exc:
        return str(exc)
    for warning in found.warnings:
        logging.getLogger("despina").warning("%s", warning)
    return None


def main(argv: list[str] | None = None) -> int:
    args, unknown = parser().parse_known_args(argv)
    if unknown:  # named by the command they were given to (parse_args names `despina`'s)
        command = f"despina {args.command}"
        print(f"{command}: unrecognized arguments: {' '.join(unknown)} (see {command} --help)",
              file=sys.stderr)
        return 2
    try:
        settings = settings_of(args)
    except BadSetting as exc:
        print(f"despina {args.command}: {exc}", file=sys.stderr)
        return 2
    logs.setup(settings.log_level, args.command, json=settings.log_format == "json")
    # `kill -USR1 <pid>` writes every thread's stack to the log: what a stuck process is doing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.command in ("push", "ls"):
        return _registry_command(args, settings)
    if args.command != "serve" and not settings.redis_url:
        print(f"despina {args.command}: give --redis-url or set REDIS_URL (only 'serve' embeds Valkey)",
              file=sys.stderr)
        return 2
    if args.command in ("serve", "control") and (why := _sagemaker_unusable(settings)):  # its own words first
        print(f"despina {args.command}: {why}", file=sys.stderr)
        return 2
    if args.command in ("serve", "control") and (why := _unusable(settings.model_repository)):
        print(f"despina {args.command}: DESPINA_MODEL_REPOSITORY (or --model-repository): {why}",
              file=sys.stderr)
        return 2
    if settings.worker_cpus is not None and args.command in ("serve", "worker"):
        try:
            cpus.check(cpus.parse(settings.worker_cpus))
        except cpus.CpuListError as exc:
            print(f"despina {args.command}: --worker-cpus: {exc}", file=sys.stderr)
            return 2
    if settings.redis_url and settings.redis_check and (why := _redis_unusable(settings)):
        print(f"despina {args.command}: {why}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from .serve import Supervisor

        return Supervisor(settings).run()
    from . import fds, roles, started

    before, after = fds.raise_limit()  # every connection, to a client or to Redis, takes a descriptor
    if after != before:
        logging.getLogger("despina").debug("open-files limit raised from %d to %d", before, after)
    run = {"gateway": roles.run_gateway, "worker": roles.run_worker, "control": roles.run_control}
    try:
        run[args.command](settings, started.from_environ())
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr)  # why it could not start, in one line
        return START_FAILED
    return 0
