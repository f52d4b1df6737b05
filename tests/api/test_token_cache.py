"""The token cache: a burst of requests costs one lookup; revocation is honoured within its TTL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import event

from scheduler_service.auth.cache import TokenCache
from scheduler_service.auth.service import Principal, revoke_token
from scheduler_service.auth.tokens import Role
from scheduler_service.db.session import transaction
from tests.api.conftest import Tokens, auth

ALICE = Principal(name="alice", role=Role.USER, token_id="abc")


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_an_entry_lasts_its_ttl_and_no_longer() -> None:
    clock = FakeClock()
    cache = TokenCache(5.0, clock=clock)
    cache.put("gf_abc_secret", ALICE, None)
    clock.now_s += 4.9
    assert cache.get("gf_abc_secret") == ALICE
    clock.now_s += 0.2
    assert cache.get("gf_abc_secret") is None


def test_a_different_secret_never_matches() -> None:
    cache = TokenCache(5.0, clock=FakeClock())
    cache.put("gf_abc_secret", ALICE, None)
    assert cache.get("gf_abc_secreT") is None
    assert cache.get("gf_abc_secret ") is None


def test_an_entry_never_outlives_the_token() -> None:
    clock = FakeClock()
    cache = TokenCache(5.0, clock=clock)
    cache.put("gf_abc_expired", ALICE, datetime.now(UTC) - timedelta(seconds=1))
    assert cache.get("gf_abc_expired") is None
    cache.put("gf_abc_soon", ALICE, datetime.now(UTC) + timedelta(seconds=2))
    clock.now_s += 2.5
    assert cache.get("gf_abc_soon") is None


def test_ttl_zero_caches_nothing_and_size_is_bounded() -> None:
    off = TokenCache(0.0, clock=FakeClock())
    off.put("gf_abc_secret", ALICE, None)
    assert off.get("gf_abc_secret") is None
    small = TokenCache(5.0, max_entries=2, clock=FakeClock())
    for name in ("a", "b", "c"):
        small.put(f"gf_{name}_secret", ALICE, None)
    assert [small.get(f"gf_{n}_secret") is not None for n in ("a", "b", "c")] == [
        False,
        True,
        True,
    ]


@contextmanager
def token_lookups(client: TestClient) -> Iterator[list[str]]:
    """The SQL statements that read api_tokens while the block runs."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    seen: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if "FROM api_tokens" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_requests_reuse_a_token_and_a_revoked_one_stops_within_the_ttl(
    client: TestClient, tokens: Tokens
) -> None:
    clock = FakeClock()
    client.app.state.token_cache = TokenCache(5.0, clock=clock)  # type: ignore[attr-defined]
    with token_lookups(client) as lookups:
        for _ in range(5):
            assert client.get("/v1/jobs", headers=auth(tokens.alice)).status_code == 200
    assert len(lookups) == 1
    factory = client.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        revoke_token(session, tokens.alice.split("_")[1])
    # Within the TTL the process may still accept it; once the TTL has passed it must not.
    clock.now_s += 5.0
    assert client.get("/v1/jobs", headers=auth(tokens.alice)).status_code == 401
    assert client.get("/v1/jobs", headers=auth(tokens.bob)).status_code == 200
