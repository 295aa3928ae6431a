"""The secrets key: a bad RATCHET_SECRETS_KEY stops a process with one line; the first key
encrypts, every key decrypts, and re-encrypting moves a value under the first."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.settings import Settings, describe_invalid
from shared.vault import SecretUnreadable, Vault, new_key

# A fixed valid key: test ids must be the same in every runner process (xdist).
VALID = "0rRJkNgqs2-xnomzlRqbUXl66hskJi9zqmCK6BQO2To="


@pytest.mark.parametrize("value", ["changethis", "changeme", f"{VALID},not-a-key"])
def test_a_placeholder_or_invalid_key_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(secrets_key=value)  # type: ignore[arg-type]
    line = describe_invalid(caught.value)
    assert line.startswith("RATCHET_SECRETS_KEY: key ")
    assert "is not a Fernet key" in line
    assert "\n" not in line
    assert value.rsplit(",", maxsplit=1)[-1] not in line  # the value itself is not echoed


def test_unset_or_empty_is_no_key() -> None:
    assert Settings(secrets_key="").secrets_key is None  # type: ignore[arg-type]
    assert Settings(secrets_key=f" {new_key()} , {new_key()} ").secrets_key is not None  # type: ignore[arg-type]


def test_the_first_key_encrypts_every_key_decrypts() -> None:
    old, new = new_key(), new_key()
    token = Vault((old,)).encrypt("value")
    rotated = Vault((new, old))
    assert rotated.decrypt(token, name="X") == "value"
    assert not rotated.under_first_key(token)
    moved = rotated.reencrypt(token)
    assert rotated.under_first_key(moved)
    assert Vault((new,)).decrypt(moved, name="X") == "value"
    with pytest.raises(SecretUnreadable, match="secret 'X' does not decrypt"):
        Vault((new,)).decrypt(token, name="X")
