"""OpenTelemetry spans: one trace per task, a span per step, model call and tool call.

``RATCHET_TRACING`` is ``off`` (the default: spans cost nothing), ``console`` (each span
printed as JSON to stdout) or ``otlp`` (sent to a collector over OTLP/HTTP; the standard
``OTEL_EXPORTER_OTLP_*`` variables say where, ``OTEL_SERVICE_NAME`` renames the service).

A task's steps run in different processes, minutes or days apart, so no span can stay open
across them. Instead a task's trace id and its root span's id are derived from the task id:
every step span is a child of that root wherever it runs, and the worker that ends the task
emits the root span itself, from the task's creation to its end. Model-call and tool-call
spans follow the OpenTelemetry semantic conventions for generative AI (``gen_ai.*``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import AttributeValue

from shared.statuses import TaskStatus

TRACER = "ratchet"
_forced: ContextVar[tuple[int, int] | None] = ContextVar("ratchet_forced_ids", default=None)


class _TaskIds(RandomIdGenerator):
    """Random ids, except for a task's root span, whose ids come from its task id."""

    def generate_trace_id(self) -> int:
        forced = _forced.get()
        return forced[0] if forced else super().generate_trace_id()

    def generate_span_id(self) -> int:
        forced = _forced.get()
        return forced[1] if forced else super().generate_span_id()


def task_ids(task_id: str) -> tuple[int, int]:
    """The trace id and root span id of a task (never zero, which OpenTelemetry forbids)."""
    digest = hashlib.sha256(task_id.encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


def install(processor: SpanProcessor, *, service: str) -> TracerProvider:
    """Make a provider with this processor the process's (once per process)."""
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource, id_generator=_TaskIds())
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider


def configure(service: str) -> None:
    """Turn tracing on for this process as ``RATCHET_TRACING`` says (before any fork: the
    SDK's export thread is started again in each child)."""
    from shared.settings import get_settings

    mode = get_settings().tracing
    if mode == "off" or isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    exporter: SpanExporter
    if mode == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    install(BatchSpanProcessor(exporter), service=service)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def _off() -> bool:
    """Whether this process traces nothing (no SDK provider installed): then the spans below
    are skipped outright rather than made as no-ops (most of a no-op span's cost is the
    context it attaches and detaches, a few percent of a step's CPU)."""
    return not isinstance(trace.get_tracer_provider(), TracerProvider)


@contextmanager
def in_task(task_id: str) -> Iterator[None]:
    """Spans started inside are children of the task's root span."""
    if _off():
        yield
        return
    trace_id, span_id = task_ids(task_id)
    parent = SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
    try:
        yield
    finally:
        otel_context.detach(token)


def end_task(
    task_id: str, *, created_at: datetime, status: str, attributes: dict[str, int | str | float]
) -> None:
    """Emit the task's root span, from its creation until now (called once, as it ends)."""
    if _off():
        return
    token = _forced.set(task_ids(task_id))
    try:
        span = tracer().start_span(
            "ratchet.task",
            context=otel_context.Context(),  # a root, whatever is current
            kind=SpanKind.INTERNAL,
            start_time=int(created_at.timestamp() * 1e9),
            attributes={"ratchet.task_id": task_id, "ratchet.status": status, **attributes},
        )
    finally:
        _forced.reset(token)
    if status != TaskStatus.SUCCEEDED:
        span.set_status(trace.StatusCode.ERROR, status)
    span.end()


@contextmanager
def step_span(task_id: str, step: int, *, lease_epoch: int) -> Iterator[Span]:
    attributes: dict[str, AttributeValue] = {
        "ratchet.task_id": task_id,
        "ratchet.step": step,
        "ratchet.lease_epoch": lease_epoch,
    }
    if _off():
        yield trace.INVALID_SPAN
        return
    with tracer().start_as_current_span(f"ratchet.step {step}", attributes=attributes) as span:
        yield span


@contextmanager
def model_span(model: str) -> Iterator[Span]:
    """A model call (``provider:name``), as the GenAI conventions name it: ``chat <model>``."""
    provider, _, name = model.partition(":")
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.system": provider,  # the attribute's older name, still read by many backends
        "gen_ai.request.model": name or provider,
    }
    if _off():
        yield trace.INVALID_SPAN
        return
    with tracer().start_as_current_span(
        f"chat {name or provider}",
        kind=SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,  # a deferral or an ended task is not an error of the call
        set_status_on_exception=False,
    ) as span:
        yield span


@contextmanager
def tool_span(tool: str, *, call_id: str) -> Iterator[Span]:
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": tool,
        "gen_ai.tool.call.id": call_id,
    }
    if _off():
        yield trace.INVALID_SPAN
        return
    with tracer().start_as_current_span(
        f"execute_tool {tool}", kind=SpanKind.INTERNAL, attributes=attributes
    ) as span:
        yield span
