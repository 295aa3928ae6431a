"""Webhook signatures are Standard Webhooks signatures: the reference library agrees with ours.

A receiver that never heard of Ratchet checks our messages with ``standardwebhooks``; a
Ratchet client checks messages signed by that library with :func:`verify_webhook`.
"""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime

import pytest
from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as ReferenceVerificationError

from ratchet.client import WebhookVerificationError, verify_webhook
from shared.webhooks.signing import new_secret, sign, signature, verify

BODY = json.dumps(
    {"type": "task.succeeded", "timestamp": "2025-01-01T00:00:00+00:00", "data": {"id": "t1"}},
    separators=(",", ":"),
).encode()
MSG_ID = "msg_0192f1c2-delivery"
TEN_MINUTES = 600


def headers(
    secrets: list[str], *, timestamp: int | None = None, body: bytes = BODY
) -> dict[str, str]:
    at = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(at),
        "webhook-signature": sign(secrets, MSG_ID, at, body),
    }


def test_a_secret_is_whsec_and_24_random_bytes() -> None:
    secrets = {new_secret() for _ in range(20)}
    assert len(secrets) == 20
    for secret in secrets:
        assert secret.startswith("whsec_")
        assert len(base64.b64decode(secret.removeprefix("whsec_"), validate=True)) == 24


def test_the_reference_library_verifies_our_signature() -> None:
    secret = new_secret()
    assert Webhook(secret).verify(BODY, headers([secret])) == json.loads(BODY)


def test_our_signature_is_the_reference_signature() -> None:
    secret, at = new_secret(), int(time.time())
    reference = Webhook(secret).sign(MSG_ID, datetime.fromtimestamp(at, UTC), BODY.decode())
    assert signature(secret, MSG_ID, at, BODY) == reference


def test_a_tampered_body_fails_verification() -> None:
    secret = new_secret()
    sent = headers([secret])
    tampered = BODY.replace(b'"t1"', b'"t2"')
    with pytest.raises(ReferenceVerificationError):
        Webhook(secret).verify(tampered, sent)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(secret, sent, tampered)


def test_the_exact_bytes_are_signed_not_the_json_value() -> None:
    secret = new_secret()
    reformatted = json.dumps(json.loads(BODY)).encode()  # same value, other whitespace
    with pytest.raises(ReferenceVerificationError):
        Webhook(secret).verify(reformatted, headers([secret]))


@pytest.mark.parametrize("offset", [-TEN_MINUTES, TEN_MINUTES], ids=["ten-minutes-old", "future"])
def test_a_stale_timestamp_fails_verification_even_when_correctly_signed(offset: int) -> None:
    secret = new_secret()
    stale = headers([secret], timestamp=int(time.time()) + offset)
    with pytest.raises(ReferenceVerificationError, match=r"too (old|new)"):
        Webhook(secret).verify(BODY, stale)
    with pytest.raises(WebhookVerificationError, match="too old or in the future"):
        verify_webhook(secret, stale, BODY)


def test_a_moved_timestamp_breaks_the_signature() -> None:
    secret = new_secret()
    sent = headers([secret])
    moved = {**sent, "webhook-timestamp": str(int(sent["webhook-timestamp"]) + 1)}
    with pytest.raises(ReferenceVerificationError, match="No matching signature"):
        Webhook(secret).verify(BODY, moved)


def test_another_secret_fails_verification() -> None:
    sent = headers([new_secret()])
    with pytest.raises(ReferenceVerificationError):
        Webhook(new_secret()).verify(BODY, sent)
    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify_webhook(new_secret(), sent, BODY)


def test_during_rotation_both_secrets_verify_and_only_they_do() -> None:
    new, old = new_secret(), new_secret()
    sent = headers([new, old])
    assert len(sent["webhook-signature"].split(" ")) == 2
    for secret in (new, old):
        assert Webhook(secret).verify(BODY, sent) == json.loads(BODY)
        assert verify_webhook(secret, sent, BODY) == json.loads(BODY)
    with pytest.raises(ReferenceVerificationError):
        Webhook(new_secret()).verify(BODY, sent)


def test_verify_webhook_accepts_a_message_signed_by_the_reference_library() -> None:
    secret, now = new_secret(), datetime.now(UTC)
    sent = {
        "Webhook-Id": MSG_ID,  # header names are case-insensitive
        "Webhook-Timestamp": str(int(now.timestamp())),
        "Webhook-Signature": Webhook(secret).sign(MSG_ID, now, BODY.decode()),
    }
    assert verify_webhook(secret, sent, BODY) == json.loads(BODY)


@pytest.mark.parametrize(
    "missing", ["webhook-id", "webhook-timestamp", "webhook-signature"], ids=lambda m: m
)
def test_a_missing_header_fails_verification(missing: str) -> None:
    secret = new_secret()
    sent = headers([secret])
    del sent[missing]
    with pytest.raises(WebhookVerificationError, match="missing or malformed"):
        verify(secret, sent, BODY)
    with pytest.raises(ReferenceVerificationError):
        Webhook(secret).verify(BODY, sent)
