"""Triton's rate limiter (--rate-limit=execution_count): an instance runs a batch only once the resources its
instance group's `rate_limiter` names are free, and among the instances waiting for theirs the one with the
fewest executions, scaled by its priority, goes first. A worker process serves one device pool, so there is
one limiter per worker, shared by its models: a device resource is counted per device (a CPU instance's is
device 0, as in Triton), a global one once for the worker, not across workers or hosts."""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..contract.errors import ConfigError

if TYPE_CHECKING:
    from ..settings import Settings

RATE_LIMITS = ("off", "execution_count")  # Triton's --rate-limit words

# How long resources an instance gave back wait, with others waiting for them, for that instance's model to
# ask again when it has requests waiting: Triton stages such an instance again as it releases them, so that
# it competes for them by priority; here its next batch is a few turns of the event loop away.
SETTLE_S = 0.002
# ... and at least this many turns of the event loop after the time is up: a worker descheduled meanwhile (a
# busy host: another process on its core) finds the time spent when it runs again, before its model's next
# batch has taken the two turns it needs to ask; without these, the lower priority took its turn then (the
# contention test's 4:1 fell to 2.2:1 with two busy loops beside it)
SETTLE_TURNS = 8

Key = tuple[str, int | None]  # a resource: its name, and its device (None: a global resource)


@dataclass(frozen=True)
class Given:
    """One --rate-limit-resource entry: `count` copies of resource `name` on device `device` (None: on each
    device, and of a global resource)."""

    name: str
    count: int
    device: int | None = None


def parse_resources(text: str) -> tuple[Given, ...]:
    """--rate-limit-resource entries, joined by ',' as DESPINA_RATE_LIMIT_RESOURCE spells them:
    NAME:COUNT[:DEVICE] each. ValueError says which entry is wrong and why."""
    given = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError("the format is '<resource_name>:<count>:<device>' or "
                             f"'<resource_name>:<count>', got {entry!r}")
        if not all(p.isascii() and p.isdigit() for p in parts[1:]):
            raise ValueError(f"{entry!r}: the count and the device must be whole numbers, 0 or more")
        numbers = [int(p) for p in parts[1:]]
        given.append(Given(parts[0], numbers[0], numbers[1] if len(numbers) == 2 else None))
    return tuple(given)


class Slot:
    """One instance's place in the limiter: what a batch of it takes, its priority, its executions so far."""

    __slots__ = ("executions", "model", "name", "needs", "priority")

    def __init__(self, name: str, needs: dict[Key, int], priority: int) -> None:
        self.name, self.needs, self.priority = name, needs, priority
        self.model = name.split("/", 1)[0]  # (`model/instance`)
        self.executions = 0


class RateLimiter:
    """The resources of one worker, and the instances waiting for them. All on the worker's event loop."""

    def __init__(self, given: tuple[Given, ...] = ()) -> None:
        self._given = given
        self._slots: list[Slot] = []
        self._capacity: dict[Key, int] = {}
        self._held: Counter[Key] = Counter()
        # (executions x priority when it came, arrival, slot, its turn): Triton's staged instances
        self._waiting: list[tuple[int, int, Slot, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        # resources given back wait for a model (SETTLE_S, then SETTLE_TURNS)
        self._settle: asyncio.Handle | None = None
        self._settling = ""  # ... that model: another's request waits in line until it comes or time is up

    def add(self, model: str, instance: str, limiter: dict[str, Any], device: int) -> Slot | None:
        """The slot of an instance on `device` whose group has `limiter` (the config's rate_limiter); None
        when it needs no resource (it runs whenever it is free). ConfigError, in Triton's words, when a
        resource is both global and per device, or when this worker can never give it what it needs."""
        needs: dict[Key, int] = {}
        for resource in limiter.get("resources") or ():
            key = (str(resource["name"]), None if resource.get("global") else device)
            needs[key] = max(needs.get(key, 0), int(resource.get("count") or 0))
        if not needs:
            return None
        slot = Slot(f"{model}/{instance}", needs, max(1, int(limiter.get("priority") or 0)))
        slots = [*self._slots, slot]
        kinds: dict[str, set[bool]] = {}
        for name, dev in (key for s in slots for key in s.needs):
            kinds.setdefault(name, set()).add(dev is None)
        for name in (n for n, both in kinds.items() if len(both) == 2):
            raise ConfigError(f"model '{model}': resource \"{name}\" is present as both global and "
                              "device-specific resource in the model configuration")
        capacity = self._capacities(slots)
        for (name, dev), count in needs.items():
            if count > capacity[name, dev]:
                raise ConfigError(f"model '{model}': resource count for \"{name}\" is limited to "
                                  f"{capacity[name, dev]} which will prevent scheduling of one or more model "
                                  f"instances, the minimum required count is {count}")
        self._slots, self._capacity = slots, capacity
        return slot

    def remove(self, slot: Slot) -> None:
        """An unloaded instance's slot: what it asked for no longer counts toward the default counts."""
        if slot in self._slots:
            self._slots.remove(slot)
            self._capacity = self._capacities(self._slots)
            self._grant()

    def _capacities(self, slots: list[Slot]) -> dict[Key, int]:
        """Each resource's copies: as --rate-limit-resource gives them (for the device, else for every
        device; a resource named for other devices only has none here), else the most any instance needs."""
        capacity: dict[Key, int] = {}
        for slot in slots:
            for (name, device), count in slot.needs.items():
                named = [g for g in self._given if g.name == name]
                if not named:
                    capacity[name, device] = max(capacity.get((name, device), 0), count)
                    continue
                exact = [g for g in named if g.device == device]
                anywhere = [g for g in named if g.device is None]
                chosen = exact or anywhere or (named if device is None else [])
                capacity[name, device] = chosen[-1].count if chosen else 0
        return capacity

    def _fits(self, slot: Slot) -> bool:
        return all(self._held[key] + count <= self._capacity.get(key, 0) for key, count in slot.needs.items())

    def _take(self, slot: Slot) -> None:
        self._held.update(slot.needs)
        slot.executions += 1

    async def acquire(self, slot: Slot) -> None:
        """Wait for `slot`'s resources and take them; the caller releases them when its batch is done."""
        if not self._waiting and self._fits(slot):
            self._take(slot)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (slot.executions * slot.priority, next(self._arrivals), slot, turn))
        if self._settle is None:
            self._grant()
        elif slot.model == self._settling:  # the model waited for is back: all go by priority now
            self._settled()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # its turn came as it was cancelled
                self.release(slot)
            else:
                self._grant()  # (the cancelled turn is dropped there) the next may go
            raise

    def release(self, slot: Slot, again: bool = False) -> None:
        """Give `slot`'s resources back. `again`: its model has requests waiting, and will ask for them again
        at once; others waiting wait for that (SETTLE_S and SETTLE_TURNS at most) and then go by priority."""
        self._held.subtract(slot.needs)
        if again and self._waiting and self._settle is None:
            self._settle = asyncio.get_running_loop().call_later(SETTLE_S, self._settle_over, SETTLE_TURNS)
            self._settling = slot.model
            return
        self._grant()

    def _settle_over(self, turns: int) -> None:
        """The model waited for has had SETTLE_S; it gets `turns` more turns of the loop, then all go by
        priority (it coming back ends the wait at once: acquire)."""
        if turns:
            self._settle = asyncio.get_running_loop().call_soon(self._settle_over, turns - 1)
            return
        self._settled()

    def _settled(self) -> None:
        if self._settle is not None:
            self._settle.cancel()
            self._settle = None
        self._grant()

    def _grant(self) -> None:
        """Give their turn to the waiting instances in order while the first one's resources are free: as
        Triton's, one that cannot have its resources yet keeps those behind it waiting too."""
        while self._waiting:
            _, _, slot, turn = self._waiting[0]
            if turn.done():  # cancelled
                heapq.heappop(self._waiting)
                continue
            if not self._fits(slot):
                return
            heapq.heappop(self._waiting)
            self._take(slot)
            turn.set_result(None)


def limiter_of(settings: Settings) -> RateLimiter | None:
    """A worker's rate limiter as its settings ask (checked at start: Settings), None when it is off."""
    if settings.rate_limit == "off":
        return None
    return RateLimiter(parse_resources(settings.rate_limit_resource))
