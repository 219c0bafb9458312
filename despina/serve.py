"""`despina serve`: everything on one machine, supervised.

Starts (when no Redis URL is given) an embedded Valkey, the control plane, N workers and M gateways
(sharing the HTTP port through SO_REUSEPORT when M > 1), each a child process that dies with this one.
Each role says when it is up (started.py). One that exits before it is up, at serve's start, could not
start (a taken port, a repository it cannot read, an import error): restarted, it would fail again, so
serve stops everything and exits START_FAILED. So does a role, whenever, that exits START_FAILED: it said
why it cannot go on. One that exits once up crashed, and is restarted: at once the first time, then after
a backoff that doubles with each crash within CRASH_WINDOW_S; the MAX_CRASHES-th there stops everything,
as a process supervisor gives up on a service that only crashes.
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
from .started import Listener

log = logging.getLogger("despina.serve")

# a role that crashed once up is restarted at once; crashing again within CRASH_WINDOW_S, after
# RESTART_BACKOFF_S, then twice that, and so on; its MAX_CRASHES-th crash there stops everything (a role
# that fails again at each restart is given up on within about ten seconds)
RESTART_BACKOFF_S = 1.0
CRASH_WINDOW_S = 60.0
MAX_CRASHES = 5
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
        self.listener: Listener | None = None  # this start's: whether it said it is up
        self.restarts = 0
        self.crashes: list[float] = []  # when it crashed, within CRASH_WINDOW_S
        self.restart_at: float | None = None  # its restart, waiting out its backoff

    def start(self) -> None:
        self.restart_at = None
        listener = self.listener = Listener()
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "despina", self.role],
                                            env={**self.env, **listener.env()}, pass_fds=(listener.write_fd,),
                                            preexec_fn=child_setup(self.cpus, self.nice), process_group=0)
        finally:
            listener.spawned()

    def heard(self) -> bool:
        """Whether it said it is up just now (the first time this start)."""
        if self.listener is None or self.listener.done:
            return False
        return self.listener.listen()

    def up(self) -> bool:
        """Whether this start said it is up (a byte it wrote before it died is read too)."""
        return self.listener is not None and self.listener.listen()

    def crashed(self, now: float) -> int:
        """Count a crash; how many there were within CRASH_WINDOW_S."""
        self.crashes = [t for t in self.crashes if now - t < CRASH_WINDOW_S] + [now]
        return len(self.crashes)

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


def backoff(crashes: int) -> float:
    """How long a role that crashed `crashes` times within CRASH_WINDOW_S waits for its restart."""
    return 0.0 if crashes <= 1 else RESTART_BACKOFF_S * 2 ** (crashes - 2)


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
                wait(self._next_look(), [c.listener.fd for c in self._children() if c.listener and
                                         not c.listener.done])
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

    def _children(self) -> list[Child]:
        return [*self.workers, *self.gateways, *([self.control] if self.control else [])]

    def _next_look(self) -> float:
        """How long the loop may sleep: LOOK_S, or less where a restart is due sooner."""
        due = [c.restart_at for c in self._children() if c.restart_at is not None]
        return max(0.0, min([LOOK_S, *(at - time.monotonic() for at in due)]))

    def _check_children(self) -> int:
        if self._stopping:
            return 0
        for child in self._children():
            if child.heard():
                assert child.process
                log.info("%s is up (pid %d)", child.name, child.process.pid)
            if child.alive() or child.restart_at is not None:
                continue
            code = self._judge(child)
            if code:
                return code
        valkey = self.valkey.process if self.valkey is not None else None
        if valkey is not None and valkey.poll() is not None:
            log.error("the embedded Valkey exited with %s, and the queues and the catalog with it; stopping "
                      "everything", valkey.returncode)
            return 1
        now = time.monotonic()
        for child in self._children():
            if child.restart_at is not None and child.restart_at <= now:
                if child is self.control:  # reaped, so gone for sure: its successor takes its lease at once
                    child.env = {**child.env, CONTROL_PREDECESSOR: child.env[CONTROL_ID],
                                 CONTROL_ID: control_id()}
                child.restarts += 1
                child.start()
        return 0

    def _judge(self, child: Child) -> int:
        """A role exited: schedule its restart (0), or the code serve stops everything with. The gateways
        are stateless, and the control plane and the workers take their state back from Redis and the
        repository: a crash is restarted. A start that failed is not: it would fail again."""
        assert child.process
        code = child.process.returncode
        if code == START_FAILED or not (child.up() or child.restarts):
            log.error("%s exited with %s at its start; stopping everything", child.name, code)
            return START_FAILED  # (with START_FAILED, it said why above in one line)
        crashes = child.crashed(time.monotonic())
        if crashes >= MAX_CRASHES:
            log.error("%s exited with %s, its %d%s exit within %.0f s; stopping everything", child.name, code,
                      crashes, _nth(crashes), CRASH_WINDOW_S)
            return 1
        delay = backoff(crashes)
        log.error("%s exited with %s; restarting it%s", child.name, code, f" in {delay:g} s" if delay else "")
        child.restart_at = time.monotonic() + delay
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
        for child in self._children():
            if child.listener is not None:
                child.listener.close()
        log.info("stopped")


def _nth(n: int) -> str:
    return "th" if 10 <= n % 100 < 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


@contextlib.contextmanager
def _woken_by_signals() -> Iterator[Callable[[float, list[int]], None]]:
    """A wait (at most its timeout) that a signal ends: a child's end (SIGCHLD) or a stop (SIGTERM,
    SIGINT, whose handlers are already set), or something to read on one of the descriptors given (a
    role saying it is up). Idle, the supervisor then wakes only for them, not five times a second."""
    read, write = os.pipe()
    for fd in (read, write):
        os.set_blocking(fd, False)
    before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    child = signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler: the byte is written

    def wait(timeout: float, more: list[int]) -> None:
        if read in select.select([read, *more], [], [], timeout)[0]:
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
