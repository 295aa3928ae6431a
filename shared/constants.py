"""Names that cross process boundaries: Celery task names and Redis key prefixes."""

ADVANCE_TASK = "ratchet.advance_task"
SWEEP_TASK = "ratchet.sweep"
DELIVER_WEBHOOK_TASK = "ratchet.deliver_webhook"

REDIS_PREFIX = "ratchet:"
# Published after a commit that appended events to a task: wakes SSE streams and long polls.
EVENTS_CHANNEL_PREFIX = REDIS_PREFIX + "events:"
# Every rate-limiter key carries the {rl} hash tag: one cluster slot, so one script sees all.
RATE_LIMIT_PREFIX = REDIS_PREFIX + "{rl}:"
# Published when a cancel is requested for a running task: wakes its step in flight.
CANCELS_CHANNEL = REDIS_PREFIX + "cancels"
