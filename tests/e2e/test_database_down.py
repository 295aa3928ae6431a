"""A database that goes silent (a partition, a hung proxy) holds no request for ever: every one
gets a 503 within the configured timeouts, and /healthz answers all the while.

The API reaches PostgreSQL through a TCP proxy in this test. Switched to silent, the proxy
keeps every connection open, accepts new ones, and forwards nothing: TCP itself never says
the server is gone, so only the API's own timeouts end the waits.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import DatabaseProxy

REQUESTS = 50  # more than the API's thread pool (40) and its database pool together
# Generous: the API's database timeouts are 2 s (DatabaseProxy.stack_env); a request waits for a
# pooled connection, for one (bounded) connection attempt, or for one silent statement (2 s +
# 5 s grace).
ANSWER_WITHIN_SECONDS = 60.0
HEALTHZ_WITHIN_SECONDS = 5.0


def test_a_silent_database_is_a_503_for_every_request_and_healthz_still_answers(
    stack: StackFactory, database_proxy: DatabaseProxy, tenant: TenantHandle
) -> None:
    api = stack(workers=0, env=database_proxy.stack_env())
    with api.client(headers=tenant.headers) as http:
        # Through the proxy the API works, and its pool holds connections that will go silent.
        assert http.get("/v1/tasks").status_code == 200
        database_proxy.go_silent()
        # Each reads the database (/v1/agents does not, once the API has just verified the
        # key: it is answered from the registry).
        missing = "/v1/tasks/00000000-0000-0000-0000-000000000000"
        paths = ["/v1/tasks", missing, f"{missing}/steps"]

        def call(index: int) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            response = http.get(paths[index % len(paths)], timeout=ANSWER_WITHIN_SECONDS)
            return response, time.monotonic() - started

        with ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(call, i) for i in range(REQUESTS)]
            time.sleep(1)  # every request is in; the API's threads are all waiting
            while not all(f.done() for f in futures):
                health = httpx.get(f"{api.url}/healthz", timeout=HEALTHZ_WITHIN_SECONDS)
                assert health.json() == {"status": "ok"}
                time.sleep(0.5)
            results = [f.result() for f in futures]
    for response, _ in results:
        assert response.status_code == 503, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
        assert response.json()["type"] == "urn:ratchet:problem:database-unavailable"
        assert int(response.headers["Retry-After"]) > 0
    slowest = max(elapsed for _, elapsed in results)
    print(f"{REQUESTS} requests to a silent database: slowest 503 after {slowest:.1f} s")
