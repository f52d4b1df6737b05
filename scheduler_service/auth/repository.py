"""Queries on api_tokens."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from scheduler_service.db.models import ApiToken, ConsoleSession


class TokenRepository:
    """All SQL touching api_tokens."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, token: ApiToken) -> ApiToken:
        """Stage a new token row."""
        self.session.add(token)
        self.session.flush()
        return token

    def by_token_id(self, token_id: str) -> ApiToken | None:
        """The token with this public id, if any."""
        return self.session.scalar(select(ApiToken).where(ApiToken.token_id == token_id))

    def active_by_name(self, name: str, role: str) -> list[ApiToken]:
        """Unrevoked tokens of this role and name (at most one, by the unique index)."""
        return list(
            self.session.scalars(
                select(ApiToken).where(
                    ApiToken.name == name, ApiToken.role == role, ApiToken.revoked_at.is_(None)
                )
            )
        )

    def list(self) -> list[ApiToken]:
        """Every token, oldest first."""
        return list(self.session.scalars(select(ApiToken).order_by(ApiToken.id)))


class ConsoleSessionRepository:
    """All SQL touching console_sessions."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, row: ConsoleSession) -> ConsoleSession:
        """Stage a new console session."""
        self.session.add(row)
        self.session.flush()
        return row

    def by_digest(self, session_sha256: str) -> ConsoleSession | None:
        """The session whose id hashes to this digest."""
        return self.session.scalar(
            select(ConsoleSession).where(ConsoleSession.session_sha256 == session_sha256)
        )

    def delete(self, row_id: int) -> None:
        """End a session."""
        self.session.execute(delete(ConsoleSession).where(ConsoleSession.id == row_id))
