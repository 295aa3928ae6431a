"""A task's limits: its budget (tokens, cost), checked with each model answer, and its step
count and deadline, checked before each model call. A task may use all of a limit; only going
past it ends the task."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.agents.registry import Agent
from tests.unit.builders import CLOCK_MS, lease_on, task_state
from workers.providers import ModelRequest
from workers.providers.base import DEFAULT_MAX_TOKENS
from workers.steps import model
from workers.steps.context import Context
from workers.steps.model import budget_before_call, budget_exceeded, check_limits

# --- budget_exceeded -----------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, {}, {"max_tokens": None, "max_cost_usd": None}])
def test_a_task_without_a_budget_is_never_over_it(budget: dict[str, Any] | None) -> None:
    task = task_state(budget=budget, input_tokens=10**9, output_tokens=10**9, cost_usd=10**6)
    assert budget_exceeded(task, 10**9, 10**6) is None


def test_a_task_may_use_its_token_budget_exactly() -> None:
    task = task_state(budget={"max_tokens": 100}, input_tokens=60, output_tokens=30)
    assert budget_exceeded(task, 10, 0.0) is None


def test_one_token_past_the_budget_ends_the_task_and_says_by_how_much() -> None:
    task = task_state(budget={"max_tokens": 100}, input_tokens=60, output_tokens=30)
    assert budget_exceeded(task, 11, 0.0) == "the task used 101 tokens, over its budget of 100"


@given(
    used_in=st.integers(0, 10**6),
    used_out=st.integers(0, 10**6),
    tokens=st.integers(0, 10**6),
    max_tokens=st.integers(1, 3 * 10**6),
)
def test_the_token_budget_counts_every_token_so_far_input_and_output(
    used_in: int, used_out: int, tokens: int, max_tokens: int
) -> None:
    task = task_state(
        budget={"max_tokens": max_tokens}, input_tokens=used_in, output_tokens=used_out
    )
    over = budget_exceeded(task, tokens, 0.0)
    assert (over is not None) == (used_in + used_out + tokens > max_tokens)


def test_a_task_may_spend_its_cost_budget_exactly_and_not_a_cent_more() -> None:
    task = task_state(budget={"max_cost_usd": 2.0}, cost_usd=1.5)
    assert budget_exceeded(task, 0, 0.5) is None
    assert budget_exceeded(task, 0, 0.51) == "the task cost $2.0100, over its budget of $2.0"


def test_costs_that_add_up_to_the_budget_exactly_are_not_over_it() -> None:
    # 0.1 + 0.2 is 0.30000000000000004 in floating point: still exactly the budget.
    task = task_state(budget={"max_cost_usd": 0.3}, cost_usd=0.1)
    assert budget_exceeded(task, 0, 0.2) is None
    assert budget_exceeded(task, 0, 0.2001) is not None


def test_only_the_limits_a_budget_sets_apply() -> None:
    tokens_only = task_state(budget={"max_tokens": 100})
    cost_only = task_state(budget={"max_cost_usd": 1.0})
    assert budget_exceeded(tokens_only, 100, 10**6) is None
    assert budget_exceeded(cost_only, 10**9, 1.0) is None


def test_over_both_limits_the_token_limit_is_the_reason_given() -> None:
    task = task_state(budget={"max_tokens": 10, "max_cost_usd": 0.01})
    over = budget_exceeded(task, 11, 1.0)
    assert over is not None
    assert over.startswith("the task used 11 tokens")


# --- check_limits: max_steps and the deadline, before each model call ----------------------------


class Failed(Exception):
    """The task failed: raised where the step would write the failure and end."""


@pytest.fixture
def failures(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The error types the step failed its task with. The failing write is stood in for:
    these tests are about the decision only."""
    failed: list[str] = []

    def fail(ctx: Context, error_type: str, message: str, **detail: Any) -> None:
        failed.append(error_type)
        raise Failed(message)

    monkeypatch.setattr(model, "fail", fail)
    return failed


def context(*, step: int, max_steps: int = 20, deadline_ms: int | None, clock_ms: int) -> Context:
    task = task_state(steps=step - 1, max_steps=max_steps, deadline_ms=deadline_ms)
    return Context(
        lease=lease_on(task),
        task=task,
        agent=Agent("a"),
        tools={},
        history=[],
        step_row=None,
        calls={},
        tenant_name="tenant",
        clock_ms=clock_ms,
    )


def test_the_last_allowed_step_runs_up_to_the_deadline_itself(failures: list[str]) -> None:
    check_limits(context(step=20, max_steps=20, deadline_ms=CLOCK_MS, clock_ms=CLOCK_MS))
    assert failures == []


def test_a_step_past_max_steps_fails_the_task(failures: list[str]) -> None:
    with pytest.raises(Failed, match=r"max_steps \(20\)"):
        check_limits(context(step=21, max_steps=20, deadline_ms=None, clock_ms=CLOCK_MS))
    assert failures == ["max_steps_exceeded"]


def test_a_step_a_millisecond_past_the_deadline_fails_the_task(failures: list[str]) -> None:
    with pytest.raises(Failed):
        check_limits(context(step=1, deadline_ms=CLOCK_MS, clock_ms=CLOCK_MS + 1))
    assert failures == ["deadline_exceeded"]


@pytest.mark.parametrize("clock_ms", [0, CLOCK_MS, 2**62])
def test_a_task_without_a_deadline_never_runs_out_of_time(
    failures: list[str], clock_ms: int
) -> None:
    check_limits(context(step=1, deadline_ms=None, clock_ms=clock_ms))
    assert failures == []


# --- budget_before_call --------------------------------------------------------------------------


def _request(**options: Any) -> ModelRequest:
    return ModelRequest(
        task_id="task-1",
        step=2,
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "hello"}],
        tools=[],
        options=options,
    )


def test_no_budget_and_the_scripted_model_are_never_stopped_before_a_call() -> None:
    assert (
        budget_before_call(task_state(budget=None, model="openai:gpt-4o-mini"), _request()) is None
    )
    scripted = task_state(budget={"max_tokens": 1}, model="scripted")
    assert budget_before_call(scripted, _request()) is None


def test_the_worst_case_is_the_prompt_and_all_the_answer_may_use() -> None:
    """1,000 tokens used; the next call's prompt (a few tokens) and up to 500 for the answer:
    within a budget of 1,600, past one of 1,500."""
    task = task_state(model="openai:gpt-4o-mini", input_tokens=800, output_tokens=200)
    roomy = replace_budget(task, {"max_tokens": 1600})
    assert budget_before_call(roomy, _request(max_tokens=500)) is None
    tight = replace_budget(task, {"max_tokens": 1500})
    reason = budget_before_call(tight, _request(max_tokens=500))
    assert reason is not None
    assert "up to 500 for the answer" in reason


def test_without_max_tokens_the_answer_may_use_the_default() -> None:
    task = task_state(model="openai:gpt-4o-mini", budget={"max_tokens": DEFAULT_MAX_TOKENS})
    reason = budget_before_call(task, _request())
    assert reason is not None
    assert f"up to {DEFAULT_MAX_TOKENS}" in reason


def test_a_cost_budget_is_checked_at_the_worst_cost() -> None:
    # gpt-4o-mini: 1,000 answer tokens at $0.60 per million is $0.0006.
    task = task_state(model="openai:gpt-4o-mini", budget={"max_cost_usd": 0.001}, cost_usd=0.0005)
    reason = budget_before_call(task, _request(max_tokens=1000))
    assert reason is not None
    assert "$0.001" in reason
    spent_less = task_state(model="openai:gpt-4o-mini", budget={"max_cost_usd": 0.001})
    assert budget_before_call(spent_less, _request(max_tokens=1000)) is None


def replace_budget(task: Any, budget: dict[str, Any]) -> Any:
    copy = task_state(**vars(task))
    copy.budget = budget
    return copy
