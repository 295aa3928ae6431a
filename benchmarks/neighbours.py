"""Noisy neighbours, before and after: does another tenant's one-step task, and its webhook,
keep its p99 within 2 s while a hostile tenant hangs calls, throws a calculator bomb, floods
slow tasks, hangs webhook endpoints or floods the API with half-open connections?

    ratchet bench neighbours [--before REV] [--sides before,after]
        [--patterns baseline,hung-calls,...] [--seconds 20] [--rate 2] [--limit 20]

(or ``python -m benchmarks.neighbours`` with the same options, from the checkout's root).

For each pattern and each side (``before``: the commit REV in a temporary worktree;
``after``: this working tree), a fresh stack of that side's code (``ratchet api`` and one
``ratchet worker --concurrency 1 --threads 8``, the bound of a small host, the same on both
sides) on a database and a Redis database of its own: the hostile tenant starts its pattern,
and once it is at full strength the quiet tenant submits ``--rate`` tasks a second for
``--seconds``, each followed for at most ``--limit`` seconds. Sides take turns pattern by
pattern, so a busy spell on the machine falls on both. The result is printed as JSON, kept
in ``bench-results/neighbours.json``, and summed up in a table; the processes' logs are in
``bench-results/neighbours-logs/``. How to read it: docs/benchmarks/neighbours.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import quiet
from benchmarks.checkouts import Checkout, Scratch, checkouts, run_cli, side_env, stack
from benchmarks.flood import ConnectionFlood
from benchmarks.harness.common import emit, host
from benchmarks.hostile import (
    Baseline,
    CalculatorBomb,
    HangingWebhooks,
    HungCalls,
    Pattern,
    QuietReceiver,
    SlowFlood,
)

REPO = Path(__file__).resolve().parents[1]
LOGS = Path("bench-results") / "neighbours-logs"
BEFORE = "955f32e"  # the commit before the noisy-neighbour fixes
SIDES = ("before", "after")
PROG = "python -m benchmarks.neighbours"  # or `ratchet bench neighbours`
TARGET_SECONDS = 2.0
HOSTILE_SCOPES = ("tasks:read", "tasks:write", "admin")
PATTERNS: dict[str, Callable[[], Pattern]] = {
    "baseline": Baseline,
    "hung-calls": HungCalls,
    "calculator": CalculatorBomb,
    "slow-flood": SlowFlood,
    "webhooks": HangingWebhooks,
    "conn-flood": ConnectionFlood,
}


def parse_list(text: str, *, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    """Comma-separated names, each one of ``known``, without repeats, in ``known``'s order
    (``all`` is every one); ValueError naming the unknown ones."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    if names == {"all"}:
        return list(known)
    unknown = sorted(names - set(known))
    if unknown or not names:
        raise ValueError(
            f"unknown {what} {', '.join(unknown) or '(none given)'}: choose from {', '.join(known)}"
        )
    return [name for name in known if name in names]


def parse_patterns(text: str) -> list[str]:
    return parse_list(text, known=list(PATTERNS), what="pattern")


def parse_sides(text: str) -> list[str]:
    return parse_list(text, known=SIDES, what="side")


@dataclass(frozen=True)
class Options:
    before: str = BEFORE
    sides: tuple[str, ...] = SIDES
    patterns: tuple[str, ...] = tuple(PATTERNS)
    rate: float = 2.0
    seconds: float = 20.0
    limit: float = 20.0
    concurrency: int = 1
    threads: int = 8

    def worker_args(self) -> list[str]:
        return ["--concurrency", str(self.concurrency), "--threads", str(self.threads)]


def _checked(parse: Callable[[str], list[str]]) -> Callable[[str], tuple[str, ...]]:
    def parse_argument(text: str) -> tuple[str, ...]:
        try:
            return tuple(parse(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse_argument


def parse_args(argv: list[str] | None = None, *, prog: str = PROG) -> Options:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--before", default=BEFORE, help=f"the commit of the before side (default {BEFORE})")
    add("--sides", type=_checked(parse_sides), default=SIDES, help="before,after (default both)")
    add(
        "--patterns",
        type=_checked(parse_patterns),
        default=tuple(PATTERNS),
        help=f"comma-separated, or all (default): {', '.join(PATTERNS)}",
    )
    add("--rate", type=float, default=2.0, help="quiet tasks a second (default 2)")
    add("--seconds", type=float, default=20.0, help="how long the quiet tenant submits")
    add(
        "--limit",
        type=float,
        default=20.0,
        help="seconds from a quiet task's POST after which it counts as unfinished",
    )
    add("--concurrency", type=int, default=1, help="worker processes (default 1)")
    add("--threads", type=int, default=8, help="steps each worker process runs at once")
    return Options(**vars(parser.parse_args(argv)))


def measure(
    url: str, keys: dict[str, str], *, pattern: Pattern, options: Options
) -> dict[str, Any]:
    """Start ``pattern``, let it reach full strength, run the quiet tenant's load, stop it."""
    receiver = QuietReceiver()
    try:
        pattern.start(url, keys["hostile"])
        try:
            time.sleep(pattern.settle_seconds)
            outcomes = quiet.run(
                url,
                keys["quiet"],
                receiver=receiver,
                rate=options.rate,
                seconds=options.seconds,
                limit=options.limit,
            )
        finally:
            hostile = pattern.stop()
    finally:
        receiver.stop()
    figures = quiet.report(outcomes, receiver.arrived, limit=options.limit)
    return {"hostile": hostile, **figures, "meets_target": meets_target(figures)}


def meets_target(figures: dict[str, Any]) -> bool:
    """Every quiet task and webhook made it, with a p99 within ``TARGET_SECONDS``."""
    if figures["unfinished_tasks"] or figures["missing_webhooks"]:
        return False
    return all(figures[f]["p99"] <= TARGET_SECONDS for f in ("task_s", "webhook_s"))


def run_pattern(
    checkout: Checkout, name: str, *, template: str, scratch: Scratch, options: Options
) -> dict[str, Any]:
    """One pattern on a fresh stack of ``checkout``'s code; an error is reported, not raised,
    so the other runs still take place."""
    side = checkout.side
    database = scratch.create_database(f"{side}_{name.replace('-', '_')}", template=template)
    scratch.reset_redis()
    queue = f"neighbours-{scratch.run_id}-{side}-{name}"
    env = side_env(checkout, database=database, redis_db=scratch.redis_db, queue=queue)
    logs = LOGS / f"{side}-{name}"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # The hostile tenant may also add webhook endpoints.
    scopes = [arg for scope in HOSTILE_SCOPES for arg in ("--scope", scope)]
    try:
        keys = {
            "quiet": run_cli(checkout, "tenants", "create", "quiet", env=env),
            "hostile": run_cli(checkout, "tenants", "create", "hostile", *scopes, env=env),
        }
        with stack(checkout, env, worker_args=options.worker_args(), logs=logs) as running:
            figures = measure(running.url, keys, pattern=PATTERNS[name](), options=options)
            return {"code": running.code, **figures}
    except Exception as exc:  # one failed run must not lose the others
        return {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    finally:
        scratch.drop_database(database)
        print(f"{name} on {side}: {time.monotonic() - started:.0f} s", file=sys.stderr)


def prepare(checkout: Checkout, scratch: Scratch) -> str:
    """A database migrated by the checkout's own ``ratchet migrate``: the template each of
    its patterns' databases is copied from."""
    template = scratch.create_database(f"{checkout.side}_template")
    env = side_env(checkout, database=template, redis_db=scratch.redis_db, queue="unused")
    run_cli(checkout, "migrate", env=env)
    return template


def prepare_all(found: dict[str, Checkout], scratch: Scratch) -> dict[str, str | Exception]:
    """Each side's template, or why it could not be made (each of that side's runs reports
    it; the other side still runs)."""
    templates: dict[str, str | Exception] = {}
    for side, checkout in found.items():
        try:
            templates[side] = prepare(checkout, scratch)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            templates[side] = exc
    return templates


def run(options: Options) -> dict[str, Any]:
    """Every pattern on every side, sides taking turns pattern by pattern."""
    shutil.rmtree(LOGS, ignore_errors=True)
    scratch = Scratch(uuid.uuid4().hex[:6])
    began = time.monotonic()
    try:
        with checkouts(list(options.sides), before=options.before, repo=REPO) as found:
            templates = prepare_all(found, scratch)
            sides: dict[str, Any] = {s: {**found[s].describe(), "patterns": {}} for s in found}
            for name in options.patterns:
                for side, template in templates.items():
                    sides[side]["patterns"][name] = (
                        {"error": f"not migrated: {template}"}
                        if isinstance(template, Exception)
                        else run_pattern(
                            found[side], name, template=template, scratch=scratch, options=options
                        )
                    )
    finally:
        scratch.close()
    return {
        "benchmark": "neighbours",
        "target": f"quiet tenant's task and webhook p99 <= {TARGET_SECONDS:g} s, none missing",
        "host": host(),
        "worker": f"ratchet worker {' '.join(options.worker_args())} (each side)",
        "quiet": {"rate_per_s": options.rate, "seconds": options.seconds, "limit_s": options.limit},
        "wall_s": round(time.monotonic() - began),
        "sides": sides,
    }


def _cell(figures: dict[str, Any]) -> str:
    if not figures["n"]:
        return "-"
    return f"{figures['p50']:.2f} / {figures['p99']:.2f} / {figures['max']:.2f}"


def table(result: dict[str, Any]) -> str:
    """The result in a few lines: a row per pattern and side."""
    lines = [
        f"worker: {result['worker']}; quiet tenant: {result['quiet']['rate_per_s']:g} tasks/s "
        f"for {result['quiet']['seconds']:g} s, each given {result['quiet']['limit_s']:g} s",
        f"{'pattern':<11} {'side':<7} {'task p50/p99/max s':<22} {'unfin.':>6}  "
        f"{'webhook p50/p99/max s':<22} {'miss.':>5}  target",
    ]
    patterns = dict.fromkeys(p for s in result["sides"].values() for p in s["patterns"])
    for name in patterns:
        for side, found in result["sides"].items():
            run = found["patterns"].get(name)
            if run is None:
                continue
            if "error" in run:
                lines.append(f"{name:<11} {side:<7} error: {run['error'].splitlines()[0][:80]}")
                continue
            lines.append(
                f"{name:<11} {side:<7} {_cell(run['task_s']):<22} {run['unfinished_tasks']:>6}  "
                f"{_cell(run['webhook_s']):<22} {run['missing_webhooks']:>5}  "
                f"{'met' if run['meets_target'] else 'MISSED'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, prog: str = PROG) -> None:
    options = parse_args(argv, prog=prog)
    result = run(options)
    emit("neighbours", result)
    print(table(result), file=sys.stderr)


if __name__ == "__main__":
    main()
