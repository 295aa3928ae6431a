"""The fleet's limits: ``/v1/admin/*`` is the operator's fleet-wide view (``operator``
scope) of the rate-limit buckets and of the concurrency limits in force with their use
(changeable at runtime, recorded with who and when); ``/v1/ratelimits`` shows a tenant admin
its own tenant's buckets and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Response

from api.deps import Admin, Operator, SessionDep
from api.problems import responses
from api.schemas.limits import ConcurrencyView, LimitOut
from shared.actions import limits as limit_actions
from shared.ratelimit.buckets import Bucket, LimiterUnavailable
from shared.ratelimit.rules import configured_buckets, tenant_buckets

router = APIRouter(tags=["admin"])


def view(buckets: Sequence[Bucket], *, scope_prefix: str = "") -> dict[str, Any]:
    """The buckets as ``limit_actions.read_buckets`` reads them; a 503 if the limiter's store
    does not answer."""
    try:
        return limit_actions.read_buckets(buckets, scope_prefix=scope_prefix)
    except LimiterUnavailable as exc:
        raise HTTPException(503, str(exc)) from exc


LIMITER_DOWN = responses(
    {503: "the database or the rate limiter (Redis) is unavailable; retry shortly"}
)


@router.get(
    "/v1/admin/ratelimits",
    summary="The fleet's rate-limit buckets (operator)",
    responses=LIMITER_DOWN,
)
def fleet_rate_limits(_: Operator) -> dict[str, Any]:
    """Every configured bucket of the fleet, every tenant's included (operator scope)."""
    return view(configured_buckets())


@router.get(
    "/v1/ratelimits", summary="The tenant's rate-limit buckets (admin)", responses=LIMITER_DOWN
)
def tenant_rate_limits(principal: Admin) -> dict[str, Any]:
    """The caller's tenant's own buckets (admin scope); never another tenant's."""
    name = principal.tenant_name
    return view(tenant_buckets(name), scope_prefix=f"tenant:{name}:")


KindPath = Annotated[
    Literal["tenants", "agents", "pools"], Path(description="what the limit applies to")
]
NamePath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=200,
        description="the tenant's name, the agent, the pool's name, or `*` (every tenant, "
        "every agent)",
    ),
]


@router.get(
    "/v1/admin/concurrency",
    response_model=ConcurrencyView,
    summary="Concurrency limits in force and their use (operator)",
)
def concurrency_view(_: Operator, session: SessionDep) -> ConcurrencyView:
    """Every limit (from the configuration, or set at runtime), and what each tenant, agent
    and pool holds now; tenants also with their backlog."""
    return ConcurrencyView.model_validate(
        limit_actions.read_concurrency(session), from_attributes=True
    )


@router.put(
    "/v1/admin/concurrency/{kind}/{name}",
    response_model=LimitOut,
    summary="Set a concurrency limit at runtime (operator)",
    responses=responses({422: "the limit is not valid for its kind (``errors`` names the field)"}),
)
def set_limit(
    kind: KindPath, name: NamePath, spec: dict[str, Any], principal: Operator, session: SessionDep
) -> LimitOut:
    """Overrides the configured limit of the same kind and name (the whole entry) for the
    whole fleet, within a second. Tenants: ``max_running``, ``max_queued``, ``weight``;
    agents: ``max_running``; pools: ``max_running`` and the ``models``, ``agents`` and
    ``tenants`` patterns they hold."""
    by = f"key:{principal.key_id} ({principal.tenant_name})"
    limit = limit_actions.set_limit(session, kind, name, spec, by=by)
    return LimitOut.model_validate(limit, from_attributes=True)


@router.delete(
    "/v1/admin/concurrency/{kind}/{name}",
    status_code=204,
    summary="Remove a runtime concurrency limit (operator)",
    responses=responses({404: "no limit of that kind and name was set at runtime"}),
)
def delete_limit(kind: KindPath, name: NamePath, _: Operator, session: SessionDep) -> Response:
    """The configured limit (if any) applies again."""
    limit_actions.remove_limit(session, kind, name)
    return Response(status_code=204)
