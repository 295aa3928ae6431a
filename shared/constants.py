"""Names that cross process boundaries: Celery task names and Redis key prefixes."""

ADVANCE_TASK = "ratchet.advance_task"
SWEEP_TASK = "ratchet.sweep"

REDIS_PREFIX = "ratchet:"
