"""The `despina` command: serve (everything), or one role (gateway, worker, control)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from . import logs
from .settings import Settings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="despina", description="Serverless ML model serving, Triton-compatible.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--redis-url", dest="redis_url", help="Redis/Valkey URL (default: $REDIS_URL; "
                        "serve starts an embedded Valkey when neither is set)")
        sp.add_argument("--key-prefix", dest="key_prefix", help="prefix of every Redis key (default despina)")
        sp.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
        sp.add_argument("--log-format", dest="log_format", choices=["text", "json"])

    def repo(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model-repository", dest="model_repository",
                        help="Triton model repository (default ./model_repository)")
        sp.add_argument("--model-control-mode", dest="model_control_mode", choices=["none"],
                        help="as Triton's; only 'none' (load everything at start) for now")

    def http(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--http-port", dest="http_port", type=int, help="HTTP port (default 8000)")
        sp.add_argument("--host", dest="host", help="address to bind (default 127.0.0.1)")
        sp.add_argument("--request-timeout", dest="request_timeout_s", type=float,
                        help="default deadline of a request in seconds (default 60)")

    def worker(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--intra-op-threads", dest="intra_op_threads", type=int,
                        help="threads per backend instance (default 1)")

    serve = sub.add_parser("serve", help="start control plane, workers and gateway on this machine")
    common(serve), repo(serve), http(serve), worker(serve)
    serve.add_argument("--workers", dest="workers", type=int, help="worker processes (default 1)")
    gw = sub.add_parser("gateway", help="run one HTTP gateway against a shared Redis")
    common(gw), http(gw)
    wk = sub.add_parser("worker", help="run one worker process against a shared Redis")
    common(wk), worker(wk)
    wk.add_argument("--worker-id", dest="worker_id")
    ctl = sub.add_parser("control", help="run the control plane against a shared Redis")
    common(ctl), repo(ctl)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    values: dict[str, Any] = vars(args)
    settings = Settings.from_sources(values)
    logs.setup(settings.log_level, args.command, json=settings.log_format == "json")
    if args.command != "serve" and not settings.redis_url:
        print(f"despina {args.command}: give --redis-url or set REDIS_URL (only 'serve' embeds Valkey)",
              file=sys.stderr)
        return 2
    if args.command == "serve":
        from .serve import Supervisor

        return Supervisor(settings).run()
    from . import roles

    run = {"gateway": roles.run_gateway, "worker": roles.run_worker, "control": roles.run_control}
    run[args.command](settings)
    return 0
