"""Each role as a blocking entry point: gateway, worker, control. `despina serve` runs all three."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from redis.exceptions import ResponseError

from . import fds
from .contract.errors import ConfigError
from .control.plane import ControlPlane
from .cpus import parse, pin
from .embedded import START_FAILED, bound_socket, host_port
from .http_server import Server, serve_in_loop
from .logs import dump_tasks_on_sigusr2
from .redis_client import connect, connect_worker, trouble
from .serve import CONTROL_ID, CONTROL_PREDECESSOR
from .settings import Settings
from .workers.worker import Worker

log = logging.getLogger("despina.worker")
STUCK_GRACE_S = 5.0
# what a role's stop may take beyond its drains (two: a gateway's, then its colocated worker's): the
# models' finalize, threads stuck in model code (STUCK_GRACE_S), the last words to Redis
STOP_MARGIN_S = 15.0


def exit_if_stuck(settings: Settings, more_s: float = 0.0) -> Callable[[], None]:
    """What a role calls when it is told to stop: if the process still runs when its stop should long be
    over, it exits anyway. Its stop waits on Redis in places, and a Redis that hangs (frozen, or a host
    lost without a reset) would hold it for ever; under `despina serve` the supervisor kills a child
    that overstays, but when serve itself dies (SIGKILL, the OOM killer) its children get the kernel's
    SIGTERM (embedded.die_with_parent) and nobody is left to kill them. Only the first call arms it.
    `more_s`: what the role's stop may take besides its drains (a worker's handover)."""
    armed = threading.Event()
    seconds = 2 * settings.drain_timeout_s + more_s + STOP_MARGIN_S

    def leave() -> None:
        log.error("still running %g s after being told to stop (a hang in the stop, Redis not "
                  "answering?): exiting", seconds)
        logging.shutdown()
        os._exit(1)

    def arm() -> None:
        if not armed.is_set():
            armed.set()
            timer = threading.Timer(seconds, leave)
            timer.daemon = True
            timer.start()
    return arm


def quiet_collector() -> None:
    """What is loaded at start-up lives as long as the process: keep it out of every collection, and
    collect the young generation less often (the hot paths make many short-lived objects, few cycles)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def run_gateway(settings: Settings, started: Callable[[], None] = lambda: None) -> None:
    """`started`: what the gateway calls once it serves (started.py)."""
    from .gateway import http
    from .gateway.app import create_app
    from .gateway.protocol import protocol_class

    server: Server | None = None

    def leave(code: int) -> None:
        assert server is not None  # the colocated worker starts with the app's lifespan, in server.run
        server.leave(code)

    alongside = (lambda: colocated_worker(settings, leave)) if settings.colocate else None
    try:
        app = create_app(settings, alongside=alongside)
    except ConfigError as exc:  # a key file it cannot read, a bad key: one line, as a taken port says it
        raise SystemExit(f"gateway: {exc.message}") from None
    warn_of_connection_limit(settings)
    protocol = protocol_class(app.state.hot_routes, settings.header_timeout_s, settings.body_timeout_s,
                              settings.write_timeout_s, app.state.gateway.clients)
    http.advertise_keep_alive(settings.keep_alive_timeout_s)  # the hot routes' answers; the others':
    config = uvicorn.Config(app, host=settings.host, port=settings.http_port,
                            loop="uvloop", http=protocol, lifespan="on",
                            access_log=False,
                            log_config=None,  # its lines through ours: JSON lines with --log-format json
                            proxy_headers=False, server_header=False, date_header=False,
                            headers=http.keep_alive_headers(settings.keep_alive_timeout_s),
                            # seconds, a fraction too (as timeout_graceful_shutdown below)
                            timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
                            log_level=settings.log_level,
                            # seconds, a fraction too (uvicorn's annotation says int; asyncio.timeout
                            # takes a float): int() made a drain under a second none at all
                            timeout_graceful_shutdown=settings.drain_timeout_s)  # type: ignore[arg-type]
    # bound here, not by uvicorn: asyncio's bind makes `::` IPv6 alone (embedded.bound_socket)
    sock = reuse_port_socket(settings.host, settings.http_port) if settings.reuse_port else \
        bound_socket(settings.host, settings.http_port, "gateway")
    logging.getLogger("despina.gateway").info("listening on http://%s",
                                              host_port(settings.host, sock.getsockname()[1]))
    quiet_collector()
    server = Server(config, give_up=app.state.gateway.give_up, stopping=exit_if_stuck(settings),
                    started=started)
    server.run(sockets=[sock])
    if settings.colocate:
        _leave_stuck_threads(server.exit_code)
    if server.exit_code:
        raise SystemExit(server.exit_code)


def warn_of_connection_limit(settings: Settings) -> None:
    """A warning where the gateway's connection limit set (fds.py) leaves Redis no room."""
    room = fds.open_files_limit() - fds.RESERVE
    if settings.max_connections > room:
        logging.getLogger("despina.gateway").warning(
            "DESPINA_MAX_CONNECTIONS=%d leaves too few of the %d open files allowed (ulimit -n) for Redis: "
            "past %d connections the gateway may fail to reach it (503)", settings.max_connections,
            fds.open_files_limit(), max(room, 0))


@contextlib.asynccontextmanager
async def colocated_worker(settings: Settings, leave: Callable[[int], None]) -> AsyncIterator[None]:
    """A worker in the gateway's process and event loop (serve --colocate), for as long as the gateway
    serves: it still reads its models' streams through the consumer groups and replies through Redis, as
    a worker process does, so that on a machine with few cores one process fewer takes turns on them.
    On the way out it stops after the gateway has answered what was in flight, then drains as a worker
    does. If it ends while the gateway still serves, the process stops through `leave` (a stop signal's
    drain, then an exit with the code given): a gateway whose worker is gone must not go on as if it had
    one. Ended after its first heartbeat, it crashed, and serve starts the gateway again; before, the
    process could not start (START_FAILED), and serve stops everything, however long that start took."""
    assert settings.redis_url
    redis = connect_worker(settings.redis_url)
    worker = Worker(settings, redis)
    task = asyncio.create_task(worker.run())
    leaving = False

    def ended(task: asyncio.Task[None]) -> None:
        if leaving:
            return
        if task.cancelled():
            reason = "cancelled"
        elif (exc := task.exception()) is not None:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = "returned"
        log.error("worker %s ended while its gateway serves (%s): stopping the process", worker.id, reason)
        leave(1 if worker.joined else START_FAILED)

    task.add_done_callback(ended)
    try:
        yield
    finally:
        reported = task.done()  # ended() has said why: not raised again as the gateway stops
        leaving = True
        worker.stop()
        try:
            await (asyncio.gather(task, return_exceptions=True) if reported else task)
        finally:
            await redis.aclose()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """The HTTP port bound with SO_REUSEPORT, so that `serve --gateways N` runs N gateways on it: the
    kernel spreads new connections over them (only processes of the same user can join the port)."""
    return bound_socket(host, port, "gateway", reuse_port=True)


def _run_until_signal(make_and_run: object) -> None:
    import uvloop

    uvloop.run(make_and_run())  # type: ignore[operator]


def run_worker(settings: Settings, started: Callable[[], None] = lambda: None) -> None:
    """`started`: what the worker calls once it joined (its first heartbeat; started.py)."""
    if settings.worker_cpus is not None:  # before any thread starts: the backends' threads inherit it
        pin(parse(settings.worker_cpus))
        log.info("running on CPU %s", settings.worker_cpus)

    # the health port, before anything starts: a port taken is one line, not a traceback in a task
    port = settings.worker_health_port
    health = bound_socket(settings.host, port, "worker health") if port else None

    async def main() -> None:
        assert settings.redis_url
        redis = connect_worker(settings.redis_url)
        worker = Worker(settings, redis)
        worker.on_join = started
        quiet_collector()
        loop = asyncio.get_running_loop()
        stuck = exit_if_stuck(settings, settings.worker_handover_s)

        def stop() -> None:
            stuck()
            worker.stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        dump_tasks_on_sigusr2()
        stopped = asyncio.Event()
        http = None
        if health is not None:
            from .workers.health import create_app, readiness

            log.info("worker %s: health on http://%s (/livez, /readyz)", worker.id,
                     host_port(settings.host, health.getsockname()[1]))
            http = asyncio.create_task(serve_in_loop(create_app(lambda: readiness(worker)), health, stopped))
        try:
            await worker.run()
        except ResponseError as exc:
            if worker.joined:
                raise
            # Redis refused its first write (another program's key?): one line and START_FAILED (cli.main),
            # which serve stops at, not a traceback that serve restarted every second for ever
            raise SystemExit(f"worker {worker.id}: cannot start: {trouble(exc)}") from None
        finally:
            stopped.set()
            if http:
                await asyncio.gather(http, return_exceptions=True)
            await redis.aclose()

    _run_until_signal(main)
    _leave_stuck_threads()


def _leave_stuck_threads(code: int = 0) -> None:
    """Everything was drained; a thread still running is stuck in a model's code (an initialize that
    never returns, say). Exit without it, rather than wait for it forever at interpreter exit: its model
    process sees the worker gone and ends too."""
    deadline = time.monotonic() + STUCK_GRACE_S
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate()
             if t is not threading.current_thread() and not t.daemon and t.is_alive()]
    if stuck:
        log.warning("exiting with %d thread(s) stuck in model code: %s", len(stuck), ", ".join(stuck))
        logging.shutdown()
        os._exit(code)


def run_control(settings: Settings, started: Callable[[], None] = lambda: None) -> None:
    """`started`: what the control plane calls once it leads or stands by (started.py)."""
    # the metrics port, before anything starts: uvicorn's failure to bind it, in a task, was a traceback
    metrics = bound_socket(settings.host, settings.metrics_port, "control") if settings.metrics_port else None

    failure: list[str] = []  # why the start failed (ControlPlane.start_failure), said once the loop ends

    async def main() -> None:
        assert settings.redis_url
        redis = connect(settings.redis_url)
        # under serve, which names each control plane it starts, and on a restart the one that exited
        plane = ControlPlane(settings, redis, os.environ.get(CONTROL_ID) or None,
                             os.environ.get(CONTROL_PREDECESSOR) or None)
        plane.on_start = started
        stopped = asyncio.Event()
        stuck = exit_if_stuck(settings)

        def stop() -> None:
            stuck()
            plane.stop()
            stopped.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        dump_tasks_on_sigusr2()
        http = None
        if metrics is not None:
            from .control import http as control_http

            app = control_http.create_app(settings, redis, plane.cache, lambda: plane.leading)
            http = asyncio.create_task(serve_in_loop(app, metrics, stopped))
        try:
            await plane.run()
        finally:
            stopped.set()
            if http:
                await asyncio.gather(http, return_exceptions=True)
            await redis.aclose()
        if plane.start_failure:
            failure.append(plane.start_failure)

    _run_until_signal(main)
    if failure:  # one line, and cli.main's START_FAILED: serve stops everything at it
        raise SystemExit(f"control: {failure[0]}")
