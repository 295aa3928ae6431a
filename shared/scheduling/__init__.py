"""Scheduling: admission of the backlog (fair across tenants, within concurrency limits), the
lead that one dispatcher holds, the direct-admission gate, wake-ups and schedules."""
