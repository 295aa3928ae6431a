"""Identifiers and secrets."""

from __future__ import annotations

import hashlib
import os
import secrets
import time
import uuid


def new_id() -> str:
    """A UUIDv7: random, yet ordered by creation time, so keyset pages come out newest-first."""
    millis = time.time_ns() // 1_000_000
    rand_a = int.from_bytes(os.urandom(2), "big") & 0x0FFF
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (millis & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return str(uuid.UUID(int=value))


def new_api_key() -> str:
    return "rk_" + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """API keys are 256-bit random strings, so a plain SHA-256 is a safe, fast lookup hash."""
    return hashlib.sha256(secret.encode()).hexdigest()
