"""``/v1/mcp-servers``: a tenant admin registers, lists and removes its tenant's own MCP
servers (Streamable HTTP). Their tools are open to the tenant's tasks alone, as
``<name>.<tool>`` or ``<name>.*``; another tenant's server is not found, and its tasks cannot
name it. Header values are never shown, only their names.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from api import params
from api.deps import Admin, SessionDep
from api.params import PageCursor, PageLimit, cursor_after
from api.problems import responses
from api.schemas.mcp_servers import McpServerCreate, McpServerList, McpServerOut
from shared.actions import mcp_servers as server_actions
from shared.store.audit import actor_of_key
from shared.store.tables import TenantMcpServer
from shared.views import aware

router = APIRouter(prefix="/v1/mcp-servers", tags=["mcp-servers"])
NOT_FOUND = "no such MCP server (another tenant's is not found either)"


def _out(row: TenantMcpServer) -> McpServerOut:
    created = aware(row.created_at)
    assert created is not None
    return McpServerOut(
        id=row.id,
        name=row.name,
        url=row.url,
        header_names=list(row.header_names),
        timeout_seconds=row.timeout_seconds,
        created_at=created,
    )


@router.get("", response_model=McpServerList, summary="List the tenant's MCP servers")
def list_servers(
    principal: Admin,
    session: SessionDep,
    limit: PageLimit = 50,
    cursor: PageCursor = None,
) -> McpServerList:
    """The tenant's own servers, oldest first, with their header names (never values)."""
    rows = server_actions.list_servers(
        session, principal.tenant_id, after=cursor_after(cursor), limit=limit + 1
    )
    page, next_cursor = params.page_of(rows, limit)
    return McpServerList(items=[_out(row) for row in page], next_cursor=next_cursor)


@router.post(
    "",
    status_code=201,
    response_model=McpServerOut,
    summary="Register an MCP server",
    responses=responses(
        {
            409: "the tenant already has a server of that name, or its most servers; or the "
            "headers need RATCHET_SECRETS_KEY, which the server lacks",
            422: "the body is invalid, the name is the operator's, or the egress policy "
            "refuses the URL",
        }
    ),
)
def create_server(body: McpServerCreate, principal: Admin, session: SessionDep) -> McpServerOut:
    """Register a Streamable HTTP MCP server for the tenant's tasks. ``${secret:NAME}`` in a
    header value is replaced by the tenant's secret when a worker connects."""
    row = server_actions.add_server(
        session,
        principal.tenant_id,
        name=body.name,
        url=body.url,
        headers=body.headers,
        timeout_seconds=body.timeout_seconds,
        actor=actor_of_key(principal.key_id),
    )
    return _out(row)


@router.delete(
    "/{server_id}",
    status_code=204,
    response_class=Response,
    summary="Remove an MCP server",
    responses=responses({404: NOT_FOUND}),
)
def delete_server(server_id: str, principal: Admin, session: SessionDep) -> Response:
    """Remove the server: tasks that name it find no such server from their next step on."""
    server_actions.remove_server(
        session, principal.tenant_id, server_id, actor=actor_of_key(principal.key_id)
    )
    return Response(status_code=204)
