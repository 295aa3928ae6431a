"""The noisy-neighbour benchmark's pure pieces: its options, its figures and verdicts, its
table, and the check that a side's processes ran that side's code. (No test runs the
benchmark itself: it starts two stacks per pattern and takes minutes.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import neighbours, quiet
from benchmarks.checkouts import CODE_MARK, Checkout, code_of, require_code
from benchmarks.quiet import Outcome


def test_patterns_parse_in_their_own_order() -> None:
    assert neighbours.parse_patterns("conn-flood, baseline,calculator") == [
        "baseline",
        "calculator",
        "conn-flood",
    ]
    assert neighbours.parse_patterns("all") == list(neighbours.PATTERNS)
    assert neighbours.parse_patterns("webhooks,webhooks") == ["webhooks"]


@pytest.mark.parametrize("text", ["hung", "baseline,slowflood", "", " , "])
def test_an_unknown_or_empty_pattern_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="choose from baseline, hung-calls"):
        neighbours.parse_patterns(text)


def test_the_command_line_takes_a_subset_and_refuses_unknown_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = neighbours.parse_args(
        ["--sides", "before", "--patterns", "calculator", "--seconds", "10", "--before", "abc"]
    )
    assert options.sides == ("before",)
    assert options.patterns == ("calculator",)
    assert (options.seconds, options.before) == (10.0, "abc")
    assert options.worker_args() == ["--concurrency", "1", "--threads", "8"]
    defaults = neighbours.parse_args([])
    assert defaults.sides == ("before", "after")
    assert defaults.patterns == tuple(neighbours.PATTERNS)
    assert defaults.before == "955f32e"
    with pytest.raises(SystemExit):
        neighbours.parse_args(["--sides", "middle"])
    assert "unknown side middle" in capsys.readouterr().err


def test_figures_give_nearest_rank_percentiles_and_nothing_for_no_samples() -> None:
    values = [float(n) for n in range(1, 101)]
    assert quiet.figures(values) == {"n": 100, "p50": 51.0, "p99": 99.0, "max": 100.0}
    assert quiet.figures([]) == {"n": 0, "p50": None, "p99": None, "max": None}


def test_the_report_counts_what_never_finished_and_late_webhooks_as_missing() -> None:
    outcomes = [
        Outcome(posted=100.0, task_id="a", finished=100.5, status="succeeded"),
        Outcome(posted=101.0, task_id="b", finished=104.0, status="failed"),
        Outcome(posted=102.0, task_id="c", error="GET answered 503"),
        Outcome(posted=103.0, error="POST answered 503"),
    ]
    arrived = {"a": 100.6, "b": 125.0}  # b's webhook came after its 20 s
    report = quiet.report(outcomes, arrived, limit=20.0)
    assert report["submitted"] == 4
    assert report["task_s"] == {"n": 2, "p50": 0.5, "p99": 3.0, "max": 3.0}
    assert report["unfinished_tasks"] == 2
    assert report["not_succeeded"] == 1
    assert report["webhook_s"]["n"] == 1
    assert report["webhook_s"]["max"] == pytest.approx(0.6)
    assert report["missing_webhooks"] == 3
    assert report["errors"] == ["GET answered 503", "POST answered 503"]
    assert not neighbours.meets_target(report)


def test_the_target_is_a_p99_within_2_s_with_nothing_missing() -> None:
    fast = [Outcome(posted=0.0, task_id=str(n), finished=0.5, status="succeeded") for n in range(9)]
    met = quiet.report(fast, {str(n): 0.4 for n in range(9)}, limit=20.0)
    assert neighbours.meets_target(met)
    slow = [*fast, Outcome(posted=0.0, task_id="9", finished=2.5, status="succeeded")]
    missed = quiet.report(slow, {str(n): 0.4 for n in range(10)}, limit=20.0)
    assert missed["unfinished_tasks"] == 0
    assert missed["task_s"]["p99"] == 2.5
    assert not neighbours.meets_target(missed)


def test_the_table_has_a_row_per_pattern_and_side() -> None:
    run = quiet.report(
        [Outcome(posted=0.0, task_id="a", finished=0.25, status="succeeded")],
        {"a": 0.5},
        limit=20.0,
    )
    result = {
        "worker": "ratchet worker --concurrency 1 --threads 8 (each side)",
        "quiet": {"rate_per_s": 2.0, "seconds": 20.0, "limit_s": 20.0},
        "sides": {
            "before": {"patterns": {"baseline": {**run, "meets_target": True}}},
            "after": {"patterns": {"baseline": {"error": "RuntimeError: no worker\nmore"}}},
        },
    }
    lines = neighbours.table(result).splitlines()
    assert "2 tasks/s for 20 s" in lines[0]
    assert lines[2].split() == [
        *("baseline", "before", "0.25", "/", "0.25", "/", "0.25", "0"),
        *("0.50", "/", "0.50", "/", "0.50", "0", "met"),
    ]
    assert lines[3].split() == ["baseline", "after", "error:", "RuntimeError:", "no", "worker"]


def test_a_side_runs_only_its_own_code(tmp_path: Path) -> None:
    checkout = Checkout("before", tmp_path / "before", commit="0" * 40, dirty=False)
    own = f"{CODE_MARK}{tmp_path}/before/shared/__init__.py\nINFO started\n"
    assert code_of(own) == f"{tmp_path}/before/shared/__init__.py"
    assert require_code(checkout, own, what="api").endswith("before/shared/__init__.py")
    other = f"{CODE_MARK}/elsewhere/shared/__init__.py\n"
    with pytest.raises(RuntimeError, match="ran code from /elsewhere"):
        require_code(checkout, other, what="api")
    with pytest.raises(RuntimeError, match="ran code from None"):
        require_code(checkout, "no such line\n", what="worker")
