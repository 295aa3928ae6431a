"""The database: tables, engine and sessions, migrations, and every query and write on them
(tasks, leases, fenced writes, checkpoints, the tool-call ledger, events, the webhook outbox,
tenants and keys). Functions take a session; the caller owns the transaction."""
