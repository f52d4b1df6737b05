"""Queries on api_tokens."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler_service.db.models import ApiToken


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

    def list(self) -> list[ApiToken]:
        """Every token, oldest first."""
        return list(self.session.scalars(select(ApiToken).order_by(ApiToken.id)))
