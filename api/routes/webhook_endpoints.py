"""``/v1/webhook-endpoints``: a tenant admin lists, adds, changes, disables, re-enables and
removes its tenant's default webhook endpoints, each shown with how its last day's deliveries
fared. Another tenant's endpoint is not found, whatever the key's scopes.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from api import params
from api.deps import Admin, SessionDep
from api.params import PageCursor, PageLimit, cursor_after
from api.problems import responses
from api.schemas.webhook_endpoints import EndpointCreate, EndpointList, EndpointOut, EndpointPatch
from shared.actions import webhooks as webhook_actions
from shared.actions.webhooks import Endpoint
from shared.webhooks import endpoints

router = APIRouter(prefix="/v1/webhook-endpoints", tags=["webhook-endpoints"])
NOT_FOUND = "no such endpoint (another tenant's is not found either)"


def _out(endpoint: Endpoint) -> EndpointOut:
    """The endpoint as the API shows it (``shared.actions.webhooks`` describes it)."""
    return EndpointOut.model_validate(endpoint, from_attributes=True)


@router.get("", response_model=EndpointList, summary="List the tenant's webhook endpoints")
def list_endpoints(
    principal: Admin,
    session: SessionDep,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> EndpointList:
    """The tenant's endpoints, newest first, disabled ones included, each with its last 24
    hours' deliveries."""
    after = cursor_after(cursor)
    with session.begin():
        rows = endpoints.list_for(session, principal.tenant_id, after=after, limit=limit + 1)
        page, next_cursor = params.page_of(rows, limit)
        items = [_out(e) for e in webhook_actions.describe(session, page)]
    return EndpointList(items=items, next_cursor=next_cursor)


@router.post(
    "",
    status_code=201,
    response_model=EndpointOut,
    summary="Add a webhook endpoint",
    responses=responses(
        {
            409: "the tenant has its most endpoints (RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT)",
            422: "the body is invalid, or the egress policy refuses the URL",
        }
    ),
)
def create_endpoint(body: EndpointCreate, principal: Admin, session: SessionDep) -> EndpointOut:
    """A new endpoint: from now on it receives the listed events of every task of the tenant
    (running processes see it within 5 s). A tenant has at most
    RATCHET_MAX_WEBHOOK_ENDPOINTS_PER_TENANT endpoints, disabled ones included."""
    added = webhook_actions.add_endpoint(
        session, principal.tenant_id, url=body.url, events=body.events
    )
    return _out(added)


@router.get(
    "/{endpoint_id}",
    response_model=EndpointOut,
    summary="Get a webhook endpoint",
    responses=responses({404: NOT_FOUND}),
)
def get_endpoint(endpoint_id: str, principal: Admin, session: SessionDep) -> EndpointOut:
    """The endpoint, with its last 24 hours' deliveries."""
    with session.begin():
        row = endpoints.get(session, principal.tenant_id, endpoint_id)
        [found] = webhook_actions.describe(session, [row])
    return _out(found)


@router.patch(
    "/{endpoint_id}",
    response_model=EndpointOut,
    summary="Change, disable or re-enable a webhook endpoint",
    responses=responses(
        {404: NOT_FOUND, 422: "the body is invalid, or the egress policy refuses the URL"}
    ),
)
def update_endpoint(
    endpoint_id: str, body: EndpointPatch, principal: Admin, session: SessionDep
) -> EndpointOut:
    """Change the URL or the events, or disable (``"enabled": false``, its reason naming the
    caller's key) or re-enable it. Disabling one already disabled keeps the first reason."""
    changed = webhook_actions.change_endpoint(
        session,
        principal.tenant_id,
        endpoint_id,
        url=body.url,
        events=body.events,
        enabled=body.enabled,
        by_key=principal.key_id,
    )
    return _out(changed)


@router.delete(
    "/{endpoint_id}",
    status_code=204,
    response_class=Response,
    summary="Remove a webhook endpoint",
    responses=responses({404: NOT_FOUND}),
)
def delete_endpoint(endpoint_id: str, principal: Admin, session: SessionDep) -> Response:
    """Remove the endpoint; its deliveries still queued are not sent."""
    webhook_actions.remove_endpoint(session, principal.tenant_id, endpoint_id)
    return Response(status_code=204)
