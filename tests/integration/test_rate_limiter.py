"""The fleet-wide limiter against the real Redis: exact under contention, atomic across buckets,
closed when Redis is away, and wired into the step runner and the submit endpoint."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from shared.ratelimit.buckets import Bucket, LimiterUnavailable, Take
from shared.ratelimit.in_process import LocalLimiter
from shared.ratelimit.limiter import RedisLimiter
from tests.conftest import REDIS_URL, Configure, TenantHandle
from tests.helpers import scripted_task


def redis_time_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def _hammer(scope: str, threads: int, ready: Any, start: Any, results: Any) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    limiter = RedisLimiter(client)
    bucket = Bucket(scope, rate=100, period_s=10)
    admitted = [0] * threads
    ready.put(True)
    while not start.value:  # the window opens once every process is ready
        time.sleep(0.005)
    start_ms, until_ms = start.value, start.value + WINDOW_MS

    def run(index: int) -> None:
        while redis_time_ms(client) < start_ms:  # every process starts together
            time.sleep(0.005)
        while redis_time_ms(client) < until_ms:
            decision = limiter.acquire([Take(bucket)])
            if decision.allowed:
                admitted[index] += 1
            else:
                time.sleep(min(decision.retry_after_ms, 5) / 1000)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    results.put(sum(admitted))


WINDOW_MS = 30_000


def test_exact_under_contention_across_processes() -> None:
    """4 processes x 16 threads on one bucket of 100 per 10 s, for 30 s."""
    client = redis.Redis.from_url(REDIS_URL)
    scope = f"test:{uuid.uuid4().hex}"
    context = multiprocessing.get_context("spawn")
    ready, results, start = context.Queue(), context.Queue(), context.Value("d", 0.0)
    procs = [
        context.Process(target=_hammer, args=(scope, 16, ready, start, results)) for _ in range(4)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:  # however long a busy machine takes to start them
        ready.get(timeout=120)
    start.value = redis_time_ms(client) + 500
    admitted = sum(results.get(timeout=90) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    ceiling = 100 + 100 * WINDOW_MS / 10_000  # burst + refill over the window
    assert admitted <= ceiling
    assert admitted >= 0.95 * ceiling


@pytest.fixture
def limiter() -> RedisLimiter:
    return RedisLimiter(redis.Redis.from_url(REDIS_URL))


def level(limiter: RedisLimiter, bucket: Bucket) -> float:
    return float(limiter.snapshot([bucket])[0]["level"])


@pytest.mark.parametrize("empty", ["tenant", "model"])
def test_a_refusing_bucket_leaves_the_others_untouched(limiter: RedisLimiter, empty: str) -> None:
    scope = uuid.uuid4().hex
    tenant = Bucket(f"tenant:{scope}", rate=1, period_s=3600)
    model = Bucket(f"model:{scope}", rate=5, period_s=3600)
    drained, other = (tenant, model) if empty == "tenant" else (model, tenant)
    assert limiter.acquire([Take(drained, drained.burst)]).allowed
    before = level(limiter, other)

    decision = limiter.acquire([Take(tenant), Take(model)])
    assert not decision.allowed
    assert decision.scope == drained.scope
    assert decision.retry_after_ms > 0
    assert level(limiter, other) == pytest.approx(before, abs=0.01)


def test_decisions_are_counted_and_a_flushed_script_is_loaded_again(
    limiter: RedisLimiter,
) -> None:
    bucket = Bucket(f"test:{uuid.uuid4().hex}", rate=1, period_s=3600)
    assert limiter.acquire([Take(bucket)]).allowed
    first = limiter.acquire([Take(bucket)])
    assert not first.allowed
    assert first.retry_after_ms > 3_500_000  # nearly an hour for the next token
    limiter.client.script_flush()  # as after a Redis restart: the decision loads it again
    assert not limiter.acquire([Take(bucket)]).allowed
    counts = limiter.snapshot([bucket])[0]["last_5_minutes"]
    assert (counts["allowed"], counts["denied"]) == (1, 2)
    assert counts["wait_ms"] >= 2 * 3_500_000


def test_redis_outage_denies_with_a_clear_error() -> None:
    dead = RedisLimiter(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5))
    with pytest.raises(LimiterUnavailable, match="rate limiter unavailable"):
        dead.acquire([Take(Bucket("x", rate=1))])


def test_corrections_and_blocks(limiter: RedisLimiter) -> None:
    bucket = Bucket(f"tokens:{uuid.uuid4().hex}", rate=10_000, period_s=36_000)
    take = Take(bucket, 1000)
    assert limiter.acquire([take]).allowed
    limiter.adjust([(take, 150 - 1000)])  # the call used 150, not the 1000 estimated
    assert level(limiter, bucket) == pytest.approx(10_000 - 150, abs=5)
    other = Take(Bucket(f"tokens:{uuid.uuid4().hex}", rate=10_000, period_s=36_000), 1000)
    assert limiter.acquire([other]).allowed
    limiter.adjust([(take, 50), (other, -400), (take, 0)])  # several buckets in one trip
    assert level(limiter, bucket) == pytest.approx(10_000 - 200, abs=5)
    assert level(limiter, other.bucket) == pytest.approx(10_000 - 600, abs=5)
    limiter.client.script_flush()  # a server that lost its scripts (restarted, flushed)
    limiter.adjust([(other, 100)])
    assert level(limiter, other.bucket) == pytest.approx(10_000 - 700, abs=5)

    scope = f"openai:{uuid.uuid4().hex}"
    limiter.block(scope, 0.5)
    decision = limiter.acquire([], blocks=[scope])
    assert not decision.allowed
    assert decision.blocked
    assert 0 < decision.retry_after_ms <= 500
    assert scope in limiter.blocked()
    time.sleep(0.55)
    assert limiter.acquire([], blocks=[scope]).allowed


def test_a_pause_reaches_every_process_and_is_not_asked_about_each_call(
    limiter: RedisLimiter,
) -> None:
    """A call with no bucket checks its model's pause: the process that got the 429 knows at
    once; another process hears of it within PAUSE_CHECK_SECONDS, and in between answers from
    what it last heard, without a round trip to Redis."""
    other = RedisLimiter(redis.Redis.from_url(REDIS_URL))  # another process of the fleet
    asked: list[int] = []
    decide = other._decide

    def counted(*args: Any, **kwargs: Any) -> Any:
        asked.append(1)
        return decide(*args, **kwargs)

    other._decide = counted  # type: ignore[method-assign]
    scope = f"openai:{uuid.uuid4().hex}"
    other.PAUSE_CHECK_SECONDS = 3600.0  # nothing goes stale while the calls below run
    for _ in range(50):
        assert other.acquire([], blocks=[scope]).allowed
    assert len(asked) == 1

    limiter.block(scope, 5)
    assert limiter.acquire([], blocks=[scope]).blocked  # the process that got the 429
    assert other.acquire([], blocks=[scope]).allowed  # not heard of yet: what it heard holds
    other.PAUSE_CHECK_SECONDS = RedisLimiter.PAUSE_CHECK_SECONDS
    time.sleep(other.PAUSE_CHECK_SECONDS + 0.05)
    paused = other.acquire([], blocks=[scope])
    assert paused.blocked
    assert 0 < paused.retry_after_ms <= 5000
    calls = len(asked)
    assert other.acquire([], blocks=[scope]).blocked  # from memory, until the pause ends
    assert len(asked) == calls
    # A bucket makes every call ask Redis, pause included, as before.
    bucket = Bucket(f"test:{uuid.uuid4().hex}", rate=100, period_s=1)
    assert other.acquire([Take(bucket)], blocks=[scope]).blocked
    assert len(asked) == calls + 1


def test_local_limiter_has_the_same_semantics() -> None:
    local = LocalLimiter()
    a, b = Bucket("a", rate=1, period_s=3600), Bucket("b", rate=3, period_s=3600)
    assert local.acquire([Take(a), Take(b)]).allowed
    refused = local.acquire([Take(a), Take(b)])
    assert (refused.allowed, refused.scope) == (False, "a")
    assert local.snapshot([b])[0]["level"] == pytest.approx(2, abs=0.01)
    local.block("m", 10)
    assert local.acquire([], blocks=["m"]).blocked


@pytest.fixture
def rate_limits(configure: Configure) -> Callable[[str], None]:
    """Sets ``RATCHET_RATE_LIMITS`` for the rest of the test."""

    def set_limits(json_limits: str) -> None:
        configure(RATCHET_RATE_LIMITS=json_limits)

    return set_limits


def test_submission_limit_is_a_429_with_retry_after(
    client: TestClient, make_tenant: Callable[..., TenantHandle], rate_limits: Callable[[str], None]
) -> None:
    tenant = make_tenant()
    rate_limits(f'{{"tenants": {{"{tenant.name}": {{"submissions": 2, "per_seconds": 3600}}}}}}')
    body = scripted_task([{"content": "hi"}])
    assert [
        client.post("/v1/tasks", json=body, headers=tenant.headers).status_code for _ in range(2)
    ] == [202, 202]
    refused = client.post("/v1/tasks", json=body, headers=tenant.headers)
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert int(refused.headers["retry-after"]) >= 1
    listed = client.get("/v1/tasks", headers=tenant.headers).json()["items"]
    assert len(listed) == 2


def test_a_long_wait_releases_the_worker_and_the_timeline_says_why(
    client: TestClient,
    tenant: TenantHandle,
    drive: Callable[..., str],
    rate_limits: Callable[[str], None],
) -> None:
    from workers.steps import runner

    model = f"scripted:{uuid.uuid4().hex[:8]}"
    rate_limits(f'{{"models": {{"{model}": {{"requests": 1, "per_seconds": 2}}}}}}')
    first = client.post(
        "/v1/tasks", json=scripted_task([{"content": "a"}], model=model), headers=tenant.headers
    )
    second = client.post(
        "/v1/tasks", json=scripted_task([{"content": "b"}], model=model), headers=tenant.headers
    )
    assert drive(first.json()["id"]) == "succeeded"

    started = time.monotonic()
    runner.advance(second.json()["id"], 1)  # the bucket is empty: defer, do not sleep
    assert time.monotonic() - started < 1.0
    timeline = client.get(f"/v1/tasks/{second.json()['id']}/steps", headers=tenant.headers).json()
    assert timeline["items"] == []
    assert timeline["waiting"]["reason"] == "rate_limited"
    assert timeline["waiting"]["scope"] == f"model:{model}:requests"
    task = client.get(f"/v1/tasks/{second.json()['id']}", headers=tenant.headers).json()
    assert task["status"] == "running"

    time.sleep(timeline["waiting"]["retry_in_ms"] / 1000)
    assert drive(second.json()["id"]) == "succeeded"


def test_limiter_outage_never_lets_a_call_through(
    client: TestClient,
    tenant: TenantHandle,
    rate_limits: Callable[[str], None],
    configure: Configure,
) -> None:
    from workers.steps import runner

    model = f"scripted:{uuid.uuid4().hex[:8]}"
    rate_limits(f'{{"models": {{"{model}": {{"requests": 100}}}}}}')
    task_id = client.post(
        "/v1/tasks", json=scripted_task([{"content": "a"}], model=model), headers=tenant.headers
    ).json()["id"]
    configure(RATCHET_REDIS_URL="redis://127.0.0.1:1/0")
    runner.advance(task_id, 1)
    timeline = client.get(f"/v1/tasks/{task_id}/steps", headers=tenant.headers).json()
    assert timeline["items"] == []
    assert timeline["waiting"]["reason"] == "limiter_unavailable"


def test_admin_view_of_the_buckets(
    client: TestClient, make_tenant: Callable[..., TenantHandle], rate_limits: Callable[[str], None]
) -> None:
    model = f"scripted:{uuid.uuid4().hex[:8]}"
    rate_limits(f'{{"models": {{"{model}": {{"requests": 10, "tokens": 1000}}}}}}')
    admin = make_tenant(("operator",))
    plain = make_tenant()
    assert client.get("/v1/admin/ratelimits", headers=plain.headers).status_code == 403
    view = client.get("/v1/admin/ratelimits", headers=admin.headers).json()
    scopes = {b["scope"]: b for b in view["buckets"]}
    assert scopes[f"model:{model}:requests"]["capacity"] == 10
    assert scopes[f"model:{model}:tokens"]["level"] == pytest.approx(1000)
    assert set(scopes[f"model:{model}:requests"]["last_5_minutes"]) == {
        "allowed",
        "denied",
        "wait_ms",
        "provider_429s",
    }


# --- adaptive limits (AIMD) ---------------------------------------------------------------------


def test_429s_halve_a_models_share_down_to_a_floor_and_it_creeps_back() -> None:
    from shared.ratelimit.buckets import FACTOR_PREFIX
    from shared.ratelimit.scripts import FLOOR

    client = redis.Redis.from_url(REDIS_URL)
    limiter = RedisLimiter(client)
    scope = f"model:test:{uuid.uuid4().hex}"
    assert limiter.factor(scope) == 1.0
    assert limiter.cut(scope) == pytest.approx(0.5, abs=0.001)
    assert limiter.cut(scope) == pytest.approx(0.25, abs=0.001)
    # five minutes without a 429: half the configured rate back (a tenth a minute)
    client.set(FACTOR_PREFIX + scope, f"0.25:{redis_time_ms(client) - 300_000}")
    assert limiter.factor(scope) == pytest.approx(0.75, abs=0.01)
    for _ in range(10):
        limiter.cut(scope)
    assert limiter.factor(scope) == pytest.approx(FLOOR, abs=0.001)
    local = LocalLimiter()
    assert local.cut("m") == pytest.approx(0.5, abs=0.001)
    assert local.cut("m") == pytest.approx(0.25, abs=0.001)


def test_adaptive_limits_scale_the_models_buckets_only_when_on(
    rate_limits: Callable[[str], None], configure: Configure
) -> None:
    from shared.ratelimit import rules

    model = f"test:{uuid.uuid4().hex[:8]}"
    configure(RATCHET_REDIS_URL=REDIS_URL, RATCHET_BROKER_URL=REDIS_URL)
    rate_limits(f'{{"models": {{"{model}": {{"requests": 100, "tokens": 1000}}}}}}')
    assert rules.after_429(model) is None  # off by default: a 429 only pauses the model
    assert [t.bucket.rate for t in rules.call_takes(model, "t", 10)] == [100, 1000]

    configure(RATCHET_RATE_LIMIT_ADAPTIVE="true")
    assert rules.after_429(model) == pytest.approx(0.5, abs=0.001)
    takes = rules.call_takes(model, "t", 10)
    halved = [pytest.approx(50, rel=0.01), pytest.approx(500, rel=0.01)]
    assert [t.bucket.rate for t in takes] == halved
    assert [t.bucket.burst for t in takes] == halved
    assert {t.bucket.scope for t in takes} == {f"model:{model}:requests", f"model:{model}:tokens"}


def test_the_prompt_is_counted_only_for_a_tokens_bucket(
    rate_limits: Callable[[str], None],
) -> None:
    """Counting a long conversation with a tokenizer is work of its own: a call that no
    tokens bucket applies to is not counted; one that two apply to is counted once."""
    from shared.ratelimit import rules

    requests_only, both = (f"test:{uuid.uuid4().hex[:8]}" for _ in range(2))
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    rate_limits(
        f'{{"models": {{"{requests_only}": {{"requests": 100}}, "{both}": {{"tokens": 1000}}}},'
        f' "tenants": {{"{tenant}": {{"tokens": 500}}}}}}'
    )
    counts: list[int] = []

    def count() -> int:
        counts.append(42)
        return 42

    takes = rules.call_takes(requests_only, "another", count)
    assert [t.cost for t in takes] == [1]
    assert counts == []
    takes = rules.call_takes(both, tenant, count)
    assert [t.cost for t in takes] == [42, 42]
    assert counts == [42]


def test_the_429s_of_one_overload_cut_the_share_once() -> None:
    """A provider rejects every call in flight at once: four 429s within the pause are one."""
    limiter = RedisLimiter(redis.Redis.from_url(REDIS_URL))
    scope = f"model:test:{uuid.uuid4().hex}"
    shares = [limiter.cut(scope, window_ms=2_000) for _ in range(4)]
    assert shares == [pytest.approx(0.5, abs=0.001)] * 4
    local = LocalLimiter()
    assert [local.cut("m", window_ms=2_000) for _ in range(4)] == [pytest.approx(0.5)] * 4
