"""What a worker knows of the requests each gateway has in flight, for "nothing can join this batch".

Every request entry a gateway writes says how many requests for that model version the gateway had out
and not yet answered (IN_FLIGHT, the entry's own included). A worker counts, per gateway (its reply
stream), the requests it has read from it and not yet answered. Those open here are a lower bound of
what the gateway still counted when it wrote its latest entry (a request unanswered now was unanswered
then), so when no gateway counted more than are open here, the rest of their requests are all here:
the next one any of them sends is a new arrival, and a batch waiting for company waits for nothing.
"""
from __future__ import annotations

from ..contract.keys import IN_FLIGHT


class Gateways:
    __slots__ = ("open", "announced")

    def __init__(self) -> None:
        self.open: dict[str, int] = {}       # gateway -> its requests read here and not yet answered
        self.announced: dict[str, int] = {}  # gateway -> what its latest entry said (while any is open)

    def __bool__(self) -> bool:
        return bool(self.open)

    def announce(self, gateway: str, fields: dict[bytes, bytes]) -> None:
        """Note what an entry of the gateway's said; an entry that says nothing (a redelivered one, an
        older gateway's) leaves what was said before."""
        raw = fields.get(IN_FLIGHT)
        if raw is None:
            return
        try:
            self.announced[gateway] = int(raw)
        except ValueError:
            self.announced.pop(gateway, None)  # not a count: as if it had never said anything

    def opened(self, gateway: str, n: int = 1) -> None:
        self.open[gateway] = self.open.get(gateway, 0) + n

    def closed(self, gateway: str, n: int = 1) -> None:
        """`n` of the gateway's requests are answered; with none left open, what it said is forgotten."""
        if self.open[gateway] > n:
            self.open[gateway] -= n
        else:
            del self.open[gateway]
            self.announced.pop(gateway, None)

    def all_here(self) -> bool:
        """Whether every gateway with a request open here said it had no more in flight than that (one
        that said nothing counts as having more)."""
        announced = self.announced
        return all(announced.get(gateway, n + 1) <= n for gateway, n in self.open.items())
