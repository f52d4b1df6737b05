"""Fixtures for energy_model tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from energy_model.carbon.base import HttpSettings
from tests.energy_model.fake_http import FakeServer, serve


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """A real local HTTP server with scripted replies."""
    yield from serve()


@pytest.fixture
def fast_http() -> HttpSettings:
    """Short timeouts and backoff so failure tests run quickly."""
    return HttpSettings(timeout_s=0.3, attempts=3, backoff_initial_s=0.01, backoff_max_s=0.02)


class FakeClock:
    """A settable UTC clock."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> FakeClock:
    """A clock fixed at 2024-03-06 19:10 UTC until advanced."""
    return FakeClock(datetime(2024, 3, 6, 19, 10, tzinfo=UTC))
