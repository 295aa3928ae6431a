"""The webhook sender's fair queue: deliveries waiting for a sending thread, by tenant and by
destination (a tenant's ``scheme://host:port``), taken in turn.

Tenants take turns (round-robin), and so do a tenant's destinations, so a tenant with a
thousand deliveries waiting goes no faster than one with a single delivery when both wait.
A tenant holds at most ``tenant_limit`` sends at once and a destination at most
``destination_limit``: while a tenant's receivers hang, its sends wait in the queue, and the
other tenants' sends take the free threads. The queue keeps no thread and no lock of its own:
its owner (``workers.webhook_sender``) calls it under its lock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Send:
    """One delivery taken from the queue, to be handed back with :meth:`FairQueue.done`."""

    delivery_id: str
    tenant_id: str
    destination: str


def destination_of(url: str) -> str:
    """Where a URL's requests go: ``scheme://host:port`` (the URL itself if it does not parse:
    the sender refuses it soon enough)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return url
    if not parsed.host:
        return url
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.scheme}://{parsed.host}:{port}"


class FairQueue:
    """Waiting deliveries by tenant, then by destination, each in arrival order; a delivery
    waits or is in flight at most once (adding it again changes nothing)."""

    def __init__(self, *, tenant_limit: int, destination_limit: int) -> None:
        self.tenant_limit = tenant_limit
        self.destination_limit = destination_limit
        self._waiting: OrderedDict[str, OrderedDict[str, deque[str]]] = OrderedDict()
        self._busy_tenants: Counter[str] = Counter()
        self._busy_destinations: Counter[tuple[str, str]] = Counter()
        self._known: set[str] = set()

    def __contains__(self, delivery_id: object) -> bool:
        return delivery_id in self._known

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing is in flight."""
        return not self._known

    def add(self, delivery_id: str, *, tenant_id: str, destination: str) -> bool:
        """Queue the delivery behind its destination's others; False if it is already here."""
        if delivery_id in self._known:
            return False
        self._known.add(delivery_id)
        by_destination = self._waiting.setdefault(tenant_id, OrderedDict())
        by_destination.setdefault(destination, deque()).append(delivery_id)
        return True

    def take(self) -> Send | None:
        """The next delivery to send, or None when every waiting one is held by a limit.

        The tenant and the destination it comes from go to the back of their turns."""
        for tenant_id, by_destination in self._waiting.items():
            if self._busy_tenants[tenant_id] >= self.tenant_limit:
                continue
            for destination, ids in by_destination.items():
                if self._busy_destinations[tenant_id, destination] >= self.destination_limit:
                    continue
                send = Send(ids.popleft(), tenant_id, destination)
                self._turn_over(send, emptied=not ids)
                self._busy_tenants[tenant_id] += 1
                self._busy_destinations[tenant_id, destination] += 1
                return send
        return None

    def done(self, send: Send) -> None:
        """The send is over (whatever its outcome): its limits' places are free again."""
        self._known.discard(send.delivery_id)
        self._busy_tenants[send.tenant_id] -= 1
        if not self._busy_tenants[send.tenant_id]:
            del self._busy_tenants[send.tenant_id]
        key = (send.tenant_id, send.destination)
        self._busy_destinations[key] -= 1
        if not self._busy_destinations[key]:
            del self._busy_destinations[key]

    def _turn_over(self, send: Send, *, emptied: bool) -> None:
        by_destination = self._waiting[send.tenant_id]
        if emptied:
            del by_destination[send.destination]
        else:
            by_destination.move_to_end(send.destination)
        if by_destination:
            self._waiting.move_to_end(send.tenant_id)
        else:
            del self._waiting[send.tenant_id]
