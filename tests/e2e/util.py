"""Helpers for tests that talk to a running stack over HTTP."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from tests.helpers import TERMINAL

LONG_POLL_SECONDS = 10.0


def wait_all(
    client: httpx.Client,
    headers: Mapping[str, str] | None,
    ids: Iterable[str],
    timeout: float = 60.0,
) -> dict[str, dict[str, Any]]:
    """Long-poll (``GET /v1/tasks/{id}?wait=N``) until every task is terminal; return them by id.

    Tasks are polled round-robin, so one stuck task does not hide the others' progress. Past
    ``timeout`` it fails with a count of the unfinished tasks by status.
    """
    deadline = time.monotonic() + timeout
    pending = deque(dict.fromkeys(ids))
    seen: dict[str, dict[str, Any]] = {}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            statuses = Counter(seen[i]["status"] if i in seen else "unseen" for i in pending)
            example = seen.get(pending[0])
            raise AssertionError(
                f"{len(pending)} task(s) not terminal after {timeout} s: {dict(statuses)}; "
                f"for example {example}"
            )
        wait = round(min(LONG_POLL_SECONDS, remaining), 1)
        task_id = pending.popleft()
        response = client.get(
            f"/v1/tasks/{task_id}",
            params={"wait": wait},
            headers=dict(headers or {}),
            timeout=wait + 10,
        )
        assert response.status_code == 200, f"GET /v1/tasks/{task_id}: {response.text}"
        seen[task_id] = response.json()
        if seen[task_id]["status"] not in TERMINAL:
            pending.append(task_id)
    return seen
