"""API keys (`Authorization: Bearer KEY`) to a Principal: which tenant, which role.

Roles: `user` may run inference and list models; `admin` may also manage its tenant's adapters and keys
and read its reports; `operator` (no tenant) manages tenants and may act on any tenant by naming it.
Another tenant's objects are always "not found", never "forbidden": their existence is not revealed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store.errors import NotFoundError

from .errors import bad_request, forbidden, not_found, unauthorized
from .state import ServerState, get_state

_bearer = HTTPBearer(auto_error=False, description="An API key made by `loraplex tenants create` or `keys create`")

ROLE_RANK = {"user": 0, "admin": 1, "operator": 2}


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant_id: str | None  # None for the operator
    role: str

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"


async def principal(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
                    ) -> Principal:
    if credentials is None or not credentials.credentials:
        raise unauthorized("missing API key: send it as 'Authorization: Bearer KEY'")
    state: ServerState = get_state(request)
    key = await run_in_threadpool(state.registry.authenticate, credentials.credentials)
    if key is None:
        raise unauthorized("unknown or revoked API key")
    return Principal(key_id=key.id, tenant_id=key.tenant_id, role=key.role)


def require(role: str):
    """A dependency: the caller's key must have at least this role."""

    async def check(p: Principal = Depends(principal)) -> Principal:
        if ROLE_RANK[p.role] < ROLE_RANK[role]:
            raise forbidden(f"this needs an {role} key; yours is a {p.role} key")
        return p

    return check


async def tenant_for(state: ServerState, p: Principal, tenant_name: str | None, required: bool = True) -> str | None:
    """The tenant id an action applies to. A tenant key acts on its own tenant (naming another one is
    'not found'); the operator names the tenant (or, where allowed, none: every tenant)."""
    if not p.is_operator:
        if tenant_name is not None:
            own = await run_in_threadpool(state.registry.get_tenant, p.tenant_id)
            if own.name != tenant_name:
                raise not_found(f"tenant {tenant_name!r} does not exist", param="tenant")
        return p.tenant_id
    if tenant_name is None:
        if required:
            raise bad_request("operator keys belong to no tenant: name one with the 'tenant' parameter",
                              param="tenant")
        return None
    try:
        return (await run_in_threadpool(state.registry.get_tenant_by_name, tenant_name)).id
    except NotFoundError:
        raise not_found(f"tenant {tenant_name!r} does not exist", param="tenant") from None
