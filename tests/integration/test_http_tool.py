"""``http_request`` against a hostile server on loopback: the whole exchange has a deadline
(not each read), the body is read up to its cap and no further, and a ``Host`` header from the
model is not forwarded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from shared.agents.http_exchange import BODY_CAP_BYTES
from shared.agents.registry import ToolContext, get_tool, load
from shared.errors import ToolError
from shared.settings import get_settings
from tests.fakes.drip_server import DripServer
from tests.helpers import bounded

CONTEXT = ToolContext(task_id="t", tenant_id="x", call_id="1-0", idempotency_key="t:1-0")
SHORT_LIMIT_SECONDS = 1.0  # for the drips: they end only at the limit
LONG_LIMIT_SECONDS = 15.0  # for the others: they must end well before it


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[DripServer]:
    monkeypatch.setenv("RATCHET_HTTP_ALLOWED_HOSTS", "127.0.0.1")
    monkeypatch.setenv("RATCHET_TOOL_TIMEOUT_SECONDS", str(LONG_LIMIT_SECONDS))
    get_settings.cache_clear()
    with DripServer(interval=0.1) as drip:
        yield drip
    get_settings.cache_clear()


@pytest.fixture
def short_limit(server: DripServer, monkeypatch: pytest.MonkeyPatch) -> DripServer:
    monkeypatch.setenv("RATCHET_TOOL_TIMEOUT_SECONDS", str(SHORT_LIMIT_SECONDS))
    get_settings.cache_clear()
    return server


def http_request(**arguments: Any) -> Any:
    load()
    return get_tool("http_request").invoke(arguments, CONTEXT)


@pytest.mark.parametrize("path", ["/drip-body", "/drip-head"])
def test_a_server_that_drips_is_cut_off_at_the_tools_limit(
    short_limit: DripServer, path: str
) -> None:
    # A byte every 0.1 s: no read ever waits as long as the limit, so only a deadline on the
    # whole exchange ends the call.
    result, took = bounded(lambda: http_request(url=short_limit.url(path)))
    assert isinstance(result, ToolError), result
    assert f"did not complete within {SHORT_LIMIT_SECONDS:g} s" in str(result)
    assert took >= SHORT_LIMIT_SECONDS


def test_an_endless_body_is_cut_at_the_cap_without_reading_on(server: DripServer) -> None:
    result, took = bounded(lambda: http_request(url=server.url("/endless")))
    assert not isinstance(result, Exception), result
    assert result["status"] == 200
    assert result["truncated"] is True
    assert len(result["body"].encode()) == BODY_CAP_BYTES
    assert took < LONG_LIMIT_SECONDS  # cut at the cap, not at the deadline


def test_a_body_within_the_cap_is_whole_and_not_truncated(server: DripServer) -> None:
    result, _ = bounded(lambda: http_request(url=server.url("/echo")))
    assert not isinstance(result, Exception), result
    assert result["truncated"] is False
    assert json.loads(result["body"]) == {"host": server.url("").removeprefix("http://")}


def test_a_host_header_from_the_model_is_not_forwarded(server: DripServer) -> None:
    headers = {"Host": "internal.example", "X-Kept": "yes", "idempotency-key": "forged"}
    result, _ = bounded(lambda: http_request(url=server.url("/echo"), headers=headers))
    assert not isinstance(result, Exception), result
    [received] = server.requests
    assert received.headers["host"] == server.url("").removeprefix("http://")
    assert received.headers["x-kept"] == "yes"
    assert received.headers["idempotency-key"] == CONTEXT.idempotency_key
