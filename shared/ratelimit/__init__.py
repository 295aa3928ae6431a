"""Rate limits: which buckets apply to a call (``limits``) and the Redis token buckets that
enforce them across the fleet (``limiter``)."""
