"""Standard Webhooks signatures: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``.

Secrets look like ``whsec_<base64 of 24 random bytes>``; the HMAC key is the decoded part.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping, Sequence

from shared.errors import RatchetError

PREFIX = "whsec_"
DEFAULT_TOLERANCE_SECONDS = 300


class WebhookVerificationError(RatchetError):
    """The webhook's signature or timestamp does not check out."""


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(PREFIX))


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def sign(secrets_: Sequence[str], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: one signature per live secret, space-separated."""
    return " ".join(signature(s, msg_id, timestamp, body) for s in secrets_)


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_seconds: int = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> None:
    """Raise WebhookVerificationError unless one signature matches and the timestamp is fresh."""
    lowered = {k.lower(): v for k, v in headers.items()}
    try:
        msg_id = lowered["webhook-id"]
        timestamp = int(lowered["webhook-timestamp"])
        offered = lowered["webhook-signature"].split()
    except (KeyError, ValueError) as exc:
        raise WebhookVerificationError("missing or malformed webhook headers") from exc
    if abs((now if now is not None else time.time()) - timestamp) > tolerance_seconds:
        raise WebhookVerificationError("the webhook timestamp is too old or in the future")
    expected = signature(secret, msg_id, timestamp, body)
    if not any(hmac.compare_digest(expected, candidate) for candidate in offered):
        raise WebhookVerificationError("no signature matches")
