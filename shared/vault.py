"""Tenant secrets at rest: Fernet tokens under the keys of ``RATCHET_SECRETS_KEY``.

The setting holds one or more Fernet keys, comma-separated: the first encrypts, every one
decrypts. Rotating is adding a new key in front, running ``ratchet secrets reencrypt`` (every
value then decrypts with the first key alone) and dropping the old one. Without the setting
there is no vault: setting a secret, or running a tool that declares one, says so.
"""

from __future__ import annotations

from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from shared.errors import Conflict
from shared.settings import get_settings

KEY_SETTING = "RATCHET_SECRETS_KEY"


class SecretsNotConfigured(Conflict):
    """secrets are not configured: set RATCHET_SECRETS_KEY (one or more Fernet keys, the
    first encrypts)"""


class SecretUnreadable(Conflict):
    """A stored secret does not decrypt with any key of RATCHET_SECRETS_KEY."""


def parse_keys(value: str) -> list[str]:
    """The keys of a ``RATCHET_SECRETS_KEY`` value, in order; ValueError naming the first
    that is not a Fernet key (32 url-safe base64-encoded bytes)."""
    keys = [item.strip() for item in value.split(",") if item.strip()]
    for position, key in enumerate(keys, start=1):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            raise ValueError(
                f"key {position} is not a Fernet key (32 url-safe base64-encoded bytes; "
                "make one with `ratchet secrets new-key`)"
            ) from None
    return keys


@lru_cache(maxsize=4)
def _vault(keys: tuple[str, ...]) -> Vault:
    return Vault(keys)


class Vault:
    """Encrypts with the first key, decrypts with any."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._first = Fernet(keys[0])
        self._all = MultiFernet([Fernet(key) for key in keys])

    def encrypt(self, value: str) -> str:
        return self._first.encrypt(value.encode("utf-8")).decode("ascii")

    def decrypt(self, token: str, *, name: str) -> str:
        """The value; SecretUnreadable (naming the secret, never its value) if no key opens it."""
        try:
            return self._all.decrypt(token.encode("ascii")).decode("utf-8")
        except InvalidToken:
            raise SecretUnreadable(
                f"secret {name!r} does not decrypt with any key of {KEY_SETTING} (was the key "
                "it was encrypted with removed before `ratchet secrets reencrypt`?)"
            ) from None

    def under_first_key(self, token: str) -> bool:
        """Whether ``token`` already decrypts with the first key (re-encrypting it is moot)."""
        try:
            self._first.decrypt(token.encode("ascii"))
        except InvalidToken:
            return False
        return True

    def reencrypt(self, token: str) -> str:
        """``token``'s value encrypted under the first key (SecretUnreadable if no key opens it)."""
        try:
            return self._all.rotate(token.encode("ascii")).decode("ascii")
        except InvalidToken:
            raise SecretUnreadable() from None

    def moved(self, token: str) -> str | None:
        """``token`` re-encrypted under the first key, or None if it already is (so running a
        re-encryption again rewrites nothing)."""
        return None if self.under_first_key(token) else self.reencrypt(token)


def get_vault() -> Vault:
    """The vault of the current settings; SecretsNotConfigured without a key."""
    configured = get_settings().secrets_key
    if configured is None:
        raise SecretsNotConfigured()
    return _vault(tuple(parse_keys(configured.get_secret_value())))


def new_key() -> str:
    """A fresh Fernet key, for ``RATCHET_SECRETS_KEY``."""
    return Fernet.generate_key().decode("ascii")
