"""Names that cross process boundaries: Celery task names and Redis key prefixes."""

ADVANCE_TASK = "ratchet.advance_task"
ADVANCE_TASKS = "ratchet.advance_tasks"  # several tasks' steps in one message (admission)
SWEEP_TASK = "ratchet.sweep"
DELIVER_WEBHOOK_TASK = "ratchet.deliver_webhook"

REDIS_PREFIX = "ratchet:"
# Published after a commit that appended events to a task: wakes SSE streams and long polls.
EVENTS_CHANNEL_PREFIX = REDIS_PREFIX + "events:"
# Every rate-limiter key carries the {rl} hash tag: one cluster slot, so one script sees all.
RATE_LIMIT_PREFIX = REDIS_PREFIX + "{rl}:"
# Published when a cancel is requested for a running task: wakes its step in flight.
CANCELS_CHANNEL = REDIS_PREFIX + "cancels"
# The fleet's live view, per queue name (one fleet per queue): a sorted set of the processes
# that run steps, each with a record of its own that expires unless it is published again,
# and the sweeper's last run.
WORKERS_PREFIX = REDIS_PREFIX + "workers:"
WORKER_PREFIX = REDIS_PREFIX + "worker:"
LAST_SWEEP_PREFIX = REDIS_PREFIX + "last-sweep:"
# Published after a commit that left work for the dispatcher (a submission, a retry, a
# decision), per queue name: wakes the dispatcher that holds the lead.
DISPATCH_CHANNEL_PREFIX = REDIS_PREFIX + "dispatch:"
DISPATCH_GATE_PREFIX = REDIS_PREFIX + "dispatch-gate:"  # open: submissions may skip the backlog
# A task's live deltas (a Redis stream per task, capped, expiring: ``shared.deltas``; the
# {deltas} hash tag puts them in one cluster slot, so one script call appends a worker's batch),
# and the channel that wakes event streams when more came: its message names the tasks.
DELTAS_PREFIX = REDIS_PREFIX + "{deltas}:"
DELTAS_CHANNEL = REDIS_PREFIX + "delta-wakes"
