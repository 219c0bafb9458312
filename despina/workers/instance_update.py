"""Triton's in-place instance update: a reload whose config changes only the instance groups adds and removes
instances beside those serving (workers/loading.py decides when; Execution holds the instances), and how
one instance is loaded on its model's executor, at load as at an update."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..contract.errors import ConfigError, DespinaError
from ..contract.modelspec import ModelSpec
from .backends import Backend, backend_class
from .instances import matched
from .instances import plan as plan_instances
from .warmup import run as warmup
from .warmup import samples

if TYPE_CHECKING:
    from .execution import Execution

log = logging.getLogger("despina.worker")


async def loaded(executor: ThreadPoolExecutor, backend: Backend) -> None:
    """backend.load on the executor. Cancelled (the model is no longer wanted), the thread goes on
    loading the instance; what it loads is unloaded as it is done (a Python model's stub process)."""
    future = executor.submit(backend.load)
    try:
        await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        def unload(done: Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                backend.unload()
        future.add_done_callback(unload)
        raise



async def resize(ex: Execution, spec: ModelSpec, resized: Callable[[int], None]) -> None:
    """Triton's in-place instance update, to `spec`'s instance groups (its config otherwise the same): the
    instances they add are loaded and warmed up beside those serving, then serve; those they remove are
    taken out of service, each as it is free, and unloaded; the others serve on all along. `resized`
    hears the count that take requests, once the added ones do. Should an added one fail to load, those
    loaded are unloaded and nothing changed (the error is raised)."""
    if ex._retiring is not None:  # an earlier update's instances still leaving
        await asyncio.shield(ex._retiring)
    loop = asyncio.get_running_loop()
    cls = backend_class(spec.backend)
    have = [*ex.backends, *ex.standby]
    wanted = plan_instances(spec, ex.gpus, ex.threads)
    add, drop = matched([b.instance for b in have], wanted)
    executor = ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix=f"{spec.name}-")
    added: list[Backend] = []
    try:
        warmups = samples(spec, ex.path) if add else []
        for instance in add:
            backend = ex._backend(cls, spec, instance, loop)
            await loaded(executor, backend)
            added.append(backend)
            await loop.run_in_executor(executor, warmup, backend, spec, warmups)
        slots = ex._rate_limited(add, ex.gpus, spec) if ex.limiter is not None else {}
    except BaseException as exc:
        for backend in added:
            await loop.run_in_executor(executor, backend.unload)
        executor.shutdown(wait=False)
        if isinstance(exc, (DespinaError, asyncio.CancelledError)) or not isinstance(exc, Exception):
            raise
        log.exception("model %s: loading an added instance failed", spec.name)
        raise ConfigError(f"model '{spec.name}': loading failed: {exc}") from None
    old, ex.executor, ex.spec = ex.executor, executor, spec
    old.shutdown(wait=False)  # (a batch running there ends as it would)
    leaving = [have[i] for i in drop]
    for backend in added:
        if (slot := slots.get(id(backend.instance))) is not None:
            ex.slots[backend] = slot
        if backend.instance.passive:
            ex.standby.append(backend)
        else:
            ex.backends.append(backend)
            ex.instances.put_nowait(backend)
    ex.backends = [b for b in ex.backends if b not in leaving]
    ex.standby = [b for b in ex.standby if b not in leaving]
    ex.count = len(ex.backends)
    resized(ex.count)
    ex._retiring = asyncio.ensure_future(_retire(ex, leaving))
    await asyncio.shield(ex._retiring)  # cancelled, the update still ends: it owns the instances


async def _retire(ex: Execution, leaving: list[Backend]) -> None:
    """Unload the instances `leaving`, each taken out of service once it is free (the free ones that stay
    are held back meanwhile, so that it is the one taken: one batch at most)."""
    taken = [b for b in leaving if b.instance.passive]
    busy = {b for b in leaving if not b.instance.passive}
    aside: list[Backend] = []
    try:
        while busy:
            backend = await ex.instances.get()
            if backend in busy:
                busy.discard(backend)
                taken.append(backend)
            else:
                aside.append(backend)
    finally:
        for backend in aside:
            ex.instances.put_nowait(backend)
    try:
        for backend in taken:
            try:
                await asyncio.get_running_loop().run_in_executor(ex.executor, backend.unload)
            except Exception:  # the update is done all the same: the instance serves no more
                log.exception("model %s: unloading instance %s failed", ex.spec.name,
                              backend.instance.name)
            if (slot := ex.slots.pop(backend, None)) is not None:
                ex._unclaim([slot])
    finally:
        ex._retiring = None

