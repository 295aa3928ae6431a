"""The Idempotency-Key of the routes that submit work (a task, a turn, a fork, a batch): the
header that carries it, and their ``202 Accepted``, which names what the request made
(``Location``) and says when it answers a repeat of an earlier one (``Idempotent-Replayed``).
"""

from __future__ import annotations

from typing import Any

from fastapi import Header, Response

from shared.actions.effects import after_commit
from shared.actions.tasks import Submitted
from shared.observability import metrics

REPLAYED = "Idempotent-Replayed"


def key_header(returns: str) -> Any:
    """The ``Idempotency-Key`` header parameter; ``returns`` says what the same key and body
    sent again answer with."""
    return Header(
        max_length=255, description=f"the same key and body within 24 h returns {returns}"
    )


def accepted(description: str, *, location: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a submission's 202: ``description``, and its headers
    (``location`` says what the ``Location`` header names)."""
    return {
        202: {
            "description": description,
            "headers": {
                "Location": {"description": location, "schema": {"type": "string"}},
                REPLAYED: {
                    "description": "`true` when this answers a repeat of an earlier request",
                    "schema": {"type": "string", "enum": ["true"]},
                },
            },
        }
    }


def answer(response: Response, *, location: str, replayed: bool) -> None:
    """A submission's 202 headers: ``Location``, and ``Idempotent-Replayed`` when it answers
    a repeat of an earlier request with its Idempotency-Key (nothing was made this time)."""
    if replayed:
        response.headers[REPLAYED] = "true"
    response.headers["Location"] = location


def after_submit(done: Submitted) -> Submitted:
    """``done`` (a task, a turn or a fork) once it has committed: a task it made counted, and
    what it has to send sent; a repeat of an earlier request sends nothing again."""
    if done.created:
        metrics.tasks_submitted.inc()
    if not done.replayed:
        after_commit(done.effects)
    return done
