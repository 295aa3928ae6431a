"""Sending webhook deliveries from the outbox, per the Standard Webhooks spec, fairly between
tenants and receivers.

Each delivery is claimed before it is sent, so two messages for one delivery send it once
(unless a sender dies mid-send: then it is sent again with the same ``webhook-id``). Redirects
are not followed; the URL is re-checked against the SSRF policy at send time and the checked
address is the one connected to.

Fairness: a worker process sends on ``RATCHET_WEBHOOK_SENDER_THREADS`` threads, fed by a
:class:`~workers.webhook_queue.FairQueue` that the tenants take in turn, each tenant holding at
most ``RATCHET_WEBHOOK_TENANT_CONCURRENCY`` sends and each of its receivers at most
``RATCHET_WEBHOOK_DESTINATION_CONCURRENCY``. An attempt has ``RATCHET_WEBHOOK_TIMEOUT_SECONDS``
in all, connecting and reading the whole answer included: a receiver that never answers, or
drips its answer a byte at a time, holds a thread no longer than that. An endpoint whose
attempts keep failing has its circuit opened (``shared.webhooks.circuits``): its deliveries
are put off without a request until one probe succeeds.

Both the step that committed a delivery and the broker's message for it (a retry, the
sweeper's, a redelivery) only hand its id to this process's sender and return: the row is the
truth, so a process that dies with ids queued leaves them pending, and the sweeper hands them
out again.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Iterable

import httpcore
import httpx
from sqlalchemy.orm import Session

from shared.errors import EgressDenied
from shared.observability import metrics
from shared.queue import enqueue_deliveries
from shared.settings import get_settings
from shared.store import outbox
from shared.store.db import transaction
from shared.store.outbox import DeliveryStatus
from shared.store.tables import WebhookDelivery, utcnow
from shared.webhooks import circuits
from shared.webhooks import deliveries as webhook_deliveries
from shared.webhooks import secrets as webhook_secrets
from shared.webhooks.egress import Destination, check_url, pinned_request
from shared.webhooks.signing import sign
from workers.providers.base import tls_context
from workers.webhook_queue import FairQueue, Send, destination_of

log = logging.getLogger("ratchet.webhooks")
CLAIM_MS = 120_000
USER_AGENT = "Ratchet-Webhooks/1"
# Read of a receiver's answer, head and body: past it the attempt fails. Only the first 200
# characters are kept; the cap keeps a receiver that streams megabytes from filling memory.
MAX_ANSWER_BYTES = 1_048_576
ROUTE_BATCH = 500  # ids looked up in one query when they are queued
_local = threading.local()


# --- an attempt's whole-request deadline ---------------------------------------------------------


class _Deadline:
    """One thread's current attempt: when it must be over, and how much of the answer was read."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.read = 0

    def start(self, seconds: float) -> None:
        self.at, self.read = time.monotonic() + seconds, 0

    def left(self, timeout: float | None, expired: type[Exception]) -> float | None:
        """The time an operation may take: its own timeout, within what is left of the attempt."""
        if self.at is None:
            return timeout
        left = self.at - time.monotonic()
        if left <= 0:
            raise expired("the attempt's deadline passed")
        return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write ends within its attempt's deadline."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: _Deadline) -> None:
        self._stream = stream
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = self._stream.read(max_bytes, self._deadline.left(timeout, httpcore.ReadTimeout))
        self._deadline.read += len(data)
        if self._deadline.read > MAX_ANSWER_BYTES:
            raise httpcore.ReadError(f"the answer is longer than {MAX_ANSWER_BYTES} bytes")
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, self._deadline.left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = self._deadline.left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self._stream.start_tls(ssl_context, server_hostname, left), self._deadline
        )

    def get_extra_info(self, info: str) -> object:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.SyncBackend):
    """Connections that keep to the deadline of the attempt in progress on their thread."""

    def __init__(self, deadline: _Deadline) -> None:
        self._deadline = deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        left = self._deadline.left(timeout, httpcore.ConnectTimeout)
        stream = super().connect_tcp(host, port, left, local_address, socket_options)
        return _DeadlineStream(stream, self._deadline)


def _client() -> tuple[httpx.Client, _Deadline]:
    """One keep-alive client per thread (repeated sends to a receiver reuse the connection),
    with the deadline its attempts keep to."""
    found: tuple[httpx.Client, _Deadline] | None = getattr(_local, "client", None)
    if found is None:
        deadline = _Deadline()
        transport = httpx.HTTPTransport()
        # httpx takes no network backend of its own: its pool is made again with one (the
        # same settings as httpx's defaults), whose connections keep to the deadline.
        transport._pool = httpcore.ConnectionPool(
            ssl_context=tls_context(),  # the process's one: not one per sending thread
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=_DeadlineBackend(deadline),
        )
        client = httpx.Client(
            transport=transport,
            timeout=get_settings().webhook_timeout_seconds,
            follow_redirects=False,
        )
        found = _local.client = (client, deadline)
    return found


# --- the process's sender: threads taking from the fair queue ---------------------------------


class Sender:
    """This process's sending threads and the fair queue they take from. Ids handed to it are
    looked up (tenant and URL) by a sending thread, in batches, then queued."""

    def __init__(self, *, threads: int, queue: FairQueue) -> None:
        self._threads = threads
        self._queue = queue
        self._inbox: list[str] = []
        self._routing = 0  # threads looking up ids taken from the inbox
        self._lock = threading.Condition()
        self._started = False

    def submit(self, delivery_ids: Iterable[str]) -> None:
        """Queue these deliveries for sending (one already queued or in flight is not added)."""
        with self._lock:
            self._inbox.extend(i for i in delivery_ids if i not in self._queue)
            self._start()
            self._lock.notify_all()

    def wait_for_sends(self) -> None:
        """Block until nothing is queued or being sent."""
        with self._lock:
            while self._inbox or self._routing or not self._queue.idle:
                self._lock.wait(timeout=0.1)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        for number in range(self._threads):
            threading.Thread(target=self._run, name=f"webhook-{number}", daemon=True).start()

    def _run(self) -> None:
        while True:
            send = self._take()
            try:
                attempt(send.delivery_id)
            except Exception:
                log.exception(
                    "webhook delivery %s failed; the sweeper will retry it", send.delivery_id
                )
            finally:
                with self._lock:
                    self._queue.done(send)
                    self._lock.notify_all()

    def _take(self) -> Send:
        with self._lock:
            while True:
                send = self._queue.take()
                if send is not None:
                    return send
                if self._inbox:
                    batch, self._inbox = self._inbox[:ROUTE_BATCH], self._inbox[ROUTE_BATCH:]
                    self._routing += 1
                    self._lock.release()
                    try:
                        routes = _routes(batch)
                    finally:
                        self._lock.acquire()
                        self._routing -= 1
                    self._queue_routed(batch, routes)
                    continue
                self._lock.wait()

    def _queue_routed(self, batch: list[str], routes: dict[str, tuple[str, str]]) -> None:
        for delivery_id in batch:
            if delivery_id in routes:
                tenant_id, url = routes[delivery_id]
                self._queue.add(delivery_id, tenant_id=tenant_id, destination=destination_of(url))
        self._lock.notify_all()


def _routes(batch: list[str]) -> dict[str, tuple[str, str]]:
    try:
        with transaction() as session:
            return webhook_deliveries.routes(session, batch)
    except Exception:
        log.exception("could not look up %d webhook deliveries; the sweeper will", len(batch))
        return {}


_sender: Sender | None = None
_sender_lock = threading.Lock()


def get_sender() -> Sender:
    """This process's sender, made (with its threads) on first use: after any fork."""
    global _sender  # noqa: PLW0603 - one sender per process
    with _sender_lock:
        if _sender is None:
            settings = get_settings()
            queue = FairQueue(
                tenant_limit=settings.webhook_tenant_concurrency,
                destination_limit=settings.webhook_destination_concurrency,
            )
            _sender = Sender(threads=settings.webhook_sender_threads, queue=queue)
        return _sender


def deliver(delivery_id: str) -> None:
    """A broker message's part (a retry, the sweeper's, a redelivery): hand the delivery to
    this process's sender and return, so the message holds no worker while it is sent."""
    dispatch([delivery_id])


def dispatch(delivery_ids: list[str]) -> None:
    """Send these deliveries from this process's sending threads, fairly, without waiting.

    The caller (a step that committed them, a broker message for them) does not wait; if this
    process dies first, the rows are still pending and the sweeper hands them to another.
    """
    if delivery_ids:
        get_sender().submit(delivery_ids)


def wait_for_sends() -> None:
    """Block until this process's sender has nothing queued or in flight (none made: at once)."""
    if _sender is not None:
        _sender.wait_for_sends()


# --- one attempt ----------------------------------------------------------------------------------


def attempt(delivery_id: str) -> str | None:
    """Try to send one delivery now, on this thread; returns its new status, or None if it
    was not ours to send (not due, or claimed by another sender).

    An endpoint whose circuit is open is not sent to: the delivery is put off (``pending``,
    its ``last_error`` saying why) on its retry schedule, and no request goes out.
    """
    schedule = get_settings().webhook_retry_schedule
    with transaction() as session:
        delivery = webhook_deliveries.claim(session, delivery_id, claim_ms=CLAIM_MS)
        if delivery is None:
            return None
        disabled = webhook_deliveries.target_disabled(session, delivery)
        if disabled:
            webhook_deliveries.mark_disabled(session, delivery, disabled)
            return DeliveryStatus.DISABLED
        held_until = _circuit_hold(session, delivery)
        if held_until is None:
            secrets = webhook_secrets.signing(session, delivery.tenant_id)
        else:
            status, delay = webhook_deliveries.defer(
                session, delivery, until_ms=held_until, schedule=schedule
            )
    if held_until is None:
        return _send_and_record(delivery, secrets)
    _schedule_retry(delivery, delay)
    log.info("webhook %s attempt %d: %s (circuit open)", delivery.id, delivery.attempts, status)
    return status


def _circuit_hold(session: Session, delivery: WebhookDelivery) -> int | None:
    """Until when the delivery's endpoint's circuit holds it back (None: send it now)."""
    if not delivery.endpoint_id:
        return None  # a task's own webhook URL has no endpoint row to keep a circuit on
    # A probe's sender that died is taken over once its claim on the delivery has run out.
    probe_ms = int(get_settings().webhook_timeout_seconds * 1000) + CLAIM_MS
    return circuits.admit(session, delivery.endpoint_id, probe_ms=probe_ms)


def _send_and_record(delivery: WebhookDelivery, secrets: list[str]) -> str:
    """Send the claimed delivery (unless the egress policy now refuses its URL) and record
    the outcome."""
    settings = get_settings()
    try:
        destination = check_url(
            delivery.url, allowed_hosts=settings.webhook_allowed_hosts, https_only=True
        )
    except EgressDenied as exc:
        with transaction() as session:
            webhook_deliveries.fail_permanently(
                session, delivery, f"refused by the egress policy: {exc}"
            )
        return DeliveryStatus.FAILED
    result = send(delivery, destination, secrets)
    with transaction() as session:
        status, delay = webhook_deliveries.record_attempt(
            session, delivery, result, schedule=settings.webhook_retry_schedule
        )
    if status == outbox.SUPERSEDED:  # our claim ran out; another sender owns it now
        return status
    metrics.webhook_attempts.labels(outcome=status).inc()
    metrics.webhook_seconds.observe(result.latency_ms / 1000)
    _schedule_retry(delivery, delay)
    log.info("webhook %s attempt %d: %s", delivery.id, delivery.attempts, status)
    return status


def _schedule_retry(delivery: WebhookDelivery, delay: float | None) -> None:
    """A broker message for the next try, when it is soon; a later one is the sweeper's."""
    if delay is None or delay > get_settings().visibility_timeout_seconds / 2:
        return
    try:
        enqueue_deliveries([delivery.id], delay_s=delay)
    except Exception:
        log.warning("could not schedule the retry; the sweeper will", exc_info=True)


def send(
    delivery: WebhookDelivery, destination: Destination, secrets: list[str]
) -> webhook_deliveries.AttemptResult:
    """One signed POST of the delivery's payload, over within ``RATCHET_WEBHOOK_TIMEOUT_SECONDS``
    in all; any outcome is an AttemptResult."""
    body = json.dumps(delivery.payload, separators=(",", ":")).encode()
    msg_id = f"msg_{delivery.id}"
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secrets, msg_id, timestamp, body),
    }
    started_at, started = utcnow(), time.perf_counter()
    status_code: int | None = None
    error: str | None = None
    client, deadline = _client()
    deadline.start(get_settings().webhook_timeout_seconds)
    try:
        response = pinned_request(client, destination, method="POST", headers=headers, content=body)
        status_code = response.status_code
        if not 200 <= status_code < 300:
            error = f"the receiver answered {status_code}: {response.text[:200]}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        deadline.at = None
    return webhook_deliveries.AttemptResult(
        started_at=started_at,
        status_code=status_code,
        latency_ms=int((time.perf_counter() - started) * 1000),
        error=error,
    )
