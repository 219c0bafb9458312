"""The control plane's own HTTP port (Triton's metrics port, 8002): Prometheus metrics for the whole
deployment at /metrics, and the live status page at /status (its data at /status.json; a standby's says
that it stands by, and which control plane leads)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import cast

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from ..contract.keys import Keys
from ..host_metrics import HostMetrics
from ..metrics import metrics_text
from ..registry import ArtifactCache
from ..settings import Settings
from ..summaries import parse_quantiles
from .status import PERIOD_S, StatusTracker
from .status_page import HTML

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
LEADER = ("# HELP despina_control_leader Whether this control plane leads (1) or stands by (0): only the "
          "leader serves the deployment's figures\n"
          "# TYPE despina_control_leader gauge\ndespina_control_leader {}\n")


def create_app(settings: Settings, redis: aioredis.Redis, cache: ArtifactCache | None = None,
               leads: Callable[[], bool] = lambda: True) -> Starlette:
    """`cache`: the control plane's artifact cache (an S3 registry), for its counters; `leads`: whether this
    control plane leads."""
    keys = Keys(settings.key_prefix)
    host = HostMetrics()
    quantiles = parse_quantiles(settings.summary_quantiles) if settings.summary_latencies else None

    async def metrics(request: Request) -> Response:
        # A standby serves no figures: they are the whole deployment's, read from Redis, and Prometheus
        # scrapes both pods while a rolling update overlaps them (each count twice). It answers all the same
        # (readiness): the update waits for the new pod to be ready before it stops the old leader.
        leader = leads()
        try:
            if leader:
                body = await metrics_text(redis, keys, host, cache.stats.as_dict() if cache else None,
                                          quantiles, settings.counter_latencies)
            else:
                await redis.ping()
                body = b""
        except (RedisError, OSError) as exc:
            return Response(f"# Redis unavailable: {exc}\n", 503, media_type=PROMETHEUS)
        return Response(body + LEADER.format(int(leader)).encode(), media_type=PROMETHEUS)

    tracker = StatusTracker(redis, keys)

    async def status_json(request: Request) -> Response:
        # A standby's figures are the deployment's too (read from Redis), but whoever opens its page must see
        # that it acts on nothing, and which control plane does
        control: dict[str, object] = {"leads": leads()}
        try:
            if not tracker.samples:
                await tracker.sample()
            leader = cast(bytes | None, await redis.get(keys.control_leader))
            control["leader"] = leader.decode(errors="replace") if leader else None  # None: none leads now
        except (RedisError, OSError) as exc:
            if not tracker.samples:
                return Response(orjson.dumps({"error": f"Redis unavailable: {exc}"}), 503,
                                media_type="application/json")
        return Response(orjson.dumps({**tracker.snapshot(), "control": control}),
                        media_type="application/json")

    async def status(request: Request) -> Response:
        return HTMLResponse(HTML)

    async def root(request: Request) -> Response:
        return RedirectResponse("/status")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(_sample_forever(tracker))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return Starlette(lifespan=lifespan, routes=[
        Route("/metrics", metrics, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
        Route("/status.json", status_json, methods=["GET"]),
        Route("/", root, methods=["GET"]),
    ])


async def _sample_forever(tracker: StatusTracker) -> None:
    while True:
        try:
            await tracker.sample()
        except (RedisError, OSError):
            pass
        await asyncio.sleep(PERIOD_S)
