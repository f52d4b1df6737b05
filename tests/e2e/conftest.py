"""Fixtures for the end-to-end tests (shared with the API tests)."""

from tests.api.conftest import postgres_server

__all__ = ["postgres_server"]
