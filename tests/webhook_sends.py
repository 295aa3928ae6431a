"""The webhook sends this process has going in the background, to be waited for before the
database they write to changes."""

from __future__ import annotations


def finish_webhook_sends() -> None:
    """Wait for the webhook sends this process has queued or in flight: each writes its
    outcome to the database configured when it runs, which is about to change."""
    from workers import webhook_sender

    webhook_sender.wait_for_sends()
