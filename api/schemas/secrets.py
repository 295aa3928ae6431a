"""``/v1/secrets``: a tenant's secrets as set and listed (names and dates, never values)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from shared.actions.secrets import MAX_VALUE_BYTES


class SecretPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str = Field(
        min_length=1,
        # Characters; the action also holds it to MAX_VALUE_BYTES of UTF-8.
        max_length=MAX_VALUE_BYTES,
        description=f"the secret's value (at most {MAX_VALUE_BYTES} bytes as UTF-8); it is "
        "never returned",
    )


class SecretOut(BaseModel):
    name: str
    created_at: datetime
    updated_at: datetime


class SecretList(BaseModel):
    items: list[SecretOut]
    next_cursor: str | None
