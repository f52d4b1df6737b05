"""Console sign-in: the API token in an HttpOnly, SameSite=Strict cookie, and per-session form tokens."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request, Response

from scheduler_service.auth.service import Principal, authenticate
from scheduler_service.auth.tokens import Role
from scheduler_service.deps import SessionDep

COOKIE_NAME = "greenflow_console"
# The browser forgets the sign-in after this long even if the token stays valid.
COOKIE_MAX_AGE_S = 12 * 3600
CONSOLE_ROLES = frozenset({Role.OPERATOR, Role.USER})


class NeedsSignIn(Exception):
    """The request has no valid console cookie; the console answers with the sign-in page."""


class BadFormToken(Exception):
    """A state-changing form came without this session's form token (possible CSRF)."""


@dataclass(frozen=True)
class ConsoleUser:
    """The signed-in caller and the form token its forms must carry."""

    principal: Principal
    form_token: str

    @property
    def is_operator(self) -> bool:
        """Operators see everything and may act on every job."""
        return self.principal.is_operator


def form_token_for(api_token: str) -> str:
    """The per-session form token: an HMAC keyed by the (secret) API token in the cookie."""
    return hmac.new(api_token.encode(), b"greenflow-console-form", hashlib.sha256).hexdigest()


def sign_in_principal(session: SessionDep, api_token: str) -> Principal | None:
    """The principal for a token typed at sign-in, when it may use the console."""
    principal = authenticate(session, api_token.strip())
    if principal is None or principal.role not in CONSOLE_ROLES:
        return None
    return principal


def set_session_cookie(response: Response, request: Request, api_token: str) -> None:
    """Store the token in an HttpOnly, SameSite=Strict cookie (Secure over https)."""
    response.set_cookie(
        COOKIE_NAME,
        api_token,
        max_age=COOKIE_MAX_AGE_S,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session_cookie(response: Response, request: Request) -> None:
    """Remove the console cookie."""
    response.delete_cookie(
        COOKIE_NAME,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def current_user(request: Request, session: SessionDep) -> ConsoleUser:
    """The signed-in caller, verified against the token table on every request."""
    api_token = request.cookies.get(COOKIE_NAME)
    if not api_token:
        raise NeedsSignIn()
    principal = sign_in_principal(session, api_token)
    if principal is None:
        raise NeedsSignIn()
    return ConsoleUser(principal=principal, form_token=form_token_for(api_token))


def check_form_token(user: ConsoleUser, presented: str) -> None:
    """Raise `BadFormToken` unless the form carried this session's token."""
    if not hmac.compare_digest(user.form_token, presented):
        raise BadFormToken()


CurrentUser = Annotated[ConsoleUser, Depends(current_user)]
