"""What both the API and the workers need. ``shared`` imports neither ``api`` nor ``workers``.

- ``store/``: the database (tables, sessions, migrations, tasks, leases, writes, events, outbox)
- ``ratelimit/``: the fleet-wide token buckets and which ones apply
- ``webhooks/``: signing, signing secrets and the egress policy
- ``observability/``: logs, metrics and traces
- ``agents/``: the agent and tool registry and the built-in tools
- top-level modules: settings, errors, ids, constants, the Celery queue, wake-ups, model
  strings and prices, failpoints, and the public shape of a task
"""
