"""The HTTP API's routes, one module per resource (tasks, events, webhooks, keys, agents,
admin, health and metrics)."""
