"""The worker side: the Celery app, the agent loop (``steps/``), model calls and providers,
tool execution, cancels, the lease heartbeat, the webhook sender and the sweeper."""
