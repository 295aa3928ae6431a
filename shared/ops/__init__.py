"""What an operator watches: dashboard sessions, the fleet's live workers and queues, and the
overview's aggregates over bounded time windows."""
