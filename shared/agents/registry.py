"""Agents and tools: what a task may run. Both the API (to validate) and workers (to run) read it.

An extension module defines tools with :func:`tool` and agents with :func:`register_agent`;
``RATCHET_AGENT_MODULES`` names the modules to import.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Any, Literal, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from shared.errors import InvalidRequest, NotFound, ToolArgumentsInvalid, ToolError

UnknownOutcomePolicy = Literal["fail", "tell_model", "ask"]
Isolation = Literal["thread", "process"]
ApprovalTimeoutPolicy = Literal["reject", "approve", "fail"]
ApprovalRule = bool | Callable[[dict[str, Any]], bool]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ToolContext:
    """What a running tool may know about its call. ``idempotency_key`` is stable across re-runs."""

    task_id: str
    tenant_id: str
    call_id: str
    idempotency_key: str
    # Set when the task is cancelled while the call runs: a long tool may watch it and stop
    # early (the step has stopped waiting for it by then).
    cancelled: threading.Event = field(default_factory=threading.Event)
    # The tenant's secrets the tool declared (``@tool(secrets=…)``), by name; no others.
    secrets: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    func: Callable[..., Any]
    arguments_model: type[BaseModel]
    idempotent: bool = False
    requires_approval: ApprovalRule = False
    timeout: float | None = None
    on_unknown_outcome: UnknownOutcomePolicy = "fail"
    wants_context: bool = False
    approval_timeout: float | None = None  # seconds a decision may take (default: the setting)
    on_approval_timeout: ApprovalTimeoutPolicy | None = None
    # The most characters of a result the model reads (default: the setting).
    max_result_chars: int | None = None
    # A sub-agent: calling it starts a task of this agent (see ``agent_tool``).
    agent: str | None = None
    # Where its calls run: in a thread of the worker ("thread"), or in a killable tool
    # process ("process"); None: RATCHET_TOOL_ISOLATION.
    isolation: Isolation | None = None
    # The names of the tenant secrets its calls may read (``ToolContext.secrets``).
    secrets: tuple[str, ...] = ()

    def needs_approval(self, arguments: dict[str, Any]) -> bool:
        """Whether a person must approve this call first: always, never, or as the tool's
        predicate says about these arguments (a predicate that raises asks, to be safe)."""
        rule = self.requires_approval
        if not callable(rule):
            return bool(rule)
        try:
            return bool(rule(arguments))
        except Exception:
            return True

    @cached_property
    def parameters_schema(self) -> dict[str, Any]:
        schema = self.arguments_model.model_json_schema()
        schema.pop("title", None)
        return schema

    def validate_arguments(self, arguments: Any) -> dict[str, Any]:
        """The arguments coerced to the function's types; raises ToolArgumentsInvalid."""
        if not isinstance(arguments, dict):
            raise ToolArgumentsInvalid(f"arguments of {self.name} must be a JSON object")
        try:
            model = self.arguments_model.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ToolArgumentsInvalid(f"invalid arguments for {self.name}: {problems}") from exc
        fields = type(model).model_fields
        return {(info.alias or name): getattr(model, name) for name, info in fields.items()}

    def invoke(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        values = self.validate_arguments(arguments)
        if self.wants_context:
            values["context"] = context
        return self.func(**values)


@dataclass(frozen=True)
class Agent:
    """A named agent: its system prompt, default model, tools and step limit."""

    name: str
    system_prompt: str = ""
    model: str | None = None
    tools: tuple[str, ...] = ()
    max_steps: int | None = None
    description: str = ""
    # Its tasks' context policy, as a submission's ``context`` ({"policy": "summarize",
    # "model": …, "reserve_tokens": …}); a task's own wins, and the server's is the default.
    context: dict[str, Any] | None = None
    # The JSON Schema its final answers must meet (a task's own output_schema wins).
    output_schema: dict[str, Any] | None = None
    # Whether its tasks' model calls stream (a task's own ``stream`` wins; None: the setting).
    stream: bool | None = None
    # Its tasks' model options (a task's own win): e.g. a temperature, or the scripted
    # model's script for a sub-agent, whose tasks no client submits.
    model_options: dict[str, Any] | None = None


@dataclass
class Registry:
    tools: dict[str, Tool] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)


_registry = Registry()
_loaded: set[str] = set()
_lock = threading.Lock()


def _arguments_model(func: Callable[..., Any], name: str) -> tuple[type[BaseModel], bool]:
    signature = inspect.signature(func)
    fields: dict[str, Any] = {}
    wants_context = False
    hints = inspect.get_annotations(func, eval_str=True)
    for param in signature.parameters.values():
        if param.name == "context":
            wants_context = True
            continue
        annotation = hints.get(param.name, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        if hasattr(BaseModel, param.name):  # e.g. `json`: keep the name for the model, not pydantic
            fields[param.name + "_"] = (Annotated[annotation, Field(alias=param.name)], default)
        else:
            fields[param.name] = (annotation, default)
    model = create_model(
        f"{name}_arguments", __config__=ConfigDict(extra="forbid", populate_by_name=False), **fields
    )
    return model, wants_context


@overload
def tool(func: F) -> F: ...
@overload
def tool(
    *,
    name: str | None = None,
    idempotent: bool = False,
    requires_approval: ApprovalRule = False,
    timeout: float | None = None,
    on_unknown_outcome: UnknownOutcomePolicy | None = None,
    approval_timeout: float | None = None,
    on_approval_timeout: ApprovalTimeoutPolicy | None = None,
    max_result_chars: int | None = None,
    isolation: Isolation | None = None,
    secrets: tuple[str, ...] = (),
) -> Callable[[F], F]: ...
def tool(
    func: F | None = None,
    *,
    name: str | None = None,
    idempotent: bool = False,
    requires_approval: ApprovalRule = False,
    timeout: float | None = None,
    on_unknown_outcome: UnknownOutcomePolicy | None = None,
    approval_timeout: float | None = None,
    on_approval_timeout: ApprovalTimeoutPolicy | None = None,
    max_result_chars: int | None = None,
    isolation: Isolation | None = None,
    secrets: tuple[str, ...] = (),
) -> F | Callable[[F], F]:
    """Register a type-hinted function as a tool. Its docstring is what the model reads.

    A parameter named ``context`` receives the call's :class:`ToolContext` and is not shown
    to the model. ``idempotent`` tools are re-run after a crash left their outcome unknown;
    for the others ``on_unknown_outcome`` decides: ``fail`` the task (the default),
    ``tell_model`` that the outcome is unknown, or ``ask`` a person whether to run it again
    (approve runs it again, reject tells the model it was not).

    ``requires_approval`` (``True``, or a predicate over the call's arguments) makes each
    call wait for a person's decision; ``approval_timeout`` seconds later
    ``on_approval_timeout`` applies (``reject``, ``approve`` or ``fail`` the task; default:
    the settings ``RATCHET_APPROVAL_TIMEOUT_SECONDS`` and ``RATCHET_APPROVAL_ON_TIMEOUT``).

    ``max_result_chars`` bounds what the model reads of a result (the ledger keeps it whole;
    default: ``RATCHET_TOOL_RESULT_MAX_CHARS``).

    ``isolation="process"`` runs each call in a killable tool process instead of a thread of
    the worker (default: ``RATCHET_TOOL_ISOLATION``). ``secrets`` names the tenant secrets
    the tool may read, as ``context.secrets[NAME]``; it gets no others.
    """

    def register(fn: F) -> F:
        tool_name = name or fn.__name__
        model, wants_context = _arguments_model(fn, tool_name)
        _registry.tools[tool_name] = Tool(
            name=tool_name,
            description=inspect.cleandoc(fn.__doc__ or tool_name),
            func=fn,
            arguments_model=model,
            idempotent=idempotent,
            requires_approval=requires_approval,
            timeout=timeout,
            on_unknown_outcome=on_unknown_outcome or "fail",
            wants_context=wants_context,
            approval_timeout=approval_timeout,
            on_approval_timeout=on_approval_timeout,
            max_result_chars=max_result_chars,
            isolation=isolation,
            secrets=tuple(secrets),
        )
        return fn

    return register(func) if func is not None else register


def register_agent(agent: Agent) -> Agent:
    """Register ``agent``. Its tools are Python tools registered before it, or MCP tools
    (``<server>.<tool>``, ``<server>.*``), whose servers are checked when a task is submitted:
    they are declared in the settings, which are not read at import."""
    from shared.mcp.names import is_mcp_name

    for name in agent.tools:  # another agent (or itself) as a sub-agent
        if name not in _registry.tools and (name in _registry.agents or name == agent.name):
            _registry.tools[name] = agent_tool(_registry.agents.get(name, agent))
    missing = [n for n in agent.tools if n not in _registry.tools and not is_mcp_name(n)]
    if missing:
        raise NotFound(f"agent {agent.name!r} names unknown tool(s): {', '.join(missing)}")
    if agent.output_schema is not None:
        from shared.output_schema import MAX_AGENT_SCHEMA_BYTES, check_schema

        try:
            check_schema(agent.output_schema, max_bytes=MAX_AGENT_SCHEMA_BYTES)
        except InvalidRequest as exc:
            raise ValueError(f"agent {agent.name!r}: {exc}") from None
    if agent.context is not None:
        from shared.context_window import check_context

        try:
            check_context(agent.context)
        except ValueError as exc:
            raise ValueError(f"agent {agent.name!r}: context: {exc}") from None
    _registry.agents[agent.name] = agent
    return agent


class SubAgentArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(
        min_length=1,
        max_length=100_000,
        description="the task for the sub-agent, with everything it needs to know",
    )


def agent_tool(agent: Agent) -> Tool:
    """``agent`` as a tool of other agents: a call starts a task of it (a child of the
    calling task, once per call) and its result is the child's answer. The worker runs it
    (``workers.steps.parking``): it is never invoked in a tool thread."""

    def run_in_worker(**_: Any) -> Any:
        raise ToolError(f"sub-agent {agent.name!r} runs as a child task, not as a function")

    description = agent.description or f"Hand a task to the {agent.name} agent."
    return Tool(
        name=agent.name,
        description=f"{description} (A sub-agent: it works on the task on its own and "
        "answers with its result.)",
        func=run_in_worker,
        arguments_model=SubAgentArguments,
        idempotent=True,  # its child is keyed by the call: a second start finds the first
        agent=agent.name,
    )


def load(modules: Iterable[str] = ()) -> Registry:
    """Import the built-in tools and agents and every extra module, once each."""
    with _lock:
        for module in ("shared.agents.builtin_tools", *modules):
            if module not in _loaded:
                importlib.import_module(module)
                _loaded.add(module)
    return _registry


def get_registry() -> Registry:
    from shared.settings import get_settings

    return load(get_settings().agent_modules)


def get_agent(name: str) -> Agent:
    agent = get_registry().agents.get(name)
    if agent is None:
        raise NotFound(f"no agent named {name!r}")
    return agent


def get_tool(name: str, *, agent: str = "default") -> Tool:
    """The tool named ``name``: a Python tool, or a tool of an MCP server (``<server>.<tool>``)
    that tasks of ``agent`` may use."""
    found = get_registry().tools.get(name)
    if found is None and "." in name:
        from shared.mcp.catalog import resolve

        found = resolve([name], agent=agent).get(name)
    if found is None:
        raise NotFound(f"no tool named {name!r}")
    return found
