"""The gateway application: routes of the V2 protocol, Triton's extensions and function URLs."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__, clock, fds
from ..contract.catalog import UNLOADED, none_loaded, unloaded, version_refused
from ..contract.errors import DespinaError, NotFound, Unavailable
from ..contract.instance_groups import completed_config
from ..contract.keys import Keys
from ..contract.modelspec import ModelSpec
from ..logs import dump_tasks_on_sigusr2
from ..redis_client import connect
from ..response_cache import ResponseCache
from ..settings import Settings
from ..summaries import Exported, LatencyWindow
from .asgi_endpoint import AsgiEndpoint
from .auth import AuthPolicy, Guard
from .connection import Clients
from .cors import CorsMiddleware, CorsPolicy
from .dispatch import Dispatcher
from .generate import GenerateRoute, StreamEndpoint
from .http import ClientGone
from .infer import FunctionRoute, InferRoute, Lane
from .logging_api import EXTENSION as LOGGING_EXTENSION
from .logging_api import logging_routes
from .models import ModelView
from .openapi import document
from .protocol import HotRoutes
from .readiness import server_ready
from .refusals import unreachable
from .repository import EXTENSIONS as REPOSITORY_EXTENSIONS
from .repository import repository_routes
from .responses import error_response, json_response
from .sagemaker import sagemaker_routes
from .sagemaker_mme import multi_model_routes
from .shm import RELEASE_S, Registry
from .shm_api import EXTENSION as SHM_EXTENSION
from .shm_api import shm_routes
from .stats import model_statistics
from .trace import Tracer
from .trace_api import EXTENSION as TRACE_EXTENSION
from .trace_api import trace_routes

log = logging.getLogger("despina.gateway")

CLOCK_S = 5.0  # how often a gateway measures its clock's offset to Redis's (clock.py)
REPORT_S = 5.0  # how often a gateway reports its figures (its connections, its response cache) to the metrics
# "sequence": sequence_id / sequence_start / sequence_end; "schedule_policy": priority and timeout
EXTENSIONS = ["binary_tensor_data", "classification", "sequence", "schedule_policy", "statistics",
              "parameters", "model_configuration", LOGGING_EXTENSION, TRACE_EXTENSION, *REPOSITORY_EXTENSIONS]


class Gateway:
    """What the routes share: settings, the Redis connection, the model view, the dispatcher."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        assert settings.redis_url, "the gateway needs a Redis URL"
        self.redis = connect(settings.redis_url)
        self.view = ModelView(self.redis, self.keys, settings.max_stream_length)
        self.dispatcher = Dispatcher(self.redis, self.keys, reply_ttl_ms=int(settings.reply_ttl_s * 1000),
                                     hold_us=settings.gateway_hold_us)
        self.ensembles: set[asyncio.Task[None]] = set()  # ensemble steps waiting for a model to wake
        # (model, version, priority) -> (its spec, where its requests go): infer.lane
        self.lanes: dict[tuple[str, int, int], tuple[ModelSpec, Lane]] = {}
        # Triton's response cache (models with response_cache { enable: true }), when given its memory
        self.cache = ResponseCache(settings.response_cache_bytes,
                                   settings.summary_latencies) if settings.response_cache_bytes else None
        # the ensembles it runs: their requests' recent latencies, for Triton's latency summaries
        self.latencies: dict[tuple[str, int], LatencyWindow] | None = \
            {} if settings.summary_latencies else None
        self.clients = Clients(fds.connection_limit(settings.max_connections))  # counted by its connections
        # clients' shared memory regions (Triton's --allow-client-shm), the server's: its gateways share them
        self.shm = Registry.of(settings.key_prefix, settings.http_port) if settings.allow_client_shm else None
        # one of `serve`'s gateways: serve starts and ends the server's registrations, not each gateway
        self._own_shm = os.environ.get("DESPINA_SUPERVISED") != "1"
        # Triton's tracing; of serve's gateways, each writes its own files (trace.py)
        index = os.environ.get("DESPINA_GATEWAY_INDEX")
        self.tracer = Tracer(settings.trace_file, int(index) if index and index.isdigit() else None)
        self._reporting: asyncio.Task[None] | None = None
        self._releasing: asyncio.Task[None] | None = None
        self.skew = clock.Skew(settings.clock_skew_warn_s, "gateway")
        self._timing: asyncio.Task[None] | None = None

    def give_up(self) -> None:
        """Shortly before the drain's time is spent (http_server.Server): what still waits, an inference
        request or a call of the control plane, is answered 503 rather than cut."""
        self.dispatcher.give_up()
        self.view.control.give_up()

    async def start(self) -> None:
        if self.shm is not None and self._own_shm:
            self.shm.join()  # the first gateway of a server starts it with no regions, as Triton's starts
        try:  # before the first request's deadline is written
            await self.skew.measure(self.redis, clock.SAMPLES)
        except (RedisError, ConnectionError, OSError) as exc:  # (the view's start says it too)
            log.debug("gateway: measuring the clock's offset to Redis's failed (%s)", exc)
        self._timing = asyncio.create_task(self.skew.keep(self.redis, CLOCK_S))
        await self.view.start()
        await self.dispatcher.start()
        self._reporting = asyncio.create_task(self._report())
        if self.shm is not None:
            self._releasing = asyncio.create_task(self._release_shm(self.shm))

    async def _report(self) -> None:
        """Every REPORT_S, this gateway's figures where the metrics read them (metrics.collect)."""
        key = self.keys.gateway(self.dispatcher.id)
        while True:
            try:
                pipe = self.redis.pipeline(transaction=True)
                pipe.hset(key, "connections", orjson.dumps(self.clients.figures()))
                if self.cache is not None:
                    pipe.hset(key, "response_cache", orjson.dumps(self.cache.figures()))
                if self.latencies:
                    pipe.hset(key, "summaries", orjson.dumps(self.latency_exports()))
                pipe.pexpire(key, int(REPORT_S * 3000))
                pipe.sadd(self.keys.gateways, self.dispatcher.id)
                await pipe.execute()
            except (RedisError, OSError) as exc:  # the next round tries again; the figures are not urgent
                log.debug("gateway: reporting its figures failed (%s)", exc)
            await asyncio.sleep(REPORT_S)

    def latency_window(self, model: str, version: int) -> LatencyWindow:
        """The window of an ensemble version this gateway runs (summary_latencies only)."""
        assert self.latencies is not None
        window = self.latencies.get((model, version))
        if window is None:
            window = self.latencies[model, version] = LatencyWindow()
        return window

    def latency_exports(self) -> dict[str, dict[str, Exported]]:
        assert self.latencies is not None
        out: dict[str, dict[str, Exported]] = {}
        for (model, version), window in self.latencies.items():
            out.setdefault(model, {})[str(version)] = window.export()
        return out

    @staticmethod
    async def _release_shm(shm: Registry) -> None:
        """Every RELEASE_S, this gateway unmaps the shared memory regions unregistered through another."""
        while True:
            await asyncio.sleep(RELEASE_S)
            try:
                shm.let_go()
            except DespinaError as exc:  # an unreadable registrations file: each request says so too
                log.debug("gateway: reading the shared memory registrations failed (%s)", exc)

    async def close(self) -> None:
        for task in (self._reporting, self._releasing, self._timing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.dispatcher.close()  # every step still waiting hears that the gateway is going
        for task in self.ensembles:
            task.cancel()
        await asyncio.gather(*self.ensembles, return_exceptions=True)
        await self.tracer.settle()  # the traces' claims on trace_count, before Redis goes
        try:  # out of the gateways the metrics read (else only their read prunes the set, when they run)
            await self.redis.srem(self.keys.gateways, self.dispatcher.id)
            await self.redis.delete(self.keys.gateway(self.dispatcher.id))
        except (RedisError, OSError) as exc:
            log.debug("gateway: leaving the gateways' set failed (%s)", exc)
        await self.view.close()
        await self.redis.aclose()
        self.tracer.flush()  # log_frequency 0: the traces go to trace_file when the gateway stops
        if self.shm is not None and self._own_shm:
            self.shm.leave()  # the last one ends them


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods answer in the API's error format too."""
    assert isinstance(exc, HTTPException)
    words = {404: "no such path", 405: f"method {request.method} not allowed on this path"}
    return Response(orjson.dumps({"error": words.get(exc.status_code, exc.detail)}), exc.status_code,
                    exc.headers, media_type="application/json")


async def _redis_error(request: Request, exc: Exception) -> Response:
    """A route that reads Redis while it is unreachable (statistics, ...): 503, as inference says."""
    return error_response(unreachable("Redis is unavailable", exc))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(b"", 499)  # not sent: the connection's end answered (a 408), or nobody is there


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after answering, so the traceback still reaches the log
    return json_response({"error": "internal error (the gateway's log has the details)"}, 500)


Alongside = Callable[[], contextlib.AbstractAsyncContextManager[None]]


def create_app(settings: Settings, alongside: Alongside | None = None) -> Starlette:
    """The gateway's app; `alongside`, when given, runs for as long as the gateway serves: entered once
    the gateway has started, left before it closes, after uvicorn has answered what was in flight
    (a colocated worker, roles.run_gateway)."""
    policy = AuthPolicy.from_settings(settings)  # a bad key file stops the gateway here, before it listens
    cors = CorsPolicy.from_settings(settings, policy)
    gw = Gateway(settings)
    openapi = orjson.dumps(document(__version__, settings.sagemaker))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        dump_tasks_on_sigusr2()
        await gw.start()
        app.state.gateway = gw
        try:
            if alongside is None:
                yield
            else:
                async with alongside():
                    yield
        finally:
            await gw.close()

    async def live(request: Request) -> Response:
        return Response(b"", 200)

    async def ready(request: Request) -> Response:
        return Response(b"", 200 if server_ready(gw.view, gw.settings.strict_readiness) else 400)

    async def gateway_ready(request: Request) -> Response:
        # this gateway can take requests (Redis answers, the catalog is published), whatever the models'
        # states: the probe for a load balancer, which /v2/health/ready's "every model loaded" is not
        view = gw.view
        return Response(b"", 200 if view.connected and view.published else 503)

    async def openapi_document(request: Request) -> Response:
        return Response(openapi, 200, media_type="application/json")

    async def server_metadata(request: Request) -> Response:
        return json_response({"name": "despina", "version": __version__, "extensions": extensions})

    async def model_metadata(request: Request) -> Response:
        try:
            model, version = _model(request)
        except DespinaError as exc:
            return error_response(exc)
        # as Triton's: the version asked for, else those that serve (not one that failed to load)
        e = model.entry
        versions = [int(version)] if version is not None else [v for v in e.versions if v not in e.failed]
        return json_response(model.spec.metadata(versions))

    async def model_ready(request: Request) -> Response:
        p = request.path_params
        if gw.view.is_ready(p["model"], p.get("version")):
            return Response(b"", 200)
        # Triton's words and status (its server ready answers an empty 400; a model's carries this)
        return json_response({"error": "Model version not ready"}, 400)

    async def model_config(request: Request) -> Response:
        try:
            model, version = _model(request)
        except DespinaError as exc:
            return error_response(exc)
        # as Triton shows it: KIND_AUTO resolved as the workers that serve it did (as a worker without a GPU
        # would while none serves it)
        versions = [int(version)] if version is not None else model.entry.versions
        gpus = max((gw.view.states.gpus.get((model.entry.name, v), 0) for v in versions), default=0)
        return json_response(completed_config(model.spec, gpus))

    async def stats(request: Request) -> Response:
        p = request.path_params
        try:
            doc = await model_statistics(gw, p.get("model"), p.get("version"))
        except DespinaError as exc:
            return error_response(exc)
        return json_response(doc)

    def _model(request: Request) -> Any:
        p = request.path_params
        model = gw.view.get(p["model"])
        if model.entry.state != "READY":
            raise Unavailable(f"model '{model.entry.name}' is unavailable: {model.entry.reason}")
        version = p.get("version")
        if model.entry.target == UNLOADED:
            raise unloaded(model.entry, version)
        if version is not None:
            if not version.isdigit():
                raise NotFound(f"no such model version '{version}': a version is a number")
            if int(version) not in model.entry.versions:
                raise version_refused(model.entry, int(version))
            if int(version) in model.entry.failed:
                raise Unavailable(f"model '{model.entry.name}' version {int(version)} failed to load: "
                                  f"{model.entry.failed[int(version)]}")
        elif (failed := none_loaded(model.entry)) is not None:
            raise failed
        return model, version

    extensions = [*EXTENSIONS, SHM_EXTENSION] if gw.shm is not None else EXTENSIONS
    infer, fn = InferRoute(gw), FunctionRoute(gw)
    routes = [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/readyz", gateway_ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/openapi.json", openapi_document, methods=["GET"]),
        Route("/v2/models/stats", stats, methods=["GET"]),
        Route("/v2/models/{model}", model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}", model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/ready", model_ready, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/ready", model_ready, methods=["GET"]),
        Route("/v2/models/{model}/config", model_config, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/config", model_config, methods=["GET"]),
        Route("/v2/models/{model}/stats", stats, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/stats", stats, methods=["GET"]),
        Route("/v2/models/{model}/infer", AsgiEndpoint(infer), methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", AsgiEndpoint(infer), methods=["POST"]),
        Route("/fn/{model}", AsgiEndpoint(fn), methods=["POST"]),
        Route("/fn/{model}/versions/{version}", AsgiEndpoint(fn), methods=["POST"]),
        *[Route(f"/v2/models/{{model}}{v}/{name}", endpoint(GenerateRoute(gw, stream)), methods=["POST"])
          for name, stream, endpoint in (("generate", False, AsgiEndpoint),
                                         ("generate_stream", True, StreamEndpoint))
          for v in ("", "/versions/{version}")],
        *repository_routes(gw),
        *logging_routes(gw),
        *shm_routes(gw),
        *trace_routes(gw),
        *(sagemaker_routes(gw) + multi_model_routes(gw) if settings.sagemaker else []),
    ]
    # CORS outside auth: a preflight carries no credentials, and a refusal's answer carries CORS headers too
    middleware = [Middleware(Guard, policy=policy)]
    if cors is not None:
        middleware.insert(0, Middleware(CorsMiddleware, policy=cors))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: _http_error, 405: _http_error, RedisError: _redis_error,
                                        ClientGone: _client_gone, Exception: _internal_error})
    app.state.gateway = gw
    # the same routes, answered by the gateway's HTTP protocol before ASGI (protocol.py)
    app.state.hot_routes = HotRoutes(infer, fn, policy, settings.max_body_bytes, cors)
    return app
