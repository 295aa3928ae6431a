"""``ratchet bench dashboard``: the server time of every dashboard page and JSON endpoint over
a fleet of ``--tasks`` tasks (a million by default), against p95 ≤ 200 ms.

Server-side SQL (``generate_series``) writes the fleet: 20 tenants (one with half the tasks),
30 days of tasks with two steps, a tool call and four events each, webhook deliveries for a
tenth. Active tasks hold a lease that never runs out and no delivery is pending, so a sweeper
leaves them alone; the seed stays for the next run (``--reuse``). ``ratchet api`` runs as
deployed; pages are requested on keep-alive connections by an operator and the big tenant's
admin (a time is the server's plus a loopback round trip)."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import typer

from benchmarks.harness.common import emit, host, libpq_url, percentile
from benchmarks.harness.processes import Child, free_port, wait_ok

PREFIX = "bench-dash-"  # the seeded tenants; "bench-" marks any benchmark's
TENANTS = 20
CHUNK = 100_000
SPAN = timedelta(days=30)
MODELS = ("openai:gpt-4.1-mini", "openai:gpt-4.1", "anthropic:claude-sonnet-4", "openai:o3")
ENDPOINTS = (0, 0, 1, 2, 3, 4)  # the tenants (by number) with a webhook endpoint
TARGET_MS = 200.0
WARM_UPS = 2
BOTH = ("operator", "admin")
PAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("/dashboard?window=1h", BOTH),
    ("/dashboard?window=24h", BOTH),
    ("/dashboard/tasks", BOTH),
    ("/dashboard/tasks?status=failed", BOTH),
    ("/dashboard/tasks?metadata=customer:7", BOTH),
    ("/dashboard/tasks?model={model}", BOTH),
    ("/dashboard/tasks?after={middle}", BOTH),
    ("/dashboard/tasks/{task}", BOTH),
    ("/dashboard/workers", ("operator",)),
    ("/dashboard/ratelimits", BOTH),
    ("/dashboard/webhooks", BOTH),
    ("/dashboard/tenants", BOTH),
    ("/v1/tasks", ("admin",)),
    ("/v1/tasks/{task}", ("admin",)),
    ("/v1/tasks/{task}/steps", ("admin",)),
    ("/v1/admin/fleet", ("operator",)),
    ("/v1/admin/ratelimits", ("operator",)),
    ("/v1/webhook-endpoints", ("admin",)),
    ("/v1/overview?window=24h", ("admin",)),
    ("/v1/admin/overview?window=24h", ("operator",)),
    ("/v1/admin/tasks?metadata=customer:7", ("operator",)),
)

# One chunk's tasks, drawn once; every table below reads them from here. Ids are UUIDv7-shaped
# (the row's time, then a counter), so they sort as the rows were made. Half the tasks are the
# first tenant's; the newest ``active`` queued or running; 5 % failed, 2 % cancelled.
SEED = """
CREATE TEMP TABLE seed ON COMMIT DROP AS
SELECT n, (lpad(to_hex(ms), 12, '0') || '70008' || lpad(to_hex(n), 15, '0'))::uuid::text AS id,
       (%(tenants)s::text[])[tenant_no + 1] AS tenant_id, created_at, status, err, latency_ms,
       floor(1000 * random())::int AS customer,
       (ARRAY['support', 'research', 'triage', 'coder', 'default'])
         [1 + floor(5 * random() ^ 1.5)::int] AS agent,
       (%(models)s::text[])[1 + floor(4 * random() ^ 2)::int] AS model,
       CASE WHEN status IN ('queued', 'running') OR hook >= 0.14 THEN NULL WHEN hook < 0.007
            THEN 'failed' WHEN hook < 0.0084 THEN 'disabled' ELSE 'delivered' END AS hook,
       200 + floor(3000 * random())::bigint AS input_tokens,
       40 + floor(800 * random())::bigint AS output_tokens,
       created_at + interval '150 ms' AS started_at,
       CASE WHEN status IN ('queued', 'running') THEN NULL
            ELSE created_at + (2 * latency_ms + 250) * interval '1 ms' END AS finished_at,
       CASE status WHEN 'queued' THEN 0 WHEN 'running' THEN 1 ELSE 2 END AS steps,
       CASE status WHEN 'queued' THEN 1 WHEN 'running' THEN 3 ELSE 4 END AS events
FROM (
  SELECT n, ms, to_timestamp(ms / 1000.0) AS created_at, 300 + floor(2500 * random())::int
           AS latency_ms, CASE WHEN random() < 0.5 THEN 0
                               ELSE 1 + floor(%(small)s * random() ^ 2)::int END AS tenant_no,
         CASE WHEN n >= %(active)s THEN (ARRAY['queued', 'running'])[1 + mod(n, 2)]
              WHEN r < 0.05 THEN 'failed' WHEN r < 0.07 THEN 'cancelled'
              ELSE 'succeeded' END AS status,
         (ARRAY['model_error', 'max_steps_exceeded', 'deadline_exceeded', 'tool_outcome_unknown',
                'budget_exceeded'])[1 + floor(5 * random() ^ 2)::int] AS err, random() AS hook
  FROM (SELECT n, %(start_ms)s + n * %(span_ms)s / %(total)s AS ms, random() AS r
        FROM generate_series(%(lo)s::bigint, %(hi)s::bigint - 1) AS n) AS drawn
) AS derived
"""
TASKS = """
INSERT INTO tasks (id, tenant_id, agent, model, status, input, tools, model_options, max_steps,
  metadata, created_at, started_at, finished_at, updated_at, steps, attempt, model_failures,
  input_tokens, output_tokens, cost_usd, result, error, lease_epoch, lease_owner,
  lease_expires_ms, due_ms, last_event_seq)
SELECT id, tenant_id, agent, model, status, to_jsonb('Summarise ticket ' || n), '["calculator"]',
  '{}', 10, jsonb_build_object('customer', customer::text), created_at,
  CASE WHEN steps > 0 THEN started_at END, finished_at, coalesce(finished_at, started_at), steps,
  least(steps, 1), 0, input_tokens * steps, output_tokens * steps,
  (input_tokens * 2.5e-6 + output_tokens * 1e-5) * steps,
  CASE status WHEN 'succeeded' THEN jsonb_build_object('output', 'Done: ticket ' || n) END,
  CASE status WHEN 'failed' THEN jsonb_build_object('type', err, 'message', 'seeded ' || err)
    WHEN 'cancelled' THEN '{"type": "cancelled", "message": "cancelled at the client''s request"}'
  END, least(steps, 1), CASE status WHEN 'running' THEN 'bench-seed' END,
  CASE WHEN finished_at IS NULL THEN 4102444800000 END,  -- 2100: a lease that never runs out
  CASE WHEN finished_at IS NULL THEN floor(extract(epoch FROM created_at) * 1000) END, events
FROM seed
"""
STEPS = """
INSERT INTO steps (task_id, number, status, response, input_tokens, output_tokens, cost_usd,
  model_latency_ms, lease_epoch, started_at, model_completed_at, completed_at)
SELECT id, k, 'completed',
  CASE k WHEN 1 THEN jsonb_build_object('content', NULL, 'tool_calls', jsonb_build_array(
      jsonb_build_object('id', 'call_' || n, 'name', 'calculator',
                         'arguments', '{"expression": "6*7"}'::jsonb)))
    ELSE jsonb_build_object('content', 'Done: ticket ' || n, 'tool_calls', '[]'::jsonb) END,
  input_tokens, output_tokens, input_tokens * 2.5e-6 + output_tokens * 1e-5, latency_ms, 1,
  started_at + (k - 1) * (latency_ms + 100) * interval '1 ms',
  started_at + ((k - 1) * (latency_ms + 100) + latency_ms) * interval '1 ms',
  started_at + ((k - 1) * (latency_ms + 100) + latency_ms + 100 * (2 - k)) * interval '1 ms'
FROM seed CROSS JOIN generate_series(1, 2) AS k WHERE k <= steps
"""
CALLS = """
INSERT INTO tool_calls (task_id, step_number, position, call_id, provider_call_id, tool,
  arguments, status, result, idempotency_key, runs, lease_epoch, started_at, finished_at)
SELECT id, 1, 0, '1-0', 'call_' || n, 'calculator', '{"expression": "6*7"}', 'succeeded', '42',
  id || ':1-0', 1, 1, started_at + latency_ms * interval '1 ms',
  started_at + (latency_ms + 100) * interval '1 ms'
FROM seed WHERE steps > 0
"""
EVENTS = """
INSERT INTO task_events (task_id, seq, type, data, created_at)
SELECT id, e, (ARRAY['task.queued', 'task.started', 'step.completed', 'task.' || status])[e],
  CASE e WHEN 3 THEN '{"step": 1}'::jsonb ELSE jsonb_build_object('id', id, 'status',
    (ARRAY['queued', 'running', NULL, status])[e]) END,
  (ARRAY[created_at, started_at, started_at + (latency_ms + 100) * interval '1 ms', finished_at])[e]
FROM seed CROSS JOIN generate_series(1, 4) AS e WHERE e <= events
"""
# One delivery of the terminal event per endpoint of the task's tenant, for 14 % of the
# tasks (``hook``); 5 % of them failed after five attempts, 1 % dropped (endpoint disabled).
DELIVERIES = """
WITH sent AS (
  INSERT INTO webhook_deliveries (id, tenant_id, task_id, endpoint_id, event_seq, event_type, url,
  payload, status, attempts, attempts_base, last_status_code, last_error, created_at, delivered_at)
  SELECT (lpad(to_hex(floor(extract(epoch FROM s.finished_at) * 1000)::bigint), 12, '0')
      || '70008' || lpad(to_hex(s.n), 14, '0') || right(ep.id, 1))::uuid::text,
    s.tenant_id, s.id, ep.id, 4, 'task.' || s.status, ep.url,
    jsonb_build_object('type', 'task.' || s.status, 'task_id', s.id), hook,
    CASE hook WHEN 'failed' THEN 5 WHEN 'disabled' THEN 0 ELSE 1 END, 0,
    CASE hook WHEN 'failed' THEN 500 WHEN 'delivered' THEN 200 END,
    CASE hook WHEN 'failed' THEN 'HTTP 500' WHEN 'disabled' THEN 'endpoint disabled' END,
    s.finished_at, CASE hook WHEN 'delivered' THEN s.finished_at + interval '40 ms' END
  FROM seed AS s JOIN webhook_endpoints AS ep ON ep.tenant_id = s.tenant_id
  WHERE hook IS NOT NULL
  RETURNING id, attempts, last_status_code, created_at
)
INSERT INTO webhook_attempts (delivery_id, number, started_at, status_code, latency_ms, error)
SELECT id, a, created_at + (a - 1) * interval '30 s', last_status_code, 40,
  CASE WHEN last_status_code = 500 THEN 'HTTP 500' END
FROM sent CROSS JOIN generate_series(1, attempts) AS a
"""
ENDPOINTS_SQL = """
INSERT INTO webhook_endpoints (id, tenant_id, url, events, enabled, created_at)
SELECT (lpad(to_hex(floor(extract(epoch FROM since) * 1000)::bigint), 12, '0') || '70008'
    || lpad(to_hex(n), 15, '0'))::uuid::text,
  tenant, 'https://hooks' || n || '.example.com/ratchet',
  '["task.succeeded", "task.failed", "task.cancelled"]', true, since
FROM unnest(%s::text[]) WITH ORDINALITY AS e(tenant, n), (SELECT now() - %s AS since) AS t
"""
SEEDED_TABLES = ("tasks", "steps", "tool_calls", "task_events", "webhook_deliveries")
OTHERS_SQL = f"""SELECT 1 FROM tenants AS t WHERE name NOT LIKE '{PREFIX}%'
  AND EXISTS (SELECT 1 FROM tasks WHERE tenant_id = t.id)"""
FIXTURES = """
SELECT (SELECT task_id FROM webhook_deliveries WHERE tenant_id = %(big)s AND status = 'failed'
          ORDER BY created_at DESC LIMIT 1),
       (SELECT id FROM tasks WHERE created_at >= now() - %(half)s ORDER BY created_at LIMIT 1),
       (SELECT max(created_at) FROM tasks WHERE tenant_id = %(big)s)
"""
ROW_COUNTS = "SELECT relname, reltuples::bigint FROM pg_class WHERE relname = ANY(%s)"


def _connect() -> Any:
    import psycopg

    return psycopg.connect(libpq_url(), autocommit=True)


def _seeded(connection: Any) -> tuple[list[str], int]:
    """The seeded tenants' ids (the big one first) and how many tasks they hold."""
    query = "SELECT id FROM tenants WHERE name LIKE %s ORDER BY name"
    ids = [row[0] for row in connection.execute(query, (f"{PREFIX}%",))]
    query = "SELECT count(*) FROM tasks WHERE tenant_id = ANY(%s)"
    return ids, int(connection.execute(query, (ids,)).fetchone()[0])


def _refuse_foreign(connection: Any) -> None:
    """Seeding writes a million tasks and keeps them: only into a database of benchmarks."""
    query = "SELECT name FROM tenants WHERE name NOT LIKE 'bench-%' LIMIT 3"
    if foreign := [row[0] for row in connection.execute(query)]:
        raise typer.BadParameter(
            f"the database holds tenants besides benchmarks' ({', '.join(foreign)}, …): point"
            " RATCHET_DATABASE_URL at a database of its own for this benchmark"
        )


def _new_tenants(connection: Any) -> list[str]:
    """Replace the seeded tenants and add their webhook endpoints. Their rows go by TRUNCATE
    when no other tenant holds a task (deleting millions of rows takes minutes); the lock
    keeps anyone from adding one meanwhile."""
    from shared.store.db import transaction
    from shared.store.tenants import create_tenant

    with connection.transaction():
        connection.execute("LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE")
        if connection.execute(OTHERS_SQL).fetchone() is None:
            connection.execute(f"TRUNCATE {', '.join((*SEEDED_TABLES, 'webhook_attempts'))}")
    connection.execute("DELETE FROM tenants WHERE name LIKE %s", (f"{PREFIX}%",))
    with transaction() as session:
        ids = [create_tenant(session, f"{PREFIX}{n:02d}").id for n in range(TENANTS)]
    connection.execute(ENDPOINTS_SQL, ([ids[n] for n in ENDPOINTS], SPAN))
    return ids


def _chunk_params(tenants: list[str], *, total: int) -> dict[str, Any]:
    span_ms = SPAN // timedelta(milliseconds=1)
    return {
        "tenants": tenants,
        "small": len(tenants) - 1,
        "models": list(MODELS),
        "total": total,
        "active": total - min(300, max(1, total // 100)),
        "span_ms": span_ms,
        "start_ms": int(time.time() * 1000) - span_ms,
    }


def seed(total: int) -> float:
    """Write ``total`` tasks (and their rows) in chunks, then vacuum and analyze; seconds."""
    started = time.perf_counter()
    with _connect() as connection:
        _refuse_foreign(connection)
        params = _chunk_params(_new_tenants(connection), total=total)
        for lo in range(0, total, CHUNK):
            with connection.transaction():
                connection.execute("SELECT setseed(%s)", (lo / total * 0.5,))
                connection.execute(SEED, {**params, "lo": lo, "hi": min(total, lo + CHUNK)})
                for statement in (TASKS, STEPS, CALLS, EVENTS, DELIVERIES):
                    connection.execute(statement, params)
            done = min(total, lo + CHUNK)
            typer.echo(f"seeded {done:,} tasks ({time.perf_counter() - started:.0f} s)", err=True)
        for table in (*SEEDED_TABLES, "webhook_attempts"):
            connection.execute(f"VACUUM (ANALYZE) {table}")
    return time.perf_counter() - started


def _fixtures(connection: Any, big: str) -> dict[str, Any]:
    """What the pages are opened on (a big-tenant task with deliveries, the id halfway down
    the list, the rarest model), how old the newest task is, and the tables' sizes."""
    task, middle, newest = connection.execute(FIXTURES, {"big": big, "half": SPAN / 2}).fetchone()
    return {
        "task": task or middle,
        "middle": middle,
        "model": MODELS[-1],
        "newest_minutes": round((datetime.now(UTC) - newest).total_seconds() / 60),
        "rows": dict(connection.execute(ROW_COUNTS, (list(SEEDED_TABLES),)).fetchall()),
    }


def _issue_keys(big: str) -> dict[str, tuple[str, str]]:
    """An operator key and a tenant-admin key of the big tenant: role → (key id, key)."""
    from shared.store.db import transaction
    from shared.store.tenants import issue_key

    keys = {}
    with transaction() as session:
        for role in BOTH:
            row, key = issue_key(session, big, scopes=(role,), name=f"bench dashboard {role}")
            keys[role] = (row.id, key)
    return keys


def _client(base: str, key: str) -> httpx.Client:
    """A keep-alive client logged in to the dashboard (the cookie) and to the API (the key)."""
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    answer = client.post("/dashboard/login", data={"key": key})
    if answer.status_code != 303 or "ratchet_session" not in client.cookies:
        raise RuntimeError(f"login refused ({answer.status_code}): {answer.text[:200]}")
    return client


def _rounds(
    clients: dict[str, httpx.Client], paths: dict[tuple[str, str], str], *, requests: int
) -> dict[tuple[str, str], list[float]]:
    """Each page's times (ms): one GET of every page a round, after the warm-up rounds, so a
    burst of load from elsewhere on the machine falls on every page alike. A ``/v1`` route
    that answers 404 is not in this version: it is left out."""
    times: dict[tuple[str, str], list[float]] = {target: [] for target in paths}
    for number in range(WARM_UPS + requests):
        for (page, role), kept in list(times.items()):
            started = time.perf_counter()
            answer = clients[role].get(paths[(page, role)])
            if answer.status_code == 404 and page.startswith("/v1/"):
                del times[(page, role)]
            elif answer.status_code != 200:
                raise RuntimeError(f"GET {page} answered {answer.status_code}: {answer.text[:300]}")
            elif number >= WARM_UPS:
                kept.append((time.perf_counter() - started) * 1000)
    return times


def _figures(times: list[float] | None) -> dict[str, Any]:
    if times is None:
        return {"skipped": "404: not served by this version"}
    p50, p95 = percentile(times, 50), percentile(times, 95)
    return {"p50_ms": round(p50, 1), "p95_ms": round(p95, 1), "met": p95 <= TARGET_MS}


def measure(
    keys: dict[str, tuple[str, str]], fixtures: dict[str, Any], *, requests: int
) -> list[dict[str, Any]]:
    """Every page and endpoint of :data:`PAGES` by each of its roles, on one API process."""
    paths = {(page, role): page.format(**fixtures) for page, roles in PAGES for role in roles}
    port = free_port()
    with Child("ratchet", "api", "--port", str(port), env=dict(os.environ)) as server:
        wait_ok(f"http://127.0.0.1:{port}/readyz", server)
        clients = {role: _client(f"http://127.0.0.1:{port}", keys[role][1]) for role in BOTH}
        try:
            times = _rounds(clients, paths, requests=requests)
        finally:
            for client in clients.values():
                client.close()
    return [{"page": p, "role": r} | _figures(times.get((p, r))) for p, r in paths]


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (the page paths with their placeholders)."""
    lines = ["| page | role | p50 ms | p95 ms | p95 ≤ 200 ms |", "|---|---|---:|---:|---|"]
    for row in rows:
        figures = (
            f" | | skipped ({row['skipped']})"
            if "skipped" in row
            else f"{row['p50_ms']:.1f} | {row['p95_ms']:.1f} | {'yes' if row['met'] else '**no**'}"
        )
        lines.append(f"| `{row['page']}` | {row['role']} | {figures} |")
    return "\n".join(lines)


def _report(result: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        emit("dashboard", result)
        return
    os.makedirs("bench-results", exist_ok=True)
    with open(os.path.join("bench-results", "dashboard.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    typer.echo(table(result["results"]))
    how = "reused" if result["seed_seconds"] is None else f"seeded in {result['seed_seconds']} s"
    typer.echo(
        f"\n{result['tasks']:,} tasks ({how}),"
        f" newest {result['fixtures']['newest_minutes']} min old; {result['requests']} requests a"
        f" page after {WARM_UPS} warm-ups; every p95 ≤ 200 ms: {result['all_met']}"
    )


def dashboard(
    *,
    tasks: int = typer.Option(1_000_000, min=1_000, help="tasks to seed"),
    reuse: bool = typer.Option(False, help="keep the seed if it already holds --tasks tasks"),
    requests: int = typer.Option(20, min=2, help="timed requests per page and role"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Seed a fleet of tasks, then time every dashboard page and JSON endpoint (p50, p95)."""
    from shared.store.db import require_migrated

    require_migrated()
    with _connect() as connection:
        held = _seeded(connection)[1]
        seconds = None if reuse and held == tasks else seed(tasks)
        tenants, held = _seeded(connection)
        fixtures = _fixtures(connection, tenants[0])
    keys = _issue_keys(tenants[0])
    try:
        results = measure(keys, fixtures, requests=requests)
    finally:  # the keys go, and their dashboard sessions with them
        with _connect() as connection:
            ids = [key_id for key_id, _ in keys.values()]
            connection.execute("DELETE FROM api_keys WHERE id = ANY(%s)", (ids,))
    _report(
        {
            "tasks": held,
            "seed_seconds": None if seconds is None else round(seconds, 1),
            "fixtures": fixtures,
            "requests": requests,
            "results": results,
            "all_met": all(r.get("met", True) for r in results),  # a skipped one aside
            "target": "p95 <= 200 ms for every page and endpoint",
            "host": host(),
        },
        as_json=as_json,
    )
