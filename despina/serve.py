"""`despina serve`: everything on one machine, supervised.

Starts (when no Redis URL is given) an embedded Valkey, the control plane, N workers and M gateways
(sharing the HTTP port through SO_REUSEPORT when M > 1), each a child process that dies with this one.
A worker that exits is restarted; so are a gateway and the control plane that had been up for SETTLED_S
(one that dies at its start, on a taken port or with a repository it cannot read say, stops everything).
A role of any kind that says it could not start (exit START_FAILED) stops everything, whenever it says so.
The embedded Valkey's end stops everything too: the queues and the catalog went with it, and an
orchestrator's restart of serve starts clean. SIGINT/SIGTERM drain in order: the gateways stop taking
requests and answer those in flight, then workers finish, then control, then Valkey; a second signal
during the drain stops the roles at once.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import fields

from .cpus import available, format_list, parse
from .embedded import START_FAILED, EmbeddedValkey, bound_socket, child_setup, host_port
from .gateway.shm import Registry
from .settings import Settings

log = logging.getLogger("despina.serve")

RESTART_BACKOFF_S = 1.0
# a gateway that dies sooner after its start failed to start (an import error, say): stop; one that says
# it could not start (START_FAILED: its port, its key file) stops everything whenever it says so
SETTLED_S = 5.0
LAST_S = 2.0  # what a stage of the drain gets, at least, once the drain's time is spent
# how often the children are looked at besides when a signal comes (a child's end is SIGCHLD): a net only
LOOK_S = 5.0
# what serve tells each control plane it starts (roles.run_control; not settings: nobody else sets them):
# its id, and on a restart the id of the one that exited, whose lease it then takes at once rather than
# wait it out (LEASE_MS) with every cold start meanwhile
CONTROL_ID = "DESPINA_CONTROL_ID"
CONTROL_PREDECESSOR = "DESPINA_CONTROL_PREDECESSOR"


class Child:
    def __init__(self, role: str, env: dict[str, str], name: str, cpus: frozenset[int] | None = None,
                 nice: int = 0) -> None:
        self.role, self.env, self.name = role, env, name
        self.cpus = cpus  # None: wherever this process may run
        self.nice = nice
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.started = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-m", "despina", self.role], env=self.env,
                                        preexec_fn=child_setup(self.cpus, self.nice), process_group=0)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        if self.alive():
            assert self.process
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.alive():
            assert self.process
            self.process.kill()

    def wait(self, timeout: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", self.name, timeout)
            self.process.kill()
            self.process.wait()


def worker_id(i: int) -> str:
    return f"{os.uname().nodename}-w{i}"


def control_id() -> str:
    """A control plane's id, new for each start: a restart must not pass for the one that exited."""
    return f"{os.uname().nodename}-serve{os.getpid()}-{uuid.uuid4().hex[:6]}"


def child_env(settings: Settings, **overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    for f in fields(Settings):
        value = getattr(settings, f.name)
        if value is not None:
            env[f"DESPINA_{f.name.upper()}"] = str(value)
    env.update(overrides)
    return env


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.valkey: EmbeddedValkey | None = None
        self.control: Child | None = None
        self.workers: list[Child] = []
        self.gateways: list[Child] = []
        self.shm: Registry | None = None
        self._stopping = False
        self._hurried = False  # a second signal came while draining

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        settings = self.settings
        if settings.fixed_workers is None:  # its workers are all there will be, unless it starts none
            settings = self.settings = settings.with_(fixed_workers=settings.workers > 0)
        self._check_port()
        others = self._other_cpus()
        if not settings.redis_url:
            self.valkey = EmbeddedValkey(cpus=others)
            self.valkey.start()
            settings = settings.with_(redis_url=self.valkey.url)
            log.info("embedded Valkey on %s", self.valkey.url)
        settings = settings.with_(redis_check=False)  # checked already (cli.main), or its own Valkey
        if settings.worker_health_port:  # N workers cannot share one port; serve's readiness is its gateway's
            log.warning("DESPINA_WORKER_HEALTH_PORT is for `despina worker`: serve's workers open no health "
                        "port (serve answers /readyz and /v2/health/ready on its HTTP port)")
            settings = settings.with_(worker_health_port=0)
        self.control = Child("control", child_env(settings, **{CONTROL_ID: control_id()}), "control", others)
        # sharing a core, the gateway and the worker take turns: the sooner a gateway reads what came, the
        # more requests each batch takes, and the less both spend per request (bench/RESULTS.md, 2026-12-04)
        nice = settings.worker_nice if others is None else 0
        # with --colocate gateway i runs worker i in its process (roles.colocated_worker); the rest run alone
        inside = min(settings.workers, settings.gateways) if settings.colocate else 0
        self.workers = [Child("worker", child_env(settings, DESPINA_WORKER_ID=worker_id(i)), f"worker {i}",
                              nice=nice) for i in range(inside, settings.workers)]
        many = settings.gateways > 1
        shared = settings.with_(reuse_port=many or settings.reuse_port)
        # the gateways share the server's shared memory registrations, which live as long as serve does
        self.shm = Registry.of(settings.key_prefix, settings.http_port) if settings.allow_client_shm else None
        if self.shm is not None:
            self.shm.clear()
        # (of several gateways each knows its index: each writes its own trace files)
        self.gateways = [Child("gateway", child_env(shared, DESPINA_SUPERVISED="1",
                                                    **({"DESPINA_GATEWAY_INDEX": str(i)} if many else {}),
                                                    **({"DESPINA_WORKER_ID": worker_id(i)} if i < inside
                                                       else {"DESPINA_COLOCATE": "0"})),
                               f"gateway {i}" if many else "gateway", others)
                         for i in range(settings.gateways)]
        for child in (self.control, *self.workers, *self.gateways):
            child.start()
        log.info("serving %s on http://%s with %d worker(s) and %d gateway(s)%s",
                 settings.model_repository, host_port(settings.host, settings.http_port), settings.workers,
                 settings.gateways,
                 f", {inside} worker(s) inside gateways" if inside else "")
        code = 0
        with _woken_by_signals() as wait:
            while not self._stopping:
                wait(LOOK_S)
                code = self._check_children()
                if code:
                    break
        self.shutdown()
        return code

    def _check_port(self) -> None:
        """Stop, before anything starts, where another program holds the HTTP port: gateways bound with
        SO_REUSEPORT (serve --gateways N) would otherwise share it with another serve's, each taking some
        of the connections, and a worker started against a shared Redis would join a cluster that is
        not ours until its gateway failed. (DESPINA_REUSE_PORT asks to share it on purpose.)"""
        if not self.settings.reuse_port:
            bound_socket(self.settings.host, self.settings.http_port, "serve").close()

    def _other_cpus(self) -> frozenset[int] | None:
        """With --worker-cpus, where the other processes run: the CPUs the workers leave (the workers
        pin themselves, roles.run_worker). None: anywhere."""
        if self.settings.worker_cpus is None:
            return None
        workers = parse(self.settings.worker_cpus)
        others = available() - workers
        if not others:
            log.info("the workers' CPUs (%s) are every CPU here: the other processes share them",
                     format_list(workers))
            return None
        log.info("workers on CPU %s; Valkey, control plane and gateways on CPU %s", format_list(workers),
                 format_list(others))
        return others

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if not self._stopping:
            log.info("received %s: draining", name)
            self._stopping = True
        elif not self._hurried:  # a second Ctrl-C: whoever sent it will not wait for the drain
            self._hurried = True
            log.warning("received %s again: stopping now; what is in flight is not answered", name)
            for child in (*self.gateways, *self.workers, self.control):
                if child is not None:
                    child.kill()

    def _check_children(self) -> int:
        for w in self.workers:
            if not w.alive() and not self._stopping:
                assert w.process
                if w.process.returncode == START_FAILED:  # restarted, it would say so again every second
                    log.error("%s exited with %s at its start; stopping everything", w.name, START_FAILED)
                    return START_FAILED
                log.error("%s exited with %s; restarting it", w.name, w.process.returncode)
                time.sleep(RESTART_BACKOFF_S)
                w.restarts += 1
                w.start()
        valkey = self.valkey.process if self.valkey is not None else None
        if valkey is not None and valkey.poll() is not None and not self._stopping:
            log.error("the embedded Valkey exited with %s, and the queues and the catalog with it; stopping "
                      "everything", valkey.returncode)
            return 1
        # the gateways are stateless, and the control plane takes its state back from Redis and the
        # repository: a crash is restarted, a failed start stops everything
        for child in (*self.gateways, self.control):
            if child and not child.alive() and not self._stopping:
                assert child.process
                code = child.process.returncode
                if code == START_FAILED or time.monotonic() - child.started < SETTLED_S:
                    log.error("%s exited with %s at its start; stopping everything", child.name, code)
                    return START_FAILED if code == START_FAILED else 1  # (3: it said why it could not start)
                log.error("%s exited with %s; restarting it", child.name, child.process.returncode)
                if child is self.control:  # reaped, so gone for sure: its successor takes its lease at once
                    child.env = {**child.env, CONTROL_PREDECESSOR: child.env[CONTROL_ID],
                                 CONTROL_ID: control_id()}
                child.restarts += 1
                child.start()
        return 0

    def shutdown(self) -> None:
        """Drain within one budget, drain_timeout_s (a container's stop gives a fixed time before SIGKILL:
        Kubernetes' and Docker's grace period, 30 s and 10 s by default): the gateways answer what is
        in flight, then the workers finish what they read in the time left (at least LAST_S)."""
        self._stopping = True
        deadline = time.monotonic() + self.settings.drain_timeout_s
        for g in self.gateways:
            g.terminate()
        for g in self.gateways:
            g.wait(max(deadline - time.monotonic(), LAST_S))
        for w in self.workers:
            w.terminate()
        for w in self.workers:
            w.wait(max(deadline - time.monotonic(), LAST_S))
        if self.control:
            self.control.terminate()
            self.control.wait(LAST_S)
        if self.valkey:
            self.valkey.stop()
        if self.shm is not None:
            self.shm.clear()
        log.info("stopped")


@contextlib.contextmanager
def _woken_by_signals() -> Iterator[Callable[[float], None]]:
    """A wait (at most its timeout) that a signal ends: a child's end (SIGCHLD) or a stop (SIGTERM,
    SIGINT, whose handlers are already set). Idle, the supervisor then wakes only for them, not five
    times a second."""
    read, write = os.pipe()
    for fd in (read, write):
        os.set_blocking(fd, False)
    before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    child = signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler: the byte is written

    def wait(timeout: float) -> None:
        if select.select([read], [], [], timeout)[0]:
            with contextlib.suppress(BlockingIOError):
                while os.read(read, 512):
                    pass

    try:
        yield wait
    finally:
        signal.signal(signal.SIGCHLD, child)
        signal.set_wakeup_fd(before)
        os.close(read)
        os.close(write)
