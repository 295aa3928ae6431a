"""Sending webhook deliveries from the outbox, per the Standard Webhooks spec.

Each delivery is claimed before it is sent, so two messages for one delivery send it once
(unless a sender dies mid-send: then it is sent again with the same ``webhook-id``). Redirects
are not followed; the URL is re-checked against the SSRF policy at send time and the checked
address is the one connected to.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time

import httpx

from shared.errors import EgressDenied
from shared.observability import metrics
from shared.queue import enqueue_deliveries
from shared.settings import get_settings
from shared.store import outbox
from shared.store.db import transaction
from shared.store.tables import WebhookDelivery, utcnow
from shared.webhooks import deliveries as webhook_deliveries
from shared.webhooks import secrets as webhook_secrets
from shared.webhooks.egress import Destination, check_url, pinned_request
from shared.webhooks.signing import sign

log = logging.getLogger("ratchet.webhooks")
CLAIM_MS = 120_000
USER_AGENT = "Ratchet-Webhooks/1"
_local = threading.local()


def _client() -> httpx.Client:
    """One keep-alive client per thread: repeated sends to a receiver reuse the connection."""
    client: httpx.Client | None = getattr(_local, "client", None)
    if client is None:
        client = httpx.Client(
            timeout=get_settings().webhook_timeout_seconds, follow_redirects=False
        )
        _local.client = client
    return client


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def dispatch(delivery_ids: list[str]) -> None:
    """Send these deliveries from a background thread of this process, right away.

    The step that committed them does not wait; if this process dies first, the rows are
    still pending and the sweeper hands them to another worker.
    """
    global _pool  # noqa: PLW0603 - one sender pool per process, made after any fork
    if not delivery_ids:
        return
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="webhook"
            )
    for delivery_id in delivery_ids:
        _pool.submit(_deliver_logged, delivery_id)


def _deliver_logged(delivery_id: str) -> None:
    try:
        deliver(delivery_id)
    except Exception:
        log.exception("webhook delivery %s failed; the sweeper will retry it", delivery_id)


def deliver(delivery_id: str) -> str | None:
    """Try to send one delivery; returns its new status, or None if it was not ours to send."""
    settings = get_settings()
    with transaction() as session:
        delivery = webhook_deliveries.claim(session, delivery_id, claim_ms=CLAIM_MS)
        if delivery is None:
            return None
        disabled = webhook_deliveries.target_disabled(session, delivery)
        if disabled:
            webhook_deliveries.mark_disabled(session, delivery, disabled)
            return outbox.DISABLED
        secrets = webhook_secrets.signing(session, delivery.tenant_id)
    try:
        destination = check_url(
            delivery.url, allowed_hosts=settings.webhook_allowed_hosts, https_only=True
        )
    except EgressDenied as exc:
        with transaction() as session:
            webhook_deliveries.fail_permanently(
                session, delivery, f"refused by the egress policy: {exc}"
            )
        return outbox.FAILED
    result = send(delivery, destination, secrets)
    with transaction() as session:
        status, delay = webhook_deliveries.record_attempt(
            session, delivery, result, schedule=settings.webhook_retry_schedule
        )
    if status == outbox.SUPERSEDED:  # our claim ran out; another sender owns it now
        return status
    metrics.webhook_attempts.labels(outcome=status).inc()
    metrics.webhook_seconds.observe(result.latency_ms / 1000)
    if delay is not None and delay <= settings.visibility_timeout_seconds / 2:
        try:
            enqueue_deliveries([delivery.id], delay_s=delay)
        except Exception:
            log.warning("could not schedule the retry; the sweeper will", exc_info=True)
    log.info("webhook %s attempt %d: %s", delivery.id, delivery.attempts, status)
    return status


def send(
    delivery: WebhookDelivery, destination: Destination, secrets: list[str]
) -> webhook_deliveries.AttemptResult:
    """One signed POST of the delivery's payload; any outcome is an AttemptResult."""
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
    try:
        response = pinned_request(
            _client(), destination, method="POST", headers=headers, content=body
        )
        status_code = response.status_code
        if not 200 <= status_code < 300:
            error = f"the receiver answered {status_code}: {response.text[:200]}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    return webhook_deliveries.AttemptResult(
        started_at=started_at,
        status_code=status_code,
        latency_ms=int((time.perf_counter() - started) * 1000),
        error=error,
    )
