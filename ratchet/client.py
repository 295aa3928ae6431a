"""A small typed client for Ratchet's HTTP API.

    from ratchet.client import Client

    with Client("http://127.0.0.1:8000", api_key) as ratchet:
        task = ratchet.submit({"input": "What is 6*7?"}, idempotency_key="order-42")
        done = ratchet.wait(task["id"], timeout=120)
        print(done["result"])

``wait`` follows the task's event stream and resumes it after a dropped connection from the
last event seen; if streaming keeps failing it falls back to long-polling. Receivers of
webhooks check them with :func:`verify_webhook` (or the ``standardwebhooks`` package). A
tool call that waits for a person is decided with ``approve`` (or ``edit``, ``reject``); a
tenant's schedules are made with ``create_schedule``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from shared.statuses import TERMINAL_STATUSES, Decision
from shared.webhooks.signing import WebhookVerificationError, verify

__all__ = ["Client", "Event", "RatchetAPIError", "WebhookVerificationError", "verify_webhook"]
SCHEDULES_PAGE = 100  # schedules asked for at a time (the API's most)


class RatchetAPIError(Exception):
    """The API answered with a problem (RFC 9457); ``problem`` holds its body."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(f"{status}: {problem.get('detail') or problem.get('title')}")
        self.status = status
        self.problem = problem


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    data: dict[str, Any]


def verify_webhook(
    secret: str, headers: Mapping[str, str], body: bytes, *, tolerance_seconds: int = 300
) -> dict[str, Any]:
    """Check a webhook's signature and freshness; return its parsed body.

    Raises WebhookVerificationError if it was not signed with ``secret`` or is too old.
    """
    verify(secret, headers, body, tolerance_seconds=tolerance_seconds)
    payload: dict[str, Any] = json.loads(body)
    return payload


class Client:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _json(self, response: httpx.Response) -> dict[str, Any]:
        if response.status_code >= 400:
            try:
                problem = response.json()
            except ValueError:
                problem = {"detail": response.text}
            raise RatchetAPIError(response.status_code, problem)
        body: dict[str, Any] = response.json()
        return body

    def submit(
        self, task: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Submit a task (the body of ``POST /v1/tasks``); returns the queued Task."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json(self._http.post("/v1/tasks", json=dict(task), headers=headers))

    def get(self, task_id: str, *, wait: float | None = None) -> dict[str, Any]:
        """The Task; with ``wait`` (≤ 60 s), long-polls for a terminal state."""
        params = {"wait": wait} if wait else None
        timeout = (wait or 0) + 30
        return self._json(self._http.get(f"/v1/tasks/{task_id}", params=params, timeout=timeout))

    def list_tasks(
        self,
        *,
        status: str | None = None,
        agent: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """A page of the tenant's tasks, newest first: ``{"items": [...], "next_cursor": ...}``."""
        params: dict[str, Any] = {"limit": limit}
        params |= {k: v for k, v in (("status", status), ("agent", agent), ("cursor", cursor)) if v}
        return self._json(self._http.get("/v1/tasks", params=params))

    def cancel(self, task_id: str) -> dict[str, Any]:
        return self._json(self._http.post(f"/v1/tasks/{task_id}/cancel"))

    def retry(self, task_id: str) -> dict[str, Any]:
        return self._json(self._http.post(f"/v1/tasks/{task_id}/retry"))

    def fork(
        self,
        task_id: str,
        from_step: int,
        *,
        idempotency_key: str | None = None,
        **changes: Any,
    ) -> dict[str, Any]:
        """A new task holding the task's steps 1..``from_step`` as they were committed, which
        goes on with ``changes`` (``model``, ``model_options``, ``instructions``, ``tools``,
        ``input``, ``tool_results``, …: the body of ``POST /v1/tasks/{id}/fork``); returns
        the queued fork, whose ``forked_from`` names the task."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"from_step": from_step, **changes}
        return self._json(self._http.post(f"/v1/tasks/{task_id}/fork", json=body, headers=headers))

    def create_schedule(self, schedule: Mapping[str, Any]) -> dict[str, Any]:
        """Create a schedule (the body of ``POST /v1/schedules``: ``name``, ``cron``,
        ``timezone``, ``task``, ``catch_up``); returns it, with its next tick."""
        return self._json(self._http.post("/v1/schedules", json=dict(schedule)))

    def schedules(self) -> list[dict[str, Any]]:
        """Every schedule of the key's tenant, by name (all pages)."""
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"limit": SCHEDULES_PAGE} | ({"cursor": cursor} if cursor else {})
            page = self._json(self._http.get("/v1/schedules", params=params))
            items += page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return items

    def pause_schedule(self, schedule_id: str) -> dict[str, Any]:
        """No tick fires until it is resumed; returns the schedule."""
        return self._json(self._http.post(f"/v1/schedules/{schedule_id}/pause"))

    def resume_schedule(self, schedule_id: str) -> dict[str, Any]:
        """It fires again from its next tick after now; returns the schedule."""
        return self._json(self._http.post(f"/v1/schedules/{schedule_id}/resume"))

    def delete_schedule(self, schedule_id: str) -> None:
        """Delete the schedule; the tasks it fired stay."""
        response = self._http.delete(f"/v1/schedules/{schedule_id}")
        if response.status_code >= 400:
            self._json(response)

    def approve(
        self,
        task_id: str,
        call_id: str,
        *,
        decision: str = "approve",
        arguments: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """Decide a tool call that waits for a person (``pending_approval`` of the task):
        ``approve``, ``edit`` (run it with ``arguments`` instead) or ``reject`` (it never runs;
        the model reads ``reason``). Returns the decision as stored, with the task.

        A decision is made once: the same one again answers with the stored decision
        (``replayed``); a different one raises RatchetAPIError 409, as does deciding for a
        task that no longer waits; a call that does not wait is a 404, a bad edit a 422.
        """
        body: dict[str, Any] = {"decision": decision}
        if arguments is not None:
            body["arguments"] = dict(arguments)
        if reason is not None:
            body["reason"] = reason
        return self._json(self._http.post(f"/v1/tasks/{task_id}/approvals/{call_id}", json=body))

    def edit(
        self,
        task_id: str,
        call_id: str,
        *,
        arguments: Mapping[str, Any],
        reason: str | None = None,
    ) -> dict[str, Any]:
        """Approve a waiting call to run with ``arguments`` instead of the model's."""
        return self.approve(
            task_id, call_id, decision=Decision.EDIT, arguments=arguments, reason=reason
        )

    def reject(self, task_id: str, call_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Reject a waiting call: it never runs, and the model reads ``reason``."""
        return self.approve(task_id, call_id, decision=Decision.REJECT, reason=reason)

    def steps(self, task_id: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"cursor": cursor} if cursor else None
            page = self._json(self._http.get(f"/v1/tasks/{task_id}/steps", params=params))
            items += page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return items

    def events(self, task_id: str, *, after: int = 0, max_reconnects: int = 10) -> Iterator[Event]:
        """The task's events, from ``after`` on, until the one that ends it.

        A dropped stream is resumed with ``Last-Event-ID``: every event comes exactly once.
        Only the committed events: a streaming model call's live ``message.delta`` events
        (whose ids are not seqs) are passed over.
        """
        last, failures = after, 0
        while True:
            try:
                for event in self._stream(task_id, last):
                    last, failures = event.seq, 0
                    yield event
                # The server ends the stream after the terminal event that is the task's
                # current state (a failure followed by a retry's events is not the end).
                return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                failures += 1
                if failures > max_reconnects:
                    raise
                time.sleep(min(0.1 * 2**failures, 5.0))

    def _stream(self, task_id: str, after: int) -> Iterator[Event]:
        headers = {"Last-Event-ID": str(after), "Accept": "text/event-stream"}
        timeout = httpx.Timeout(30.0, read=60.0)
        with self._http.stream(
            "GET", f"/v1/tasks/{task_id}/events", headers=headers, timeout=timeout
        ) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            fields: dict[str, str] = {}
            for line in response.iter_lines():
                if not line:
                    if fields.get("id", "").isdigit():
                        yield Event(
                            int(fields["id"]),
                            fields.get("event", ""),
                            json.loads(fields.get("data", "{}")),
                        )
                    fields = {}
                elif not line.startswith(":"):
                    name, _, value = line.partition(":")
                    fields[name] = value.removeprefix(" ")

    def wait(self, task_id: str, *, timeout: float = 600.0) -> dict[str, Any]:
        """Block until the task is terminal and return it: SSE first, long-polling if not."""
        deadline = time.monotonic() + timeout
        try:
            for _ in self.events(task_id, max_reconnects=3):
                if time.monotonic() > deadline:
                    break
        except (httpx.TransportError, httpx.RemoteProtocolError):
            pass  # fall back to long-polling below
        while True:
            left = deadline - time.monotonic()
            task = self.get(task_id, wait=max(1.0, min(60.0, left)))
            if task["status"] in TERMINAL_STATUSES:
                return task
            if left <= 0:
                raise TimeoutError(f"task {task_id} is still {task['status']}")
