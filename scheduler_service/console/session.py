"""Console sign-in: a server-side session (the cookie holds only a random session id, never the
API token), a per-session form token against CSRF, and an Origin check on every form post."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, Request, Response
from sqlalchemy.orm import Session

from scheduler_service.auth.repository import ConsoleSessionRepository, TokenRepository
from scheduler_service.auth.service import Principal, authenticate
from scheduler_service.auth.tokens import Role
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import ConsoleSession
from scheduler_service.deps import SessionDep

COOKIE_NAME = "greenflow_console"
# A session ends this long after sign-in, or earlier when its token is revoked or expires.
COOKIE_MAX_AGE_S = 12 * 3600
CONSOLE_ROLES = frozenset({Role.OPERATOR, Role.USER})
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{20,100}")


class NeedsSignIn(Exception):
    """The request has no valid console session; the console answers with the sign-in page."""


class BadFormToken(Exception):
    """A state-changing form came without this session's form token, or from another origin."""


@dataclass(frozen=True)
class ConsoleUser:
    """The signed-in caller, its session and the form token its forms must carry."""

    principal: Principal
    form_token: str
    session_id: int

    @property
    def is_operator(self) -> bool:
        """Operators see everything and may act on every job."""
        return self.principal.is_operator


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def sign_in_principal(session: SessionDep, api_token: str) -> Principal | None:
    """The principal for a token typed at sign-in, when it may use the console."""
    principal = authenticate(session, api_token.strip())
    if principal is None or principal.role not in CONSOLE_ROLES:
        return None
    return principal


def start_session(session: Session, principal: Principal) -> str:
    """Store a new console session for `principal`; return its id (for the cookie only)."""
    session_id = secrets.token_urlsafe(32)
    now = utcnow()
    ConsoleSessionRepository(session).add(
        ConsoleSession(
            session_sha256=_digest(session_id),
            token_id=principal.token_id,
            csrf_token=secrets.token_hex(32),
            created_at=now,
            expires_at=now + timedelta(seconds=COOKIE_MAX_AGE_S),
        )
    )
    return session_id


def end_session(session: Session, user: ConsoleUser) -> None:
    """Forget a console session (sign-out): its id and form token stop working at once."""
    ConsoleSessionRepository(session).delete(user.session_id)


def set_session_cookie(response: Response, request: Request, session_id: str) -> None:
    """The session id in an HttpOnly, SameSite=Strict cookie (Secure over https)."""
    response.set_cookie(
        COOKIE_NAME,
        session_id,
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
    """The signed-in caller: its session, and the token behind it still valid, on every request."""
    session_id = request.cookies.get(COOKIE_NAME, "")
    if not _SESSION_ID.fullmatch(session_id):
        raise NeedsSignIn()
    sessions = ConsoleSessionRepository(session)
    row = sessions.by_digest(_digest(session_id))
    now = utcnow()
    if row is None:
        raise NeedsSignIn()
    if row.expires_at <= now:
        sessions.delete(row.id)
        raise NeedsSignIn()
    token = TokenRepository(session).by_token_id(row.token_id)
    if (
        token is None
        or token.revoked_at is not None
        or (token.expires_at is not None and token.expires_at <= now)
        or Role(token.role) not in CONSOLE_ROLES
    ):
        sessions.delete(row.id)
        raise NeedsSignIn()
    principal = Principal(name=token.name, role=Role(token.role), token_id=token.token_id)
    return ConsoleUser(principal=principal, form_token=row.csrf_token, session_id=row.id)


def check_same_origin(request: Request) -> None:
    """Raise `BadFormToken` for a form posted from another site (Origin or Sec-Fetch-Site)."""
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.url.netloc}"
    if origin is not None and origin != own:
        raise BadFormToken()
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise BadFormToken()


def check_form_token(request: Request, user: ConsoleUser, presented: str) -> None:
    """Raise `BadFormToken` unless the form came from this site with this session's token."""
    check_same_origin(request)
    if not hmac.compare_digest(user.form_token.encode(), presented.encode("utf-8", "replace")):
        raise BadFormToken()


CurrentUser = Annotated[ConsoleUser, Depends(current_user)]
