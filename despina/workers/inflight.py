"""What a worker knows of the requests each gateway has in flight, for "nothing can join this batch".

Every request entry a gateway writes says how many requests for that model version the gateway had out
and not yet answered (IN_FLIGHT, the entry's own included), and the last entry of its reply stream it had
read (SEEN). A worker counts, per gateway (its reply stream), the requests it has read from it and not
yet answered. Those open here are a lower bound of what the gateway still counted when it wrote its
latest entry (a request unanswered now was unanswered then). So are the requests this worker answered in
reply entries after SEEN: the gateway had not read those answers, it still counted their requests. When
no gateway counted more than the two together, the rest of their requests are all here: the next one any
of them sends is a new arrival, and a batch waiting for company waits for nothing.

Replies are only taken into account where requests are read in the order gateways wrote them (one
stream, `replies=True`): an entry read out of order could say SEEN of a reply to a request it never
counted.
"""
from __future__ import annotations

from collections import deque

from ..contract.keys import IN_FLIGHT, SEEN

StreamId = tuple[int, int]
UNREAD_KEPT = 64       # reply entries kept per gateway, newest: a gateway that stopped reading forgets
GATEWAYS_KEPT = 256    # gateways whose unread replies are kept (a gateway gone leaves its replies unread)


def stream_id(raw: bytes | str | None) -> StreamId | None:
    """A stream entry id as (milliseconds, sequence), which orders as the stream does; None if it is not
    one."""
    if raw is None:
        return None
    try:
        ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
        return int(ms), int(seq or 0)
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None


class Gateways:
    __slots__ = ("open", "announced", "unread", "_replies")

    def __init__(self, replies: bool = False) -> None:
        self.open: dict[str, int] = {}       # gateway -> its requests read here and not yet answered
        # gateway -> what its latest entry said, IN_FLIGHT and SEEN (while any of its requests is open)
        self.announced: dict[str, tuple[int, StreamId | None]] = {}
        # gateway -> the reply entries written here after its latest SEEN: (entry id, requests answered)
        self.unread: dict[str, deque[tuple[StreamId, int]]] = {}
        self._replies = replies

    def __bool__(self) -> bool:
        return bool(self.open)

    def announce(self, gateway: str, fields: dict[bytes, bytes]) -> None:
        """Note what an entry of the gateway's said; an entry that says nothing (a redelivered one, an
        older gateway's) leaves what was said before."""
        raw = fields.get(IN_FLIGHT)
        if raw is None:
            return
        try:
            count = int(raw)
        except ValueError:
            self.announced.pop(gateway, None)  # not a count: as if it had never said anything
            return
        seen = stream_id(fields.get(SEEN)) if self._replies else None
        self.announced[gateway] = (count, seen)
        unread = self.unread.get(gateway)
        if unread is not None:
            if seen is None:  # it does not say what it read: none of them can be counted
                del self.unread[gateway]
                return
            while unread and unread[0][0] <= seen:
                unread.popleft()
            if not unread:
                del self.unread[gateway]

    def opened(self, gateway: str) -> None:
        self.open[gateway] = self.open.get(gateway, 0) + 1

    def closed(self, gateway: str) -> None:
        """One of the gateway's requests is answered; with none left open, what it said is forgotten."""
        if self.open[gateway] > 1:
            self.open[gateway] -= 1
        else:
            del self.open[gateway]
            self.announced.pop(gateway, None)

    def replied(self, gateway: str, entry_id: bytes | str, requests: int) -> None:
        """This worker wrote a reply entry answering `requests` of the gateway's requests."""
        if not self._replies:
            return
        at = stream_id(entry_id)
        if at is None:
            return
        said = self.announced.get(gateway)
        if said is not None and said[1] is not None and at <= said[1]:
            return  # read already
        unread = self.unread.get(gateway)
        if unread is None:
            if len(self.unread) >= GATEWAYS_KEPT:
                del self.unread[next(iter(self.unread))]
            unread = self.unread[gateway] = deque(maxlen=UNREAD_KEPT)
        unread.append((at, requests))

    def all_here(self) -> bool:
        """Whether every gateway with a request open here said it had no more in flight than that and
        its unread answers from here (one that said nothing counts as having more)."""
        announced, unread = self.announced, self.unread
        for gateway, n in self.open.items():
            said = announced.get(gateway)
            if said is None:
                return False
            count = said[0]
            if count > n:
                answered = unread.get(gateway)
                if answered is None or said[1] is None or count > n + sum(k for _, k in answered):
                    return False
        return True
