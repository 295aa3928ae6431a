"""Turning a submitted body into a task spec: every reference checked, every default applied."""

from __future__ import annotations

import hashlib
import json
import math

from fastapi import HTTPException
from pydantic import ValidationError

from api.problems import field_name
from api.schemas import TaskCreate
from shared import limits
from shared.egress import check_url
from shared.errors import EgressDenied, InvalidRequest, NotFound
from shared.providers import Script, parse_model
from shared.rate_limiter import LimiterUnavailable, get_limiter
from shared.registry import get_agent, get_registry
from shared.settings import Settings
from shared.task_store import NewTask


def check_rate(tenant: str) -> None:
    """The tenant's submission limit, if one is configured: 429 with Retry-After when over."""
    take = limits.submission_take(tenant)
    if take is None:
        return
    try:
        decision = get_limiter().acquire([take])
    except LimiterUnavailable as exc:
        raise HTTPException(503, "the rate limiter is unavailable; try again shortly") from exc
    if not decision.allowed:
        retry_after = max(1, math.ceil(decision.retry_after_ms / 1000))
        raise HTTPException(
            429,
            f"tenant {tenant!r} is over its submission limit; retry in {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )


def request_hash(body: TaskCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def resolve(body: TaskCreate, settings: Settings) -> NewTask:
    """Validate what the schema cannot (names of agents, tools, models) and fill defaults."""
    try:
        agent = get_agent(body.agent)
    except NotFound as exc:
        raise InvalidRequest("agent", str(exc)) from exc
    model = body.model or agent.model or settings.default_model
    provider, _ = parse_model(model)
    if provider == "scripted":
        _check_script(body)
    tools = list(agent.tools) if body.tools is None else _check_tools(body.tools, agent.tools)
    max_steps = body.max_steps or agent.max_steps or settings.default_max_steps
    if max_steps > settings.max_steps_limit:
        raise InvalidRequest("max_steps", f"must be at most {settings.max_steps_limit}")
    webhook = None
    if body.webhook is not None:
        try:
            check_url(
                str(body.webhook.url), allowed_hosts=settings.webhook_allowed_hosts, https_only=True
            )
        except EgressDenied as exc:
            raise InvalidRequest("webhook.url", str(exc)) from exc
        webhook = body.webhook.model_dump(mode="json")
    return NewTask(
        agent=agent.name,
        model=model,
        input=body.input if isinstance(body.input, str) else [m.model_dump() for m in body.input],
        instructions=body.instructions,
        tools=tools,
        model_options=body.model_options,
        max_steps=max_steps,
        budget=body.budget.model_dump(exclude_none=True) if body.budget else None,
        webhook=webhook,
        metadata=body.metadata,
        deadline_seconds=settings.task_deadline_seconds or None,
    )


def _check_tools(requested: list[str], allowed: tuple[str, ...]) -> list[str]:
    known = get_registry().tools
    for index, name in enumerate(requested):
        if name not in known:
            raise InvalidRequest(f"tools[{index}]", f"unknown tool {name!r}")
        if name not in allowed:
            raise InvalidRequest(
                f"tools[{index}]", f"tool {name!r} is not one of this agent's tools"
            )
    return list(dict.fromkeys(requested))


def _check_script(body: TaskCreate) -> None:
    try:
        Script.model_validate(body.model_options)
    except ValidationError as exc:
        first = exc.errors()[0]
        where, _ = field_name(["model_options", *first["loc"]])
        raise InvalidRequest(where, first["msg"]) from exc
