"""Turning a submitted body into a task spec: every reference checked, every default applied."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from typing import Any, TypeVar

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from api.problems import field_name
from api.schemas import content
from api.schemas.tasks import MAX_DELAY_SECONDS, TaskCreate
from shared.actions import tasks as task_actions
from shared.actions.tasks import Submitted
from shared.agents import versions
from shared.agents.registry import Agent, get_agent, get_registry
from shared.context_window import ContextPolicy, Policy, context_window
from shared.errors import EgressDenied, InvalidRequest, NotFound
from shared.mcp.names import covers, is_mcp_name
from shared.model_strings import Script, check_available, parse_model, script_delays_over
from shared.output_schema import check_schema
from shared.pricing import is_priced, unpriced_reason
from shared.ratelimit import rules
from shared.ratelimit.buckets import LimiterUnavailable
from shared.ratelimit.limiter import get_limiter
from shared.settings import Settings, get_settings
from shared.store.tasks import NewTask
from shared.webhooks.egress import check_url

Body = TypeVar("Body", bound=BaseModel)


def parse(raw: bytes, schema: type[Body] = TaskCreate) -> Body:  # type: ignore[assignment]
    """The request body as a TaskCreate (or ``schema``: one that extends it, or another
    body), or a RequestValidationError naming each bad field.

    Pydantic's JSON parser reads the body (it refuses NaN, Infinity and nesting past its
    recursion limit, where ``json.loads`` would raise RecursionError); the document is read
    again only when the body is invalid, to name the fields.
    """
    try:
        return schema.model_validate_json(raw or b"null")
    except ValidationError as exc:
        errors: list[Any] = list(exc.errors(include_url=False))
    document = _document(raw)
    if document is None and raw:
        unparsed = {"type": "json_invalid", "loc": (), "msg": "the body is not valid JSON"}
        errors = [e for e in errors if e["type"] == "json_invalid"] or [unparsed]
    elif document is None:
        errors = [{"type": "missing", "loc": (), "msg": "a JSON request body is required"}]
    raise RequestValidationError(
        [{**e, "loc": ("body", *e["loc"])} for e in errors], body=document
    ) from None


def submit(
    tenant_id: str, tenant_name: str, body: TaskCreate, idempotency_key: str | None
) -> Submitted:
    """The whole submission, run as one call on the thread pool: checked and rate-limited
    here, then inserted (or, for a known Idempotency-Key, the original task found) by the
    submit action, in one session."""
    spec = resolve(body, get_settings(), tenant_id=tenant_id)
    check_rate(tenant_name)
    return task_actions.submit(
        tenant_id,
        tenant_name,
        spec,
        idempotency_key=idempotency_key,
        request_hash=request_hash(body),
    )


def _document(raw: bytes) -> Any:
    """The body as plain JSON, or None when it is not JSON Python can hold."""
    try:
        return json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        return None


def check_rate(tenant: str, *, tasks: int = 1) -> None:
    """The tenant's submission limit, if one is configured: 429 with Retry-After when over.
    A batch takes one token per task, at most the bucket's whole capacity (more could never
    pass)."""
    take = rules.submission_take(tenant)
    if take is None:
        return
    if tasks != 1:
        take = dataclasses.replace(take, cost=min(tasks, take.bucket.burst))
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


def resolve(body: TaskCreate, settings: Settings, *, tenant_id: str | None = None) -> NewTask:
    """Validate what the schema cannot (names of agents, tools, models) and fill defaults;
    the tools may name ``tenant_id``'s own MCP servers too."""
    try:
        agent = get_agent(body.agent)
    except NotFound as exc:
        raise InvalidRequest("agent", str(exc)) from exc
    model = _choose_model(body, agent.model, settings=settings)
    if body.budget is not None and body.budget.max_cost_usd is not None and not is_priced(model):
        raise InvalidRequest("budget.max_cost_usd", unpriced_reason(model))
    tools = _tools(body, agent, tenant_id)
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
    approval = None
    if body.approval is not None:
        for index, name in enumerate(body.approval.tools):
            if not covers(tools, name):
                raise InvalidRequest(
                    f"approval.tools[{index}]", f"{name!r} is not a tool of this task"
                )
        approval = body.approval.model_dump(exclude_none=True)
    if not isinstance(body.input, str):
        content.check_sizes(body.input, settings)
    output_schema = body.output_schema if body.output_schema is not None else agent.output_schema
    if output_schema is not None:
        check_schema(output_schema, max_bytes=settings.output_schema_max_bytes)
    return NewTask(
        agent=agent.name,
        model=model,
        input=body.input
        if isinstance(body.input, str)
        else [m.model_dump(exclude_none=True) for m in body.input],
        instructions=body.instructions,
        tools=tools,
        model_options=body.model_options,
        max_steps=max_steps,
        budget=body.budget.model_dump(exclude_none=True) if body.budget else None,
        webhook=webhook,
        metadata=body.metadata,
        deadline_seconds=settings.task_deadline_seconds or None,
        approval=approval,
        priority=body.priority,
        run_at_ms=_run_at_ms(body),
        output_schema=output_schema,
        context=context_policy(body, agent.context, model=model, settings=settings),
        # The agent as this process defines it now is what the task runs, whatever deploy
        # the workers that run it have (shared.agents.versions).
        agent_version=versions.version_of(agent).id,
        stream=body.stream,
    )


def context_policy(
    body: TaskCreate, agent_context: dict[str, Any] | None, *, model: str, settings: Settings
) -> dict[str, Any]:
    """The task's context policy as stored: each field of its own ``context``, else of its
    agent's, else the server's policy; a summaries' model some worker can call, and room for
    the answer that leaves some of the window for the prompt."""
    given = body.context.model_dump(exclude_none=True) if body.context is not None else {}
    spec = {**(agent_context or {}), **given}
    try:
        policy = Policy(spec.get("policy") or settings.context_policy)
    except ValueError as exc:
        raise InvalidRequest("context.policy", "must be truncate, summarize or off") from exc
    summaries_model = spec.get("model")
    if summaries_model is not None:
        try:
            check_available(parse_model(summaries_model)[0], settings)
        except InvalidRequest as exc:
            raise InvalidRequest("context.model", exc.reason) from exc
    reserve = spec.get("reserve_tokens")
    window = context_window(model, settings)
    if reserve is not None and reserve >= window:
        raise InvalidRequest(
            "context.reserve_tokens",
            f"must be less than the context window of {model} ({window} tokens)",
        )
    return ContextPolicy(policy, summaries_model, reserve).as_json()


def _choose_model(body: TaskCreate, agent_model: str | None, *, settings: Settings) -> str:
    """The task's model (its own, else its agent's, else ``RATCHET_DEFAULT_MODEL``), one some
    worker can call. A task that named none is told the default is unavailable, and how to
    choose: it did not choose the model it is refused."""
    model = body.model or agent_model or settings.default_model
    provider, _ = parse_model(model)
    try:
        _check_model(provider, body, settings)
    except InvalidRequest as exc:
        if body.model or agent_model or exc.field != "model":
            raise
        raise InvalidRequest(
            "model",
            f"the task names no model, and the default ({model}, RATCHET_DEFAULT_MODEL) is "
            f"unavailable: {exc.reason}. Set `model` in the request, or RATCHET_DEFAULT_MODEL "
            "on the server",
        ) from exc
    return model


def _run_at_ms(body: TaskCreate) -> int | None:
    """When the task may start, from ``run_at`` or ``delay_seconds`` (one or neither)."""
    if body.run_at is not None and body.delay_seconds is not None:
        raise InvalidRequest("delay_seconds", "give run_at or delay_seconds, not both")
    now = time.time()
    if body.delay_seconds is not None:
        return int((now + body.delay_seconds) * 1000)
    if body.run_at is None:
        return None
    at = body.run_at.timestamp()
    if at > now + MAX_DELAY_SECONDS:
        raise InvalidRequest("run_at", "must be at most a year ahead")
    return int(at * 1000)


def mcp_problem(name: str, *, agent: str, tenant_id: str | None = None) -> str | None:
    """What is wrong with an MCP tool's name for this agent (``shared.mcp.catalog.problem``),
    loaded only when a submission names one: the MCP SDK takes a while to import."""
    from shared.mcp import catalog

    return catalog.problem(name, agent=agent, tenant_id=tenant_id)


def _tools(body: TaskCreate, agent: Agent, tenant_id: str | None) -> list[str]:
    """The task's tools: those it names (checked), else its agent's."""
    if body.tools is None:
        return _agent_tools(agent, tenant_id)
    return _check_tools(body.tools, agent, tenant_id)


def _agent_tools(agent: Agent, tenant_id: str | None) -> list[str]:
    """The agent's own tools, its MCP servers declared and open to it."""
    for name in agent.tools:
        problem = (
            mcp_problem(name, agent=agent.name, tenant_id=tenant_id) if is_mcp_name(name) else None
        )
        if problem is not None:
            raise InvalidRequest("agent", f"agent {agent.name!r} names {name!r}: {problem}")
    return list(agent.tools)


def _check_tools(requested: list[str], agent: Agent, tenant_id: str | None) -> list[str]:
    """Python tools of the agent, and tools of MCP servers open to the agent (``server.*``, or
    a tool the server lists; one that cannot be listed now is taken on trust)."""
    known, allowed = get_registry().tools, agent.tools
    for index, name in enumerate(requested):
        if is_mcp_name(name):
            if (problem := mcp_problem(name, agent=agent.name, tenant_id=tenant_id)) is not None:
                raise InvalidRequest(f"tools[{index}]", problem)
            continue
        if name not in known:
            raise InvalidRequest(f"tools[{index}]", f"unknown tool {name!r}")
        if name not in allowed:
            raise InvalidRequest(
                f"tools[{index}]", f"tool {name!r} is not one of this agent's tools"
            )
    return list(dict.fromkeys(requested))


def _check_model(provider: str, body: TaskCreate, settings: Settings) -> None:
    """A model some worker can call, and for the scripted one a script it will play."""
    check_available(provider, settings)
    if provider == "scripted" or "script" in body.model_options:  # as documented: any model
        _check_script(body, settings.scripted_max_delay_ms)


def _check_script(body: TaskCreate, max_delay_ms: int) -> None:
    try:
        script = Script.model_validate(body.model_options)
    except ValidationError as exc:
        first = exc.errors()[0]
        where, _ = field_name(["model_options", *first["loc"]])
        raise InvalidRequest(where, first["msg"]) from exc
    too_slow = script_delays_over(script, max_delay_ms)
    if too_slow is not None:
        raise InvalidRequest(
            too_slow, f"must be at most {max_delay_ms} (RATCHET_SCRIPTED_MAX_DELAY_MS)"
        )
