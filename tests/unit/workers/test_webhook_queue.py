"""The webhook sender's fair queue: tenants and their destinations take turns, and no tenant
or destination holds more sends than its limit."""

from __future__ import annotations

import pytest

from workers.webhook_queue import FairQueue, Send, destination_of


def queue(tenant_limit: int = 4, destination_limit: int = 2) -> FairQueue:
    return FairQueue(tenant_limit=tenant_limit, destination_limit=destination_limit)


def take_all(fair: FairQueue) -> list[Send]:
    taken = []
    while (send := fair.take()) is not None:
        taken.append(send)
    return taken


def test_a_tenant_with_a_backlog_takes_turns_with_one_that_has_a_single_delivery() -> None:
    fair = queue(tenant_limit=100, destination_limit=100)
    for n in range(50):
        fair.add(f"a{n}", tenant_id="A", destination="https://a:443")
    fair.add("b0", tenant_id="B", destination="https://b:443")

    first_two = {fair.take(), fair.take()}

    assert {s.delivery_id for s in first_two if s} == {"a0", "b0"}


def test_no_tenant_or_destination_holds_more_sends_than_its_limit() -> None:
    fair = queue(tenant_limit=3, destination_limit=2)
    for n in range(10):
        for host in ("x", "y", "z"):
            fair.add(f"{host}{n}", tenant_id="A", destination=f"https://{host}:443")

    taken = take_all(fair)

    assert len(taken) == 3
    assert max(sum(s.destination == d for s in taken) for d in {s.destination for s in taken}) <= 2
    fair.done(taken[0])
    assert fair.take() is not None  # a freed place is taken again
    assert fair.take() is None


def test_a_delivery_is_queued_once_until_its_send_is_done() -> None:
    fair = queue()
    assert fair.add("d", tenant_id="A", destination="https://a:443")
    assert not fair.add("d", tenant_id="A", destination="https://a:443")
    [send] = take_all(fair)
    assert not fair.add("d", tenant_id="A", destination="https://a:443")  # in flight
    fair.done(send)
    assert fair.idle
    assert fair.add("d", tenant_id="A", destination="https://a:443")


@pytest.mark.parametrize(
    ("url", "destination"),
    [
        ("https://example.com/hooks", "https://example.com:443"),
        ("http://127.0.0.1:8080/a?b=c", "http://127.0.0.1:8080"),
        ("https://EXAMPLE.com:8443/x", "https://example.com:8443"),
        ("not a url at all ::", "not a url at all ::"),
    ],
)
def test_a_destination_is_the_scheme_host_and_port(url: str, destination: str) -> None:
    assert destination_of(url) == destination
