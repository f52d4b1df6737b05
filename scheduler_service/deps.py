"""FastAPI dependencies: the database session of a request and the authenticated caller."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, Union, get_args, get_origin

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


def _takes_many(annotation: Any) -> bool:
    """Whether a query parameter of this type takes repeated values (a list, set or tuple)."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_takes_many(arg) for arg in get_args(annotation))
    kind = origin or annotation
    return (
        isinstance(kind, type)
        and issubclass(kind, (Sequence, set, frozenset))
        and not (issubclass(kind, (str, bytes)))
    )


def _query_params(dependant: Dependant) -> dict[str, bool]:
    """Query parameters the route declares (its dependencies' included): name -> takes many."""
    params = {p.alias: _takes_many(p.field_info.annotation) for p in dependant.query_params}
    for sub in dependant.dependencies:
        params |= _query_params(sub)
    return params


def reject_unknown_query_params(request: Request) -> None:
    """422 for query parameters the route does not declare, and for a one-value parameter given
    several times (a typo, or a second value, must not be silently ignored)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known = _query_params(dependant)
    errors: list[dict[str, Any]] = [
        {"loc": ["query", name], "msg": "unknown query parameter", "type": "extra_forbidden"}
        for name in sorted(set(request.query_params.keys()) - set(known))
    ]
    for name, many in sorted(known.items()):
        given = len(request.query_params.getlist(name))
        if not many and given > 1:
            errors.append(
                {
                    "loc": ["query", name],
                    "msg": f"given {given} times; this parameter takes one value",
                    "type": "too_many_values",
                }
            )
    if errors:
        raise RequestValidationError(errors)
