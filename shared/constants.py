"""Names that cross process boundaries: Celery task names and Redis key prefixes."""

ADVANCE_TASK = "ratchet.advance_task"
SWEEP_TASK = "ratchet.sweep"

REDIS_PREFIX = "ratchet:"
# Every rate-limiter key carries the {rl} hash tag: one cluster slot, so one script sees all.
RATE_LIMIT_PREFIX = REDIS_PREFIX + "{rl}:"
