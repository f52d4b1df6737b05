"""FastAPI dependencies: the database session of a request and the authenticated caller."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from scheduler_service.auth.service import Principal, authenticate
from scheduler_service.auth.tokens import Role
from scheduler_service.db.session import transaction
from scheduler_service.settings import GreenflowConfig


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request: committed when the handler returns, before the response."""
    with transaction(request.app.state.session_factory) as session:
        yield session


# scope="function": commit before the response is sent, so a client's next request sees it.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

_bearer = HTTPBearer(
    auto_error=False, description="A GreenFlow API token (`greenflow token create`)."
)


def get_principal(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, from its bearer token; 401 when missing or wrong."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing bearer token (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    principal = authenticate(session, credentials.credentials)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="invalid or revoked token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


def require_roles(*roles: Role) -> Callable[[Principal], Principal]:
    """A dependency that lets only the given roles through (403 otherwise)."""

    def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if principal.role not in roles:
            allowed = ", ".join(r.value for r in roles)
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, detail=f"this endpoint needs role {allowed}"
            )
        return principal

    return check


UserOrOperator = Annotated[Principal, Depends(require_roles(Role.USER, Role.OPERATOR))]
Operator = Annotated[Principal, Depends(require_roles(Role.OPERATOR))]
Agent = Annotated[Principal, Depends(require_roles(Role.AGENT))]


def get_config(request: Request) -> GreenflowConfig:
    """The validated greenflow.toml of this app."""
    config: GreenflowConfig = request.app.state.config
    return config


ConfigDep = Annotated[GreenflowConfig, Depends(get_config)]


def _query_param_names(dependant: Dependant) -> set[str]:
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_param_names(sub)
    return names


def reject_unknown_query_params(request: Request) -> None:
    """422 for query parameters the route does not declare (a typo must not be silently ignored)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known = _query_param_names(dependant)
    unknown = sorted(set(request.query_params.keys()) - known)
    if unknown:
        raise RequestValidationError(
            [
                {
                    "loc": ["query", name],
                    "msg": "unknown query parameter",
                    "type": "extra_forbidden",
                }
                for name in unknown
            ]
        )
