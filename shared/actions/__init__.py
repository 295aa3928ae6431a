"""Actions: what a client, an operator or the scheduler can do, one function each, in one
place — submit, cancel and retry a task, decide an approval, redeliver a webhook, manage
webhook endpoints, schedules, keys and limits.

Each action is one transaction: it takes a session, opens ``with session.begin():`` itself,
and returns its result together with the ``Effects`` its changes call for (the messages to
send once it has committed: see ``effects``). The front doors — the HTTP routes, the
dashboard's pages, the CLI — only parse, call an action, send its effects with
``effects.after_commit`` and shape the answer; they never import one another.
"""
