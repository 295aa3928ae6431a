"""``/v1/schedules``: schedules that submit a task on a cron, and their listing."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas.tasks import TaskCreate


class ScheduleCreate(BaseModel):
    model_config = {"extra": "forbid"}

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    cron: str = Field(
        min_length=9,
        max_length=200,
        pattern=r"^[0-9*/,-]+( [0-9*/,-]+){4,5}$",
        description="minute hour day month weekday, and optionally a sixth field, the last: "
        "the second (`* * * * * 30` is once a minute, `*/5 * * * * *` every second of every "
        "fifth minute). Two ticks are at least `RATCHET_SCHEDULE_MIN_INTERVAL_SECONDS` apart "
        "(60 by default)",
        examples=["0 9 * * 1-5"],
    )
    timezone: str = Field("UTC", max_length=64, description="an IANA time zone")
    task: TaskCreate = Field(description="the task submitted at every tick (as POST /v1/tasks)")
    catch_up: Literal["run_once", "skip"] = Field(
        "run_once",
        description="ticks missed while the fleet was down: run the latest once, or skip",
    )


class ScheduleOut(BaseModel):
    id: str
    name: str
    cron: str
    timezone: str
    catch_up: str
    paused: bool
    next_fire_at: datetime | None
    last_fired_at: datetime | None
    last_task_id: str | None
    fired: int
    skipped: int
    last_error: str | None
    task: dict[str, Any]
    created_at: datetime


class ScheduleList(BaseModel):
    items: list[ScheduleOut]
    next_cursor: str | None = Field(None, description="the next page's ``cursor``; null: none")
