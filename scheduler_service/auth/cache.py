"""A short-lived cache of authenticated tokens: a burst of requests costs one token lookup.

A token revoked (or expired) in the database keeps working in a process for at most `ttl_s`
seconds: each replica reads it again after that. Only successful authentications are cached,
keyed by the SHA-256 of the whole presented token, so a wrong secret never matches an entry.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime

from scheduler_service.auth.service import Principal
from scheduler_service.db.base import utcnow


class TokenCache:
    """Principals of recently authenticated tokens, each kept at most `ttl_s` seconds."""

    def __init__(
        self,
        ttl_s: float,
        *,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[float, Principal]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(plaintext: str) -> bytes:
        return hashlib.sha256(plaintext.encode("utf-8", "surrogateescape")).digest()

    def get(self, plaintext: str) -> Principal | None:
        """The cached principal of this token, or None when absent or older than `ttl_s`."""
        if self.ttl_s <= 0:
            return None
        key = self._key(plaintext)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if self._clock() >= entry[0]:
                del self._entries[key]
                return None
            return entry[1]

    def put(self, plaintext: str, principal: Principal, expires_at: datetime | None) -> None:
        """Remember a token that just authenticated (never past the token's own expiry)."""
        if self.ttl_s <= 0:
            return
        keep_s = self.ttl_s
        if expires_at is not None:
            keep_s = min(keep_s, (expires_at - utcnow()).total_seconds())
        if keep_s <= 0:
            return
        key = self._key(plaintext)
        with self._lock:
            self._entries[key] = (self._clock() + keep_s, principal)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every token (the next request of each reads the database)."""
        with self._lock:
            self._entries.clear()
