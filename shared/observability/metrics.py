"""Prometheus metrics. The API serves them at /metrics; each ``ratchet worker`` serves its
processes' metrics (Celery's prefork children included, through prometheus_client's
multiprocess mode) on ``RATCHET_WORKER_METRICS_PORT``.

Labels never carry secrets: scopes name models and tenants, never keys.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

tasks_submitted = Counter("ratchet_tasks_submitted_total", "Tasks accepted by POST /v1/tasks")
tasks_finished = Counter(
    "ratchet_tasks_finished_total", "Tasks that reached a terminal state", ["status"]
)
steps = Counter("ratchet_steps_total", "Steps run by workers", ["outcome"])
step_seconds = Histogram(
    "ratchet_step_duration_seconds", "Wall time of one step message", buckets=LATENCY_BUCKETS
)
model_calls = Counter("ratchet_model_calls_total", "Model provider calls", ["model", "outcome"])
model_seconds = Histogram(
    "ratchet_model_call_duration_seconds", "Model call latency", ["model"], buckets=LATENCY_BUCKETS
)
model_tokens = Counter("ratchet_model_tokens_total", "Tokens used", ["model", "kind"])
tool_calls = Counter("ratchet_tool_calls_total", "Tool calls", ["tool", "status"])
limiter_decisions = Counter(
    "ratchet_limiter_decisions_total", "Rate-limiter decisions", ["scope", "decision"]
)
limiter_wait_seconds = Counter(
    "ratchet_limiter_wait_seconds_total", "Time steps were told to wait by the limiter", ["scope"]
)
abandoned_calls = Counter(
    "ratchet_abandoned_calls_total",
    "Model and tool calls a step stopped waiting for (past their deadline, or cancelled) "
    "while they still ran",
    ["pool"],
)
tool_processes = Counter(
    "ratchet_tool_processes_total",
    "Tool processes started, and ended: killed at a call's time limit (timeout), on a cancel, "
    "past the process limit (processes), dead under a call (crashed), or replaced between "
    "calls (recycled)",
    ["event"],
)
webhook_attempts = Counter(
    "ratchet_webhook_attempts_total", "Webhook delivery attempts", ["outcome"]
)
webhook_seconds = Histogram(
    "ratchet_webhook_attempt_duration_seconds", "Webhook attempt latency", buckets=LATENCY_BUCKETS
)
