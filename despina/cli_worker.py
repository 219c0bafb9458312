"""The options of `despina serve` and `despina worker` that say how a worker runs its models."""
from __future__ import annotations

import argparse

from .settings import CHOICES


def worker_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--intra-op-threads", dest="intra_op_threads", type=int,
                    help="threads per backend instance (default 1)")
    sp.add_argument("--model-load-thread-count", dest="model_load_threads", type=int, metavar="N",
                    help="models a worker loads at once, as Triton's option (default 4)")
    sp.add_argument("--worker-cpus", dest="worker_cpus", metavar="LIST",
                    help="run workers on these CPUs only, as taskset -c lists them (0-3,8); serve "
                         "runs its other processes on the remaining CPUs")
    sp.add_argument("--rate-limit", dest="rate_limit", choices=CHOICES["rate_limit"],
                    help="as Triton's: execution_count runs an instance's batch only once the resources its "
                         "instance group's rate_limiter names are free on its worker, instances waiting "
                         "going by priority (default off: rate_limiter is ignored)")
    sp.add_argument("--rate-limit-resource", dest="rate_limit_resource", action="append",
                    metavar="NAME:COUNT[:DEVICE]",
                    help="as Triton's: COUNT copies of resource NAME on each worker's device DEVICE "
                         "(default: every device; a global resource's: the worker's); a resource not named "
                         "has as many as the most any loaded instance needs (repeatable)")
