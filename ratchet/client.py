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
tenant's schedules are made with ``create_schedule``; many tasks go in one request with
``submit_batch``, and ``batch`` follows them. A conversation is a thread: ``run`` sends
it a turn, ``thread_events`` follows all of its turns, and ``stream_text`` shows a turn's
answer as the model writes it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from shared.statuses import TERMINAL_STATUSES, Decision
from shared.webhooks.signing import WebhookVerificationError, verify

__all__ = [
    "Client",
    "Event",
    "RatchetAPIError",
    "TextPiece",
    "WebhookVerificationError",
    "verify_webhook",
]
SCHEDULES_PAGE = 100  # schedules asked for at a time (the API's most)
MESSAGES_PAGE = 200  # a thread's messages asked for at a time (the API's most)
LIVE_TYPES = ("message.delta", "message.discarded")


class RatchetAPIError(Exception):
    """The API answered with a problem (RFC 9457); ``problem`` holds its body."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(f"{status}: {problem.get('detail') or problem.get('title')}")
        self.status = status
        self.problem = problem


@dataclass(frozen=True)
class Event:
    """One event of a stream. ``id`` is as the server sent it: a seq (``"12"``), a live
    delta's ``"12.3"`` (after event 12), or on a thread's stream ``"<turn>:<seq>"``; ``seq``
    is the event's seq in its task's log (for a delta, the seq it follows)."""

    seq: int
    type: str
    data: dict[str, Any]
    id: str = ""


@dataclass(frozen=True)
class TextPiece:
    """A piece of a task's answer, from :meth:`Client.stream_text`.

    ``text`` continues step ``step``'s answer; with ``discard`` the step's text so far is
    void (its call is asked again) and the new text follows; with ``committed`` it is the
    step's whole answer as committed, which stands for every piece of that step before it.
    """

    step: int
    text: str
    discard: bool = False
    committed: bool = False


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

    def submit_batch(
        self, tasks: Sequence[Mapping[str, Any]], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Submit many tasks in one request (``POST /v1/tasks/batch``): each a submit body,
        which may carry an ``idempotency_key`` of its own. Returns ``{"batch_id", "items",
        …}``: an item per task, in order, with its ``task_id``, or the ``error`` that refused
        it (the other items go ahead)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"tasks": [dict(task) for task in tasks]}
        return self._json(self._http.post("/v1/tasks/batch", json=body, headers=headers))

    def batch(self, batch_id: str, *, wait: float | None = None) -> dict[str, Any]:
        """The batch's tasks by status (``counts``, ``tasks``, ``completed``); with ``wait``
        (≤ 60 s), long-polls until every one of them is terminal."""
        params = {"wait": wait} if wait else None
        timeout = (wait or 0) + 30
        path = f"/v1/batches/{batch_id}"
        return self._json(self._http.get(path, params=params, timeout=timeout))

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

    def events(
        self,
        task_id: str,
        *,
        after: int | str = 0,
        deltas: bool = False,
        max_reconnects: int = 10,
    ) -> Iterator[Event]:
        """The task's events, after the event id ``after`` (a seq, or a delta's ``"12.3"``),
        until the one that ends it.

        A dropped stream is resumed with ``Last-Event-ID``: every event comes exactly once.
        Only the committed events, unless ``deltas``: then a streaming model call's live
        ``message.delta`` and ``message.discarded`` events come too, between them.
        """
        path = f"/v1/tasks/{task_id}/events"
        for event in self._follow(path, str(after), max_reconnects=max_reconnects):
            if deltas or event.type not in LIVE_TYPES:
                yield event
            # The server ends the stream after the terminal event that is the task's
            # current state (a failure followed by a retry's events is not the end).

    def stream_text(self, task_id: str, *, after: int | str = 0) -> Iterator[TextPiece]:
        """The task's answer text as the model writes it, until the task ends: each live
        piece as it arrives, a ``discard`` piece when a step's call is asked again, and each
        step's ``committed`` answer once it commits (also when its call did not stream)."""
        for event in self.events(task_id, after=after, deltas=True):
            step = event.data.get("step", 0)
            if event.type == "message.delta" and event.data.get("text"):
                yield TextPiece(step, event.data["text"])
            elif event.type == "message.discarded":
                yield TextPiece(step, "", discard=True)
            elif event.type == "step.model_response" and event.data.get("content"):
                yield TextPiece(step, str(event.data["content"]), committed=True)

    def _follow(self, path: str, after: str, *, max_reconnects: int) -> Iterator[Event]:
        """The stream at ``path`` after event ``after``, resumed after a dropped connection
        from the last event seen, until the server ends it."""
        last, failures = after, 0
        while True:
            try:
                for event in self._stream(path, last):
                    last, failures = event.id, 0
                    yield event
                return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                failures += 1
                if failures > max_reconnects:
                    raise
                time.sleep(min(0.1 * 2**failures, 5.0))

    def _stream(self, path: str, after: str) -> Iterator[Event]:
        headers = {"Last-Event-ID": after, "Accept": "text/event-stream"}
        timeout = httpx.Timeout(30.0, read=60.0)
        with self._http.stream("GET", path, headers=headers, timeout=timeout) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            fields: dict[str, str] = {}
            for line in response.iter_lines():
                if not line:
                    if fields.get("id"):
                        yield _event(fields)
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

    # Sub-agents and durable waits: a task's children, and completing what a task waits for.
    CHILDREN_PAGE = 200  # a task's children asked for at a time (the API's most)

    def children(self, task_id: str) -> list[dict[str, Any]]:
        """The tasks the task's sub-agent calls started (one per call), in the order they
        started (every page). Each is a Task with ``parent_id`` and ``root_id``; its own
        ``children`` go a level down."""
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"limit": self.CHILDREN_PAGE} | ({"cursor": cursor} if cursor else {})
            page = self._json(self._http.get(f"/v1/tasks/{task_id}/children", params=params))
            items += page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return items

    def get_wait(self, token: str) -> dict[str, Any]:
        """A durable wait (``GET /v1/waits/{token}``): its ``request`` (what it waits for),
        ``status``, ``deadline`` and ``on_timeout``; once settled, its ``result``."""
        return self._json(self._http.get(f"/v1/waits/{token}"))

    def complete_wait(self, token: str, result: Any) -> dict[str, Any]:
        """Complete a durable wait with ``result`` (any JSON value), which becomes the waiting
        tool call's result; returns the wait, settled. A wait is completed once: completing
        it again (or one its deadline or a cancel settled, or one that waits for a child
        task) raises RatchetAPIError 409 and changes nothing."""
        return self._json(self._http.post(f"/v1/waits/{token}", json=result))

    @staticmethod
    def complete_wait_url(url: str, result: Any, *, timeout: float = 30.0) -> dict[str, Any]:
        """Complete a durable wait by its signed URL (a token wait's ``url`` in the Task's
        ``waiting``, its events and ``/steps``), with no API key: the URL is the credential,
        so whoever holds it (a CI system, a person's email) can answer. Returns the wait;
        raises RatchetAPIError 409 once it was settled, 404 for a signature not its own."""
        with httpx.Client(timeout=timeout) as http:
            response = http.post(url, json=result)
        if response.status_code >= 400:
            try:
                problem = response.json()
            except ValueError:
                problem = {"detail": response.text}
            raise RatchetAPIError(response.status_code, problem)
        wait: dict[str, Any] = response.json()
        return wait

    def create_thread(
        self, *, agent: str = "default", metadata: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """A new conversation with ``agent``; returns the Thread."""
        body = {"agent": agent, "metadata": dict(metadata or {})}
        return self._json(self._http.post("/v1/threads", json=body))

    def get_thread(self, thread_id: str) -> dict[str, Any]:
        """The Thread: ``status``, ``turns``, ``metadata``, ``latest_turn``, ``forked_from``."""
        return self._json(self._http.get(f"/v1/threads/{thread_id}"))

    def list_threads(
        self,
        *,
        agent: str | None = None,
        metadata: Mapping[str, str] | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """A page of the tenant's threads, newest first, of ``agent`` and whose metadata
        holds each of ``metadata``'s keys with that value: ``{"items", "next_cursor"}``."""
        params: dict[str, Any] = {"limit": limit}
        params |= {k: v for k, v in (("agent", agent), ("cursor", cursor)) if v}
        params |= {f"metadata.{key}": value for key, value in (metadata or {}).items()}
        return self._json(self._http.get("/v1/threads", params=params))

    def delete_thread(self, thread_id: str) -> None:
        """Delete the thread and its turns (a 409 while a turn is unfinished, or it has
        forks)."""
        response = self._http.delete(f"/v1/threads/{thread_id}")
        if response.status_code >= 400:
            self._json(response)

    def run(
        self,
        thread_id: str,
        input: Any,
        *,
        multitask_strategy: str = "enqueue",
        idempotency_key: str | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Send the thread a turn: ``input`` is the new message, ``options`` the rest of a
        submit body (``model``, ``model_options``, ``tools``, ``budget``, …). While a turn
        is unfinished ``multitask_strategy`` says what happens: ``enqueue``, ``reject``
        (RatchetAPIError 409), ``interrupt`` or ``rollback``. Returns the turn's Task."""
        body = {"input": input, "multitask_strategy": multitask_strategy, **options}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        path = f"/v1/threads/{thread_id}/runs"
        return self._json(self._http.post(path, json=body, headers=headers))

    def messages(self, thread_id: str) -> list[dict[str, Any]]:
        """The thread's conversation as its next turn reads it, oldest first (all pages)."""
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"limit": MESSAGES_PAGE} | ({"cursor": cursor} if cursor else {})
            page = self._json(self._http.get(f"/v1/threads/{thread_id}/messages", params=params))
            items += page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return items

    def fork_thread(
        self, thread_id: str, turn: int, *, metadata: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """A new thread whose history is the thread's turns 1..``turn``; returns it."""
        body: dict[str, Any] = {"turn": turn}
        if metadata is not None:
            body["metadata"] = dict(metadata)
        return self._json(self._http.post(f"/v1/threads/{thread_id}/fork", json=body))

    def thread_events(
        self, thread_id: str, *, after: str | None = None, max_reconnects: int = 10
    ) -> Iterator[Event]:
        """Every turn's events, turn after turn, after the event id ``after``
        (``"<turn>:<seq>"``; none: from the first turn). The stream never ends on its own:
        stop iterating when done. A dropped stream is resumed with ``Last-Event-ID``, so
        every event comes exactly once."""
        path = f"/v1/threads/{thread_id}/events"
        return self._follow(path, after or "", max_reconnects=max_reconnects)


def _event(fields: Mapping[str, str]) -> Event:
    """An SSE event from its fields; its seq from the id: ``12``, ``12.3``, ``2:12``."""
    event_id = fields["id"]
    seq = event_id.rpartition(":")[2].partition(".")[0]
    return Event(
        int(seq) if seq.isdigit() else 0,
        fields.get("event", ""),
        json.loads(fields.get("data", "{}")),
        event_id,
    )
