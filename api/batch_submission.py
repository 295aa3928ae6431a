"""Turning a batch's items into task specs, each on its own: an item that is not a valid
submission is refused in its own answer (a problem naming its ``tasks[i]`` fields), and the
others go ahead."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from api import submission
from api.problems import field_name, parse_field, validation_errors
from api.schemas.batches import BatchCreate
from api.schemas.tasks import TaskCreate
from shared.actions import batches as batch_actions
from shared.actions.batches import Item, Submitted
from shared.errors import InvalidRequest
from shared.settings import Settings, get_settings

VALIDATION_ERROR = "validation-error"
KEY_FIELD = "idempotency_key"  # an item's own Idempotency-Key, beside its submit body
MAX_KEY_LENGTH = 255  # as the Idempotency-Key header's


def submit(
    tenant_id: str, tenant_name: str, body: BatchCreate, idempotency_key: str | None
) -> Submitted:
    """The whole batch, run as one call on the thread pool: the count and the rate checked,
    each item checked, then the batch created (or, for a known Idempotency-Key, the original
    found) by the batch action, in one transaction."""
    settings = get_settings()
    most = settings.batch_max_tasks
    if len(body.tasks) > most:
        raise InvalidRequest(
            "tasks",
            f"a batch holds at most {most} tasks (RATCHET_BATCH_MAX_TASKS); "
            f"this one has {len(body.tasks)}",
        )
    submission.check_rate(tenant_name, tasks=len(body.tasks))
    items = [
        check_item(document, index, settings, tenant_id=tenant_id)
        for index, document in enumerate(body.tasks)
    ]
    return batch_actions.submit(
        tenant_id,
        tenant_name,
        items,
        idempotency_key=idempotency_key,
        request_hash=request_hash(body),
    )


def check_item(
    document: dict[str, Any], index: int, settings: Settings, *, tenant_id: str | None = None
) -> Item:
    """One item as a task spec with its own key and body hash (the hash a single submission
    of the body has, so one key names one task either way), or the error refusing it."""
    fields = {k: v for k, v in document.items() if k != KEY_FIELD}
    key = document.get(KEY_FIELD)
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_KEY_LENGTH):
        reason = f"must be a string of 1 to {MAX_KEY_LENGTH} characters"
        return Item(error=_invalid(f"tasks[{index}].{KEY_FIELD}", reason))
    try:
        body = TaskCreate.model_validate(fields)
        spec = submission.resolve(body, settings, tenant_id=tenant_id)
    except ValidationError as exc:
        return Item(error=_invalid_body(exc, index, document))
    except InvalidRequest as exc:
        return Item(error=_invalid(f"tasks[{index}].{exc.field}", exc.reason))
    return Item(spec=spec, idempotency_key=key, request_hash=submission.request_hash(body))


def request_hash(body: BatchCreate) -> str:
    """The batch's body, canonical: the same items in the same order hash the same."""
    canonical = json.dumps(body.tasks, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _invalid(field: str, reason: str) -> dict[str, Any]:
    pointer = field_name(parse_field(field))[1]
    errors = [{"field": field, "pointer": pointer, "detail": reason}]
    return {"type": VALIDATION_ERROR, "detail": f"{field}: {reason}", "errors": errors}


def _invalid_body(exc: ValidationError, index: int, document: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's errors for an item, each field named within the whole request."""
    errors = []
    found: list[Any] = list(exc.errors(include_url=False))
    for error in validation_errors(found, document):
        inner = "" if error["field"] == "(body)" else error["field"]
        field = f"tasks[{index}]" + (f".{inner}" if inner and inner[0] != "[" else inner)
        pointer = f"#/tasks/{index}" + error["pointer"].removeprefix("#")
        errors.append({"field": field, "pointer": pointer.rstrip("/"), "detail": error["detail"]})
    detail = "; ".join(f"{e['field']}: {e['detail']}" for e in errors)
    return {"type": VALIDATION_ERROR, "detail": detail, "errors": errors}
