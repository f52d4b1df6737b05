"""FastAPI dependencies: the database session of a request and the authenticated caller."""

from __future__ import annotations

import types
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from fastapi import Depends, HTTPException, Request, status
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from scheduler_service.auth.cache import TokenCache
from scheduler_service.auth.service import Principal, authenticate_until
from scheduler_service.auth.throttle import FailureThrottle, retry_after
from scheduler_service.auth.tokens import Role
from scheduler_service.db.session import transaction
from scheduler_service.settings import GreenflowConfig


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request: committed when the handler returns, before the response."""
    with transaction(request.app.state.session_factory) as session:
        yield session
    request.app.state.database_watch.up()


# scope="function": commit before the response is sent, so a client's next request sees it.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

_bearer = HTTPBearer(
    auto_error=False, description="A GreenFlow API token (`greenflow token create`)."
)


# The cheap dependencies are `async def`: FastAPI runs a plain `def` one in the thread pool, a
# thread hop each (five per submission made the API's CPU per request several times a bare
# endpoint's). What may block on the database goes to the pool explicitly.


async def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, from its bearer token (reused from the token cache for a few seconds)."""
    if credentials is not None and credentials.scheme.lower() == "bearer":
        throttle: FailureThrottle = request.app.state.auth_throttle
        cache: TokenCache = request.app.state.token_cache
        principal = cache.get(credentials.credentials)
        if principal is not None and throttle.wait_s(client_address(request)) <= 0:
            return principal
    return await run_in_threadpool(_authenticate, request, credentials, cached=True)


async def get_fresh_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, its token read from the database now (for what a revoked token must never do
    again, such as registering a node)."""
    return await run_in_threadpool(_authenticate, request, credentials, cached=False)


def _authenticate(
    request: Request, credentials: HTTPAuthorizationCredentials | None, *, cached: bool
) -> Principal:
    """The caller, from its bearer token; 401 when missing or wrong."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing bearer token (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    throttle: FailureThrottle = request.app.state.auth_throttle
    address = client_address(request)
    wait_s = throttle.wait_s(address)
    if wait_s > 0:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            detail="too many failed authentication attempts from this address; wait and retry",
            headers={"Retry-After": retry_after(wait_s)},
        )
    cache: TokenCache = request.app.state.token_cache
    principal = cache.get(credentials.credentials) if cached else None
    if principal is not None:
        return principal
    # Its own short transaction, done before the handler's: a request never holds two
    # connections at once, so concurrent requests cannot exhaust the pool waiting on each other.
    with transaction(request.app.state.session_factory) as session:
        found = authenticate_until(session, credentials.credentials)
    principal = found[0] if found is not None else None
    if found is not None:
        cache.put(credentials.credentials, *found)
    if principal is None:
        throttle.failed(address)
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="invalid or revoked token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    throttle.succeeded(address)
    return principal


def client_address(request: Request) -> str:
    """The peer address the throttle counts failures by."""
    return request.client.host if request.client is not None else "unknown"


# Module-level names: with postponed annotations FastAPI resolves these in the module.
CachedPrincipal = Annotated[Principal, Depends(get_principal)]
FreshPrincipal = Annotated[Principal, Depends(get_fresh_principal)]


def require_roles(
    *roles: Role, fresh: bool = False
) -> Callable[[Principal], Coroutine[Any, Any, Principal]]:
    """A dependency that lets only the given roles through (403 otherwise); `fresh` reads the
    token from the database on every request instead of the token cache."""

    def allowed(principal: Principal) -> Principal:
        if principal.role not in roles:
            names = ", ".join(r.value for r in roles)
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, detail=f"this endpoint needs role {names}"
            )
        return principal

    async def check(principal: CachedPrincipal) -> Principal:
        return allowed(principal)

    async def check_fresh(principal: FreshPrincipal) -> Principal:
        return allowed(principal)

    return check_fresh if fresh else check


UserOrOperator = Annotated[Principal, Depends(require_roles(Role.USER, Role.OPERATOR))]
Operator = Annotated[Principal, Depends(require_roles(Role.OPERATOR))]
Agent = Annotated[Principal, Depends(require_roles(Role.AGENT))]
# Registering (re-)admits a node: a credential revoked a moment ago must not, even from the cache.
FreshAgent = Annotated[Principal, Depends(require_roles(Role.AGENT, fresh=True))]


async def get_config(request: Request) -> GreenflowConfig:
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


# Per route (its dependant lives as long as the app): the walk above is done once, not per request.
_KNOWN_QUERY_PARAMS: dict[int, tuple[Dependant, dict[str, bool]]] = {}


def _known_query_params(dependant: Dependant) -> dict[str, bool]:
    cached = _KNOWN_QUERY_PARAMS.get(id(dependant))
    if cached is None or cached[0] is not dependant:
        cached = (dependant, _query_params(dependant))
        _KNOWN_QUERY_PARAMS[id(dependant)] = cached
    return cached[1]


async def reject_unknown_query_params(request: Request) -> None:
    """422 for query parameters the route does not declare, and for a one-value parameter given
    several times (a typo, or a second value, must not be silently ignored)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    if not request.scope.get("query_string"):
        return
    known = _known_query_params(dependant)
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
