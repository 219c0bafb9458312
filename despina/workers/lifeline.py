"""A worker's heartbeat kept while a batch holds its event loop. A batch expected to be short runs on the
loop (execution.py), and one its model's cost did not foresee holds the loop, and the heartbeat with it
(presence.py): past DESPINA_WORKER_TTL_S the control plane took the worker for dead while it was working,
moved its models (503s meanwhile) and requeued what it had read, to be run twice. A thread of the worker
renews the heartbeat's expiry then, and only then: while the loop is late with its heartbeat and is inside
a batch's call. A worker that stopped, or whose loop is held by anything else, still expires; so does one
whose batch holds its loop past DESPINA_VISIBILITY_TIMEOUT_S, after which its requests are taken for their
consumer's dead anyway (workers/sweep.py)."""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from types import FrameType

import redis
from redis.exceptions import RedisError

from .. import logs
from ..contract.keys import Keys
from ..redis_client import connect_sync, trouble
from ..settings import Settings
from .execution import timed

log = logging.getLogger("despina.worker")

# What the loop's thread may be inside, however long, doing the worker's work: a batch run on the loop.
# Looked for in the loop's stack by the thread, so that the batches pay nothing for it (W1 runs ~10k a
# second on the loop).
WORK = frozenset({timed.__code__})


class Lifeline:
    """Renews the expiry of the worker's heartbeat hash and of its mark (presence.py's HEARTBEAT) while a
    batch holds the loop; never writes them, so that a worker that left, or whose keys Redis lost, is not
    brought back. The loop sets `beaten` after each heartbeat it writes."""

    def __init__(self, settings: Settings, keys: Keys, worker_id: str, beat_s: float) -> None:
        self.url, self.id, self.beat_s = settings.redis_url, worker_id, beat_s
        self.hash, self.mark = keys.worker(worker_id), keys.worker_mark(worker_id)
        self.ttl_ms, self.mark_ms = int(settings.worker_ttl_s * 1000), int(settings.reply_ttl_s * 1000)
        self.limit_s = settings.visibility_timeout_s
        self.beaten = time.monotonic()  # when the loop last wrote the heartbeat
        self._loop_thread = 0

    async def run(self) -> None:
        """Watch the loop from a thread until cancelled; the thread has ended when this returns."""
        if self.url is None:  # (a worker made with a client of its own, in tests)
            return
        self._loop_thread = threading.get_ident()
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(stop,), name="despina-lifeline", daemon=True)
        thread.start()
        try:
            await asyncio.Future()
        finally:
            stop.set()
            await asyncio.to_thread(thread.join)  # at most one renewal on its way (SYNC_TIMEOUT_S)

    def _watch(self, stop: threading.Event) -> None:
        assert self.url is not None
        client: redis.Redis | None = None  # connected the first time a batch holds the loop
        failed = logs.Throttled(log)
        told = gave_up = 0.0  # the heartbeat of the hold last said to be renewed, to be left to expire
        # the batch's call the loop was in at the last look, while late: one and the same call at two looks
        # has held the loop for half a beat at least. (A busy loop runs many short batches, and a look at
        # the moment a heartbeat was a little late found one of them: it renewed, and warned, for nothing.)
        seen: FrameType | None = None
        try:
            while not stop.wait(self.beat_s / 2):
                beaten = self.beaten
                held = time.monotonic() - beaten
                if held < self.beat_s:
                    seen = None  # (not kept: its locals are the batch's tensors)
                    continue
                working, seen = seen, self._working()
                if working is None or working is not seen:
                    continue
                if held > self.limit_s:
                    if gave_up != beaten:
                        gave_up = beaten
                        log.warning("worker %s: a batch has held its event loop for %.0f s, past "
                                    "DESPINA_VISIBILITY_TIMEOUT_S: its heartbeat is left to expire", self.id,
                                    held)
                    continue
                if told != beaten:
                    told = beaten
                    log.warning("worker %s: a batch holds its event loop (%.1f s so far): its heartbeat's "
                                "expiry is renewed from a thread meanwhile", self.id, held)
                try:
                    client = client or connect_sync(self.url)
                    self._renew(client)
                    failed.recovered("worker %s: renewing its heartbeat's expiry works again", self.id)
                except (RedisError, OSError) as exc:
                    failed.log("worker %s: renewing its heartbeat's expiry: %s", self.id, trouble(exc))
                except Exception:  # a bug: logged, and the thread goes on watching
                    log.exception("worker %s: renewing its heartbeat's expiry", self.id)
        finally:
            if client is not None:
                client.close()

    def _working(self) -> FrameType | None:
        """The batch's call the loop's thread is inside now, if it is."""
        frame = sys._current_frames().get(self._loop_thread)
        while frame is not None:
            if frame.f_code in WORK:
                return frame
            frame = frame.f_back
        return None

    def _renew(self, client: redis.Redis) -> None:
        # PEXPIRE of a missing key does nothing: a hash deleted as the worker left, or lost with Redis's data
        # (the loop's next heartbeat finds its mark missing and says so), stays missing
        pipe = client.pipeline(transaction=False)
        pipe.pexpire(self.hash, self.ttl_ms)
        pipe.pexpire(self.mark, self.mark_ms)
        pipe.execute()
