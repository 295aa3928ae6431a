"""Write prediction: the task row a fenced write leaves, known before the database answers.

``predict`` must agree with the SET clause the write runs (``assignments`` of its shape, bound
with ``params_of``); values on the database clock stay symbolic (``FromNow``) until ``settle``
puts the clock in. The value helpers (progress, release, terminal, usage) are checked through
the prediction, as the step runner sees them.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.sql import visitors
from sqlalchemy.sql.elements import BindParameter

from shared.statuses import TERMINAL_STATUSES, TaskStatus, in_order
from shared.store import ledger
from shared.store.batch import Increment
from shared.store.db import now_ms
from shared.store.fenced import (
    FIELDS,
    TASKS,
    FromNow,
    assignments,
    params_of,
    predict,
    settle,
    shape_of,
    state_of,
)
from shared.store.leases import next_lease
from shared.store.ledger import CallStatus
from shared.store.step_write import (
    progress_values,
    release_values,
    terminal_values,
    usage_values,
)
from shared.store.tables import Task, ToolCall
from tests.unit.builders import CLOCK_MS, CREATED, TTL_MS, db_row, lease_on, task_state

LATER_MS = CLOCK_MS + 1_234  # the database clock when a later write commits


def settled(task: Any, changes: dict[str, Any], *, clock_ms: int = LATER_MS) -> Any:
    """The row as a write of ``changes`` leaves it, once the database has answered."""
    state = predict(task, changes)
    settle(state, db_row(clock_ms=clock_ms, last_event_seq=task.last_event_seq))
    return state


def apply_set_clause(task: Any, changes: dict[str, Any], *, clock_ms: int) -> dict[str, Any]:
    """What the database does with a write: each column of its shape, from its bound value."""
    params, row = params_of(changes), {name: getattr(task, name) for name in FIELDS}
    for key, kind in shape_of(changes):
        bound = params[f"b_{key}"]
        if kind == "inc":
            row[key] += bound
        elif kind == "now":
            row[key] = clock_ms + bound
        else:
            row[key] = bound
    return row


# --- predict, state_of, settle -------------------------------------------------------------------


def test_state_of_copies_every_column_and_is_independent_of_the_original() -> None:
    task = task_state(steps=4, meta={"k": "v"})
    copy = state_of(task)
    assert {name: getattr(copy, name) for name in FIELDS} == vars(task)
    copy.steps = 99
    assert task.steps == 4


def test_predict_sets_only_the_columns_written_and_leaves_the_original_alone() -> None:
    task = task_state()
    before = dict(vars(task))
    after = predict(task, {"status": TaskStatus.SUCCEEDED, "result": {"output": "hi"}})
    assert (after.status, after.result) == (TaskStatus.SUCCEEDED, {"output": "hi"})
    untouched = set(FIELDS) - {"status", "result"}
    assert {name: getattr(after, name) for name in untouched} == {n: before[n] for n in untouched}
    assert vars(task) == before


@given(start=st.integers(0, 10**9), by=st.integers(-(10**6), 10**6))
def test_an_increment_adds_to_the_column_rather_than_setting_it(start: int, by: int) -> None:
    after = predict(task_state(input_tokens=start), {"input_tokens": Increment(by)})
    assert after.input_tokens == start + by


def test_from_now_stays_symbolic_until_settle_puts_the_database_clock_in() -> None:
    after: Any = predict(task_state(), {"lease_expires_ms": FromNow(TTL_MS), "due_ms": FromNow(0)})
    assert after.lease_expires_ms == FromNow(TTL_MS)
    assert after.due_ms == FromNow(0)

    settle(after, db_row(clock_ms=LATER_MS, last_event_seq=9))
    assert (after.lease_expires_ms, after.due_ms) == (LATER_MS + TTL_MS, LATER_MS)
    assert after.last_event_seq == 9  # the seq the database reserved, not the prediction's


def test_settle_leaves_values_that_were_not_on_the_database_clock_alone() -> None:
    after: Any = predict(task_state(), {"lease_expires_ms": None, "due_ms": 42})
    settle(after, db_row(clock_ms=LATER_MS, last_event_seq=6))
    assert (after.lease_expires_ms, after.due_ms) == (None, 42)


# --- shape_of, params_of, assignments ------------------------------------------------------------

COLUMN_VALUES = st.sampled_from(
    [
        ("input_tokens", st.integers(0, 10**6)),
        ("input_tokens", st.builds(Increment, st.integers(0, 10**6))),
        ("attempt", st.builds(Increment, st.integers(-1, 1))),
        ("attempt", st.integers(0, 9)),
        ("lease_expires_ms", st.builds(FromNow, st.integers(0, 10**6))),
        ("lease_expires_ms", st.none()),
        ("due_ms", st.builds(FromNow, st.integers(0, 10**6))),
        ("status", st.sampled_from(tuple(TaskStatus))),
        ("waiting", st.none() | st.fixed_dictionaries({"reason": st.text(max_size=10)})),
    ]
)


@st.composite
def writes(draw: st.DrawFn) -> dict[str, Any]:
    picked = draw(st.lists(COLUMN_VALUES, max_size=6, unique_by=lambda kv: kv[0]))
    return {column: draw(values) for column, values in picked}


@given(changes=writes(), clock_ms=st.integers(0, 2**52))
def test_the_prediction_of_a_write_equals_applying_its_set_clause(
    changes: dict[str, Any], clock_ms: int
) -> None:
    task = task_state(input_tokens=1_000, attempt=2)
    after = settled(task, changes, clock_ms=clock_ms)
    assert {name: getattr(after, name) for name in FIELDS} == apply_set_clause(
        task, changes, clock_ms=clock_ms
    )


def another_of_its_kind(value: Any) -> Any:
    if isinstance(value, Increment):
        return Increment(value.by + 1)
    return FromNow(value.ms + 1) if isinstance(value, FromNow) else ("another", value)


@given(changes=writes())
def test_a_shape_depends_on_the_columns_and_their_kinds_never_on_order_or_values(
    changes: dict[str, Any],
) -> None:
    reordered = dict(reversed(list(changes.items())))
    revalued = {key: another_of_its_kind(value) for key, value in changes.items()}
    assert shape_of(reordered) == shape_of(changes) == shape_of(revalued)
    assert [key for key, _ in shape_of(changes)] == sorted(changes)


def test_writes_of_one_shape_share_a_statement_and_differ_only_in_their_parameters() -> None:
    first = {"input_tokens": Increment(10), "lease_expires_ms": FromNow(5), "status": "running"}
    second = {"status": "queued", "lease_expires_ms": FromNow(9), "input_tokens": Increment(1)}
    assert shape_of(first) == shape_of(second)
    assert shape_of(first) == (
        ("input_tokens", "inc"),
        ("lease_expires_ms", "now"),
        ("status", "set"),
    )
    assert params_of(second) == {
        "b_status": "queued",
        "b_lease_expires_ms": 9,
        "b_input_tokens": 1,
    }


@given(changes=writes())
def test_the_set_clause_is_what_the_prediction_assumes(changes: dict[str, Any]) -> None:
    """Each column is set from its own ``b_<column>``: added to the column for an increment,
    to the database clock for ``FromNow``, as is otherwise."""
    clause = assignments(shape_of(changes))
    assert set(clause) == set(changes)
    for key, kind in shape_of(changes):
        nodes = list(visitors.iterate(clause[key]))
        bound = {node.key for node in nodes if isinstance(node, BindParameter)}
        assert bound == {f"b_{key}"}
        assert any(node is TASKS.c[key] for node in nodes) == (kind == "inc")
        assert any(isinstance(node, now_ms) for node in nodes) == (kind == "now")
    assert {f"b_{key}" for key in clause} == set(params_of(changes))


# --- the value helpers, through the prediction ---------------------------------------------------


def test_a_completion_that_leases_nothing_frees_the_task_and_takes_no_next_lease() -> None:
    task = task_state(steps=2, attempt=3, model_failures=2, waiting={"reason": "x"})
    lease = lease_on(task)
    after = settled(task, progress_values(lease))

    assert after.steps == lease.step
    assert (after.lease_owner, after.lease_expires_ms) == (None, None)
    assert (after.attempt, after.model_failures, after.waiting) == (0, 0, None)
    assert after.due_ms == LATER_MS  # the next step is due at once
    assert after.lease_epoch == lease.epoch
    assert next_lease(lease, after) is None


@given(clock_ms=st.integers(0, 2**52), ttl_ms=st.integers(1, 10**7), step=st.integers(1, 500))
def test_a_completion_that_leases_the_next_step_yields_that_lease_on_the_write_clock(
    clock_ms: int, ttl_ms: int, step: int
) -> None:
    task = task_state(steps=step - 1, attempt=2)
    lease = lease_on(task, ttl_ms=ttl_ms)
    after = settled(task, progress_values(lease, next_owner="host:2:7"), clock_ms=clock_ms)

    assert after.steps == lease.step
    following = next_lease(lease, after)
    assert following is not None
    assert following.epoch == lease.epoch + 1  # fences off anything the last holder writes
    assert (following.step, following.attempt) == (lease.step + 1, 1)
    assert (following.owner, following.ttl_ms) == ("host:2:7", ttl_ms)
    assert following.clock_ms == clock_ms
    assert following.task is after


def indexed_columns(table: Any) -> set[str]:
    """Every column an index of ``table`` names, in its key or in its predicate: a change to
    any of them keeps PostgreSQL from updating a row in place (HOT)."""
    names = set(table.primary_key.columns.keys())
    for index in table.indexes:
        names.update(c.name for c in index.columns)
        where = index.dialect_options["postgresql"].get("where")
        words = [str(e) for e in index.expressions] + ([] if where is None else [str(where)])
        names.update(c.name for c in table.columns if re.search(rf"\b{c.name}\b", " ".join(words)))
    return names


def test_a_completion_that_leases_the_next_step_changes_no_indexed_column() -> None:
    """Each step that goes on in place updates its task row HOT: no new index entries."""
    task = task_state()
    changed = set(progress_values(lease_on(task), next_owner="host:2:7"))
    indexed = indexed_columns(Task.__table__)
    assert {"due_ms", "status", "admitted_ms"} <= indexed  # the check sees predicates too
    assert changed & indexed == set()
    after = settled(task, progress_values(lease_on(task), next_owner="host:2:7"))
    assert after.due_ms == task.due_ms


@pytest.mark.parametrize("status", [CallStatus.SUCCEEDED, CallStatus.FAILED])
def test_a_tool_calls_outcome_changes_no_indexed_column(status: str) -> None:
    """A call's outcome is written in place (HOT) too: no new entry in the ledger's indexes."""
    indexed = indexed_columns(ToolCall.__table__)
    assert {"approval_deadline_ms", "decision"} <= indexed
    assert set(ledger.finish_call("1.0", status=status).values) & indexed == set()


def test_no_next_lease_when_the_epoch_moved_on_by_more_than_the_completion() -> None:
    task = task_state()
    lease = lease_on(task)
    after = settled(task, progress_values(lease, next_owner="me") | {"lease_epoch": 5})
    assert after.lease_epoch == lease.epoch + 2
    assert next_lease(lease, after) is None


@pytest.mark.parametrize("status", in_order(TERMINAL_STATUSES))
def test_a_terminal_write_clears_the_lease_and_everything_waiting_on_the_task(status: str) -> None:
    task = task_state(
        model_failures=3,
        waiting={"reason": "retry_backoff"},
        due_ms=CLOCK_MS,
        cancel_requested_at=CREATED,
    )
    lease = lease_on(task)
    after = settled(task, terminal_values(status, error={"type": "x", "message": "y"}))

    assert after.status == status
    assert (after.lease_owner, after.lease_expires_ms, after.due_ms) == (None, None, None)
    assert (after.cancel_requested_at, after.waiting, after.model_failures) == (None, None, 0)
    assert after.finished_at is not None
    assert after.steps == task.steps  # unless the write says how many steps ran:
    assert settled(task, terminal_values(status, steps=7)).steps == 7
    assert next_lease(lease, after) is None
    # even a write that also bumped the epoch leases no further step of an ended task
    bumped = settled(task, terminal_values(status) | {"lease_epoch": Increment(1)})
    assert next_lease(lease, bumped) is None


@given(delay_ms=st.integers(0, 10**8), attempt=st.integers(1, 9))
def test_a_release_gives_the_lease_back_and_the_attempt_it_took_does_not_count(
    delay_ms: int, attempt: int
) -> None:
    task = task_state(attempt=attempt, model_failures=2)  # attempt as the lease left it
    lease = lease_on(task)
    after = settled(task, release_values(lease, delay_ms=delay_ms, waiting={"reason": "wait"}))

    assert after.attempt == attempt - 1
    assert (after.lease_owner, after.lease_expires_ms) == (None, None)
    assert after.due_ms == LATER_MS + delay_ms
    assert after.waiting == {"reason": "wait"}
    assert after.model_failures == 2  # kept unless the release says otherwise:
    assert settled(task, release_values(lease, model_failures=4)).model_failures == 4
    assert after.steps == task.steps
    assert next_lease(lease, after) is None


@given(
    usages=st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)),
        max_size=8,
    )
)
def test_usage_writes_add_up(usages: list[tuple[int, int, int]]) -> None:
    state = task_state(input_tokens=7, output_tokens=11, cost_usd=0.0)
    for input_tokens, output_tokens, cost in usages:
        values = usage_values(input_tokens=input_tokens, output_tokens=output_tokens, cost_usd=cost)
        state = predict(state, values)
    assert state.input_tokens == 7 + sum(u[0] for u in usages)
    assert state.output_tokens == 11 + sum(u[1] for u in usages)
    assert state.cost_usd == sum(u[2] for u in usages)
