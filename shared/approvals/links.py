"""Approval links: a URL that decides one waiting call without an API key, for an email or a
chat button. The token names the task, the call and an expiry, signed with HMAC-SHA256 under
``RATCHET_APPROVAL_LINK_SECRET``; it is single-use because a call is decided once (a second
use finds it decided and changes nothing), and it stops working at its expiry (the call's
deadline). A token changed in any byte fails its signature."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from shared.errors import RatchetError
from shared.settings import get_settings


class LinkRefused(RatchetError):
    """The approval link is not valid, or has expired."""

    def __init__(self, message: str, *, expired: bool = False) -> None:
        super().__init__(message)
        self.expired = expired


@dataclass(frozen=True)
class LinkTarget:
    task_id: str
    call_id: str
    expires_ms: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(payload: str, secret: str) -> str:
    return _b64(hmac.new(secret.encode(), payload.encode(), hashlib.sha256).digest())


def enabled() -> bool:
    settings = get_settings()
    return settings.approval_link_secret is not None and settings.public_url is not None


def link(task_id: str, call_id: str, *, expires_ms: int) -> str | None:
    """The call's approval URL, or None when links are off."""
    settings = get_settings()
    if settings.approval_link_secret is None or settings.public_url is None:
        return None
    body = json.dumps({"t": task_id, "c": call_id, "e": expires_ms}, separators=(",", ":"))
    payload = _b64(body.encode())
    token = f"{payload}.{_signature(payload, settings.approval_link_secret.get_secret_value())}"
    return f"{settings.public_url.rstrip('/')}/approve/{token}"


def verify(token: str, *, now_ms: int | None = None) -> LinkTarget:
    """What a token decides; LinkRefused if it is not one this server signed, or expired."""
    secret = get_settings().approval_link_secret
    payload, _, signature = token.partition(".")
    if secret is None or not payload or not signature:
        raise LinkRefused("this approval link is not valid")
    expected = _signature(payload, secret.get_secret_value())
    if not hmac.compare_digest(expected, signature):
        raise LinkRefused("this approval link is not valid")
    try:
        data = json.loads(_unb64(payload))
        target = LinkTarget(str(data["t"]), str(data["c"]), int(data["e"]))
    except (ValueError, KeyError, TypeError):
        raise LinkRefused("this approval link is not valid") from None
    if (now_ms if now_ms is not None else int(time.time() * 1000)) >= target.expires_ms:
        raise LinkRefused("this approval link has expired", expired=True)
    return target


def wait_link(token: str) -> str | None:
    """The URL that completes the durable wait ``token`` without an API key (a POST of its
    JSON result), or None when links are off. Single-use as the wait is: a second
    completion finds it settled."""
    settings = get_settings()
    if settings.approval_link_secret is None or settings.public_url is None:
        return None
    signature = _signature(f"wait.{token}", settings.approval_link_secret.get_secret_value())
    return f"{settings.public_url.rstrip('/')}/v1/waits/{token}?signature={signature}"


def verify_wait(token: str, signature: str) -> None:
    """LinkRefused unless ``signature`` is this server's for the wait ``token``."""
    secret = get_settings().approval_link_secret
    if secret is None or not signature:
        raise LinkRefused("this wait link is not valid")
    expected = _signature(f"wait.{token}", secret.get_secret_value())
    if not hmac.compare_digest(expected, signature):
        raise LinkRefused("this wait link is not valid")
