"""Rate limits: which buckets apply to a call (``rules``) and the token buckets that enforce
them, across the fleet in Redis (``limiter``) or in one process (``in_process``)."""
