"""Triton's instance groups: how many copies of a model run, and on which device each one runs."""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import replace
from typing import Generic, TypeVar

from ..contract.errors import ConfigError
from ..contract.instance_groups import resolve
from ..contract.modelspec import ModelSpec
from .backends.base import Instance

T = TypeVar("T")


def plan(spec: ModelSpec, gpu_count: int, threads: int = 1) -> list[Instance]:
    """The instances of `spec`'s instance_group on a worker that sees `gpu_count` GPUs.

    KIND_CPU: `count` on the CPU. KIND_GPU: `count` on each GPU in `gpus` (every GPU when empty); an
    error when a GPU is missing, never a silent CPU run. KIND_AUTO: as KIND_GPU when there is a GPU,
    else on the CPU. KIND_MODEL: `count` instances that place themselves. A `passive` group's instances
    are loaded and given no requests.
    """
    instances: list[Instance] = []
    for index, group in enumerate(resolve(spec, gpu_count)):
        name, count, kind, gpus = group["name"], group["count"], group["kind"], group.get("gpus") or []
        where = f"model '{spec.name}': instance_group[{index}]"
        if kind == "KIND_GPU":
            if gpu_count == 0:
                raise ConfigError(f"{where} asks for KIND_GPU, but backend '{spec.backend}' sees no GPU "
                                  "on this worker (use KIND_CPU or KIND_AUTO to run on the CPU)")
            missing = [g for g in gpus if g < 0 or g >= gpu_count]
            if missing:
                raise ConfigError(f"{where} asks for GPU {missing}, but backend '{spec.backend}' sees "
                                  f"{gpu_count} GPU(s) on this worker")
            places = [("GPU", gpu) for gpu in gpus for _ in range(count)]
        elif kind in ("KIND_CPU", "KIND_MODEL"):
            places = [("CPU" if kind == "KIND_CPU" else "MODEL", 0)] * count
        else:
            raise ConfigError(f"{where}: field 'kind' {kind} is not supported")
        passive = bool(group.get("passive", False))
        instances += [Instance(f"{name}_{i % count}", k, device, threads, passive, index)
                      for i, (k, device) in enumerate(places)]
    return instances



def matched(have: list[Instance], wanted: list[Instance]) -> tuple[list[Instance], list[int]]:
    """Triton's in-place instance update: the instances of `wanted` to add, and the indices of those of `have`
    to remove. An instance stays where one of `wanted` runs where it does (kind, device, passive), one of the
    same name first; it keeps its name."""
    left = list(range(len(have)))
    add: list[Instance] = []
    unmatched = []
    for want in wanted:  # the same instance first, then any that runs where it would
        same = next((i for i in left if have[i] == replace(want, threads=have[i].threads)), None)
        if same is None:
            unmatched.append(want)
        else:
            left.remove(same)
    for want in unmatched:
        alike = next((i for i in left if (have[i].kind, have[i].device, have[i].passive)
                      == (want.kind, want.device, want.passive)), None)
        if alike is None:
            add.append(want)
        else:
            left.remove(alike)
    return add, left


class Free(Generic[T]):
    """The instances free now, as asyncio.Queue keeps them (first put, first taken; a `get` with none
    free waits its turn), for what a batch asks of it: an asyncio.Queue's get and put are eight calls of
    Python between them, where a batch that finds an instance free makes one here."""

    __slots__ = ("_free", "_waiting")

    def __init__(self) -> None:
        self._free: deque[T] = deque()
        self._waiting: deque[asyncio.Future[None]] = deque()  # gets with none free, in the order they came

    def empty(self) -> bool:
        return not self._free

    def put_nowait(self, item: T) -> None:
        self._free.append(item)
        if self._waiting:
            self._wake_next()

    def get_nowait(self) -> T:
        return self._free.popleft()  # IndexError when none is free (Queue's QueueEmpty)

    async def get(self) -> T:
        while not self._free:  # (as asyncio.Queue.get: a get while one is free takes it at once)
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            try:
                await turn
            except BaseException:
                turn.cancel()
                with contextlib.suppress(ValueError):  # woken already: _wake_next took it off
                    self._waiting.remove(turn)
                if self._free and not turn.cancelled():  # woken for an instance: the next in line gets it
                    self._wake_next()
                raise
        return self._free.popleft()

    def _wake_next(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
