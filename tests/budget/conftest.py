"""The API fixtures (database, app client, tokens) for the budget tests."""

from tests.api.conftest import client, database_url, postgres_server, tokens  # noqa: F401
