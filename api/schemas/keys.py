"""``/v1/admin/keys``: API keys as created, rotated and listed."""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from shared.store import tenants
from shared.store.tables import utcnow
from shared.store.tenants import MAX_ROTATION_GRACE

MAX_LIFETIME_SECONDS = 10 * 365 * 24 * 3600


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=100)
    scopes: list[str] = Field(default_factory=lambda: list(tenants.DEFAULT_SCOPES), min_length=1)
    expires_at: AwareDatetime | None = None
    expires_in_seconds: int | None = Field(None, gt=0, le=MAX_LIFETIME_SECONDS)

    @model_validator(mode="after")
    def _one_expiry(self) -> KeyCreate:
        if self.expires_at is not None and self.expires_in_seconds is not None:
            raise ValueError("give expires_at or expires_in_seconds, not both")
        return self

    def expiry(self) -> datetime | None:
        if self.expires_in_seconds is not None:
            return utcnow() + timedelta(seconds=self.expires_in_seconds)
        return self.expires_at


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_seconds: int = Field(
        0,
        ge=0,
        le=int(MAX_ROTATION_GRACE.total_seconds()),
        description="how long the old key keeps working (default: it stops at once)",
    )


class KeyOut(BaseModel):
    id: str
    prefix: str
    name: str | None
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="the API key itself: shown this once, never again")


class KeyList(BaseModel):
    items: list[KeyOut]
    next_cursor: str | None
