"""Rate limits across a real fleet: API and worker processes over HTTP, Postgres and Redis.

A full bucket holds no worker (the step goes back through the queue), limited calls happen at
the bucket's rate, a provider's 429 pauses its model for every worker, and a tenant over its
submission limit gets a 429 while other tenants do not notice.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx

from tests.conftest import TenantHandle
from tests.e2e.conftest import StackFactory
from tests.e2e.util import wait_all
from tests.fakes.openai_server import (
    OpenAIServer,
    answer,
    error,
    openai_server,  # noqa: F401
)
from tests.helpers import scripted_task

PERIOD_S = 5.0
LIMITED = 20
UNLIMITED = 20
SPACED = 4  # limited calls whose spacing is checked before the rest are cancelled
# Long enough that a busy machine still submits the other tasks and sees one wait within it.
RETRY_AFTER_S = 6.0
CLOCK_SLACK_S = 0.05
OPENAI_TASKS = 6
SUBMISSIONS = 3


def unique_model(provider: str, stem: str) -> str:
    """A model of its own per run: bucket levels and counters in Redis outlive a test."""
    return f"{provider}:{stem}-{uuid.uuid4().hex[:8]}"


def limits_env(config: dict[str, Any]) -> dict[str, str]:
    return {"RATCHET_RATE_LIMITS": json.dumps(config)}


def submit(http: httpx.Client, body: dict[str, Any]) -> str:
    response = http.post("/v1/tasks", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def statuses(http: httpx.Client, ids: list[str]) -> dict[str, str]:
    return {task_id: http.get(f"/v1/tasks/{task_id}").json()["status"] for task_id in ids}


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(interval)


def bucket_view(admin: httpx.Client, scope: str) -> dict[str, Any]:
    response = admin.get("/v1/admin/ratelimits")
    assert response.status_code == 200, response.text
    buckets = {b["scope"]: b for b in response.json()["buckets"]}
    assert scope in buckets, sorted(buckets)
    return dict(buckets[scope])


def blocked_view(admin: httpx.Client) -> dict[str, int]:
    response = admin.get("/v1/admin/ratelimits")
    assert response.status_code == 200, response.text
    return {b["scope"]: b["remaining_ms"] for b in response.json()["blocked"]}


def model_completed_at(http: httpx.Client, task_id: str) -> datetime:
    [step] = http.get(f"/v1/tasks/{task_id}/steps").json()["items"]
    return datetime.fromisoformat(step["model_completed_at"])


def check_waiting(http: httpx.Client, task_id: str, scope: str) -> bool:
    """A waiting task is ``running`` and its timeline says it waits for ``scope``.

    Returns False when the task got its turn between the two reads (nothing to check then).
    """
    task = http.get(f"/v1/tasks/{task_id}").json()
    if task["status"] != "running":
        assert task["status"] == "succeeded", task
        return False
    timeline = http.get(f"/v1/tasks/{task_id}/steps").json()
    if timeline["items"]:
        return False
    waiting = timeline["waiting"]
    assert waiting is not None, (task, timeline)
    assert waiting["reason"] == "rate_limited", waiting
    assert waiting["scope"] == scope, waiting
    assert waiting["retry_in_ms"] > 0, waiting
    return True


def test_a_full_bucket_holds_no_worker_and_calls_keep_its_rate(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    model = unique_model("scripted", "slow")
    scope = f"model:{model}:requests"
    config = {"models": {model: {"requests": 1, "per_seconds": PERIOD_S, "burst_requests": 1}}}
    fleet = stack(workers=1, concurrency=2, env=limits_env(config))
    tenant, admin_tenant = make_tenant(), make_tenant(("operator",))
    http, admin = fleet.client(tenant.headers), fleet.client(admin_tenant.headers)

    started = time.monotonic()
    limited = [
        submit(http, scripted_task([{"content": f"limited {n}"}], model=model))
        for n in range(LIMITED)
    ]
    unlimited = [submit(http, scripted_task([{"content": f"free {n}"}])) for n in range(UNLIMITED)]

    # Neither worker slot sits out the limited tasks' waits: the unlimited ones overtake them.
    done = wait_all(http, None, unlimited, timeout=30)
    overtaken_after = time.monotonic() - started
    assert all(t["status"] == "succeeded" for t in done.values()), done
    by_status = statuses(http, limited)
    finished = [i for i in limited if by_status[i] == "succeeded"]
    assert len(finished) <= 3, (overtaken_after, by_status)
    # Had a waiting task held a slot, 20 waits of 5 s on 2 slots would come first.
    assert overtaken_after < 3 * PERIOD_S, overtaken_after

    waiting = [i for i in limited if by_status[i] != "succeeded"]
    assert all(by_status[i] == "running" for i in waiting), by_status
    seen_waiting = sum(check_waiting(http, i, scope) for i in waiting)
    assert seen_waiting >= len(waiting) - 2, seen_waiting

    def enough_succeeded() -> list[str]:
        now = statuses(http, limited)
        ok = [i for i in limited if now[i] == "succeeded"]
        return ok if len(ok) >= SPACED else []

    wait_for(f"{SPACED} limited tasks succeeded", enough_succeeded, timeout=(SPACED + 2) * PERIOD_S)
    for task_id in limited:
        response = http.post(f"/v1/tasks/{task_id}/cancel")
        if response.status_code == 409:  # it got its turn just now
            assert http.get(f"/v1/tasks/{task_id}").json()["status"] == "succeeded"
        else:
            assert response.status_code == 202, response.text

    ended = wait_all(http, None, limited, timeout=20)
    succeeded = [i for i in limited if ended[i]["status"] == "succeeded"]
    assert {t["status"] for t in ended.values()} <= {"succeeded", "cancelled"}, ended
    assert len(succeeded) >= SPACED, ended
    calls = sorted(model_completed_at(http, i) for i in succeeded)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(calls)]
    assert all(gap >= PERIOD_S * 0.9 for gap in gaps), gaps
    for task_id in succeeded:
        assert ended[task_id]["result"]["output"].startswith("limited "), ended[task_id]

    # The admin view counts the bucket's decisions: a grant per limited call, and the
    # refusals that sent the other limited tasks back through the queue. Grants reach it
    # within a second (each worker process adds up its own).
    time.sleep(1.5)
    view = bucket_view(admin, scope)
    assert (view["rate"], view["period_s"], view["capacity"]) == (1, PERIOD_S, 1), view
    counts = view["last_5_minutes"]
    # A task cancelled right after its grant used a call without succeeding.
    assert len(succeeded) <= counts["allowed"] <= len(succeeded) + 2, (counts, len(succeeded))
    assert counts["denied"] >= LIMITED - len(succeeded), counts
    assert counts["wait_ms"] > 0, counts
    assert counts["provider_429s"] == 0, counts


def test_a_provider_429_pauses_the_model_for_the_whole_fleet(
    stack: StackFactory,
    make_tenant: Callable[..., TenantHandle],
    openai_server: OpenAIServer,  # noqa: F811
) -> None:
    model = unique_model("openai", "busy")
    name = model.partition(":")[2]
    scope = f"model:{model}:requests"
    openai_server.reply(
        error(429, "slow down", headers={"Retry-After": f"{RETRY_AFTER_S:g}"}),
        *(answer(f"answer {n}") for n in range(OPENAI_TASKS)),
    )
    env = {
        "RATCHET_OPENAI_BASE_URL": openai_server.base_url,
        "RATCHET_OPENAI_API_KEY": "test",
        # A bucket far too large to refuse anything: it only gives the admin view a row.
        **limits_env({"models": {model: {"requests": 10_000}}}),
        "RATCHET_RATE_LIMIT_ADAPTIVE": "true",  # the 429 also halves the model's rates
    }
    fleet = stack(workers=2, concurrency=1, env=env)
    tenant, admin_tenant = make_tenant(), make_tenant(("operator",))
    http, admin = fleet.client(tenant.headers), fleet.client(admin_tenant.headers)
    body = {"input": "hello", "model": model, "tools": []}

    first = submit(http, body)
    [refused] = wait_for("the first call", lambda: openai_server.requests, timeout=20)
    assert refused.body["model"] == name
    # A call already on the wire when the 429 lands cannot be recalled: the other tasks are
    # submitted only once the pause is in force, fleet-wide.
    blocked = wait_for(
        "the block in the admin view",
        lambda: blocked_view(admin).get(model),
        timeout=RETRY_AFTER_S / 2,
    )
    assert 0 < blocked <= RETRY_AFTER_S * 1000, blocked
    others = [submit(http, body) for _ in range(OPENAI_TASKS - 1)]
    wait_for(
        "a task waiting for the pause",
        lambda: any(
            (http.get(f"/v1/tasks/{i}/steps").json()["waiting"] or {}).get("scope")
            == f"blocked:{model}"
            for i in others
        ),
        timeout=RETRY_AFTER_S,
        interval=0.05,
    )

    ids = [first, *others]
    tasks = wait_all(http, None, ids, timeout=30)
    assert all(t["status"] == "succeeded" for t in tasks.values()), tasks
    outputs = sorted(t["result"]["output"] for t in tasks.values())
    assert outputs == sorted(f"answer {n}" for n in range(OPENAI_TASKS)), outputs

    calls = [r for r in openai_server.requests if r.body["model"] == name]
    assert len(calls) == OPENAI_TASKS + 1, [c.at - refused.at for c in calls]
    assert calls[0] is refused
    quiet = [round(c.at - refused.at, 3) for c in calls[1:]]
    assert min(quiet) >= RETRY_AFTER_S - CLOCK_SLACK_S, quiet
    assert all(fleet.messages_received(i) > 0 for i in range(2)), fleet.logs(tail=20)

    assert model not in blocked_view(admin)
    # Grants are counted in each worker process and added to the shared view once a second.
    wait_for(
        "the grants in the admin view",
        lambda: bucket_view(admin, scope)["last_5_minutes"]["allowed"] >= OPENAI_TASKS + 1,
        timeout=5,
    )
    counts = bucket_view(admin, scope)["last_5_minutes"]
    assert counts["provider_429s"] == 1, counts
    assert counts["allowed"] == OPENAI_TASKS + 1, counts
    # Halved by the one 429, and creeping back by a tenth a minute since.
    assert 0.5 <= bucket_view(admin, scope)["adaptive_share"] < 0.6


def test_a_tenant_over_its_submission_limit_gets_429_and_others_do_not(
    stack: StackFactory, make_tenant: Callable[..., TenantHandle]
) -> None:
    limited, other = make_tenant(), make_tenant()
    config = {"tenants": {limited.name: {"submissions": SUBMISSIONS, "per_seconds": 60}}}
    fleet = stack(workers=1, concurrency=1, env=limits_env(config))
    body = scripted_task([{"content": "hi"}])

    with fleet.client(limited.headers) as http:
        accepted = [submit(http, body) for _ in range(SUBMISSIONS)]
        refused = http.post("/v1/tasks", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        retry_after = int(refused.headers["retry-after"])
        # One submission refills every 60 / SUBMISSIONS s.
        assert 1 <= retry_after <= 60 / SUBMISSIONS, retry_after
        problem = refused.json()
        assert problem["status"] == 429
        assert problem["title"] == "Too Many Requests"
        assert problem["type"]
        assert limited.name in problem["detail"]
        listed = http.get("/v1/tasks").json()["items"]
        assert sorted(t["id"] for t in listed) == sorted(accepted)
        done = wait_all(http, None, accepted, timeout=30)
        assert {t["status"] for t in done.values()} == {"succeeded"}

    with fleet.client(other.headers) as http:
        unaffected = [submit(http, body) for _ in range(SUBMISSIONS * 2)]
        done = wait_all(http, None, unaffected, timeout=30)
        assert {t["status"] for t in done.values()} == {"succeeded"}
