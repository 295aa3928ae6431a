"""The pieces of a server's session that need no server: pinning, errors, an ended stream."""

from __future__ import annotations

import asyncio

import anyio
import httpx2
import pytest

from shared.mcp.connections import _EndWatch, _PinnedTransport, describe


def test_describe_reads_the_first_error_of_a_group() -> None:
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ConnectionError("refused\n  now")])
    assert describe(BaseExceptionGroup("outer", [group])) == "refused now"
    assert describe(TimeoutError()) == "TimeoutError"


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:2800::1"])
def test_a_pinned_transport_connects_to_the_vetted_address(address: str) -> None:
    seen: list[httpx2.Request] = []

    class Recording(_PinnedTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            # Skip the network: record what the pinning made of the request.
            original = httpx2.AsyncHTTPTransport.handle_async_request

            async def capture(_: object, req: httpx2.Request) -> httpx2.Response:
                seen.append(req)
                return httpx2.Response(200)

            httpx2.AsyncHTTPTransport.handle_async_request = capture  # type: ignore[method-assign]
            try:
                return await super().handle_async_request(request)
            finally:
                httpx2.AsyncHTTPTransport.handle_async_request = original  # type: ignore[method-assign]

    async def send() -> None:
        async with httpx2.AsyncClient(transport=Recording(address, "mcp.example.com")) as client:
            await client.post("https://mcp.example.com/mcp", json={})

    asyncio.run(send())
    [request] = seen
    assert request.url.host == address
    assert request.headers["host"] == "mcp.example.com"
    assert request.extensions["sni_hostname"] == "mcp.example.com"


def test_the_end_of_a_servers_stream_is_noticed() -> None:
    async def run() -> bool:
        send, receive = anyio.create_memory_object_stream[object](1)
        ended = asyncio.Event()
        watched = _EndWatch(receive, ended)
        await send.send("message")
        await send.aclose()
        items = [item async for item in watched]
        assert items == ["message"]
        return ended.is_set()

    assert asyncio.run(run())
