"""Slow down guessing: after a few failed sign-ins or bearer checks, an address waits.

Per client address, in this process's memory: the first `free` failures within `window_s` cost
nothing; each one after that makes the address wait twice as long (1 s, 2 s, 4 s, ... at most
`max_wait_s`) before its next attempt is even checked (429 with Retry-After meanwhile). A
success clears the address. With several replicas each keeps its own count.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Record:
    failures: int
    first_at: float
    blocked_until: float


@dataclass
class FailureThrottle:
    """Failed authentication attempts per client address, and how long each must wait."""

    free: int = 5
    window_s: float = 300.0
    max_wait_s: float = 60.0
    max_addresses: int = 100_000
    clock: Callable[[], float] = time.monotonic
    _records: OrderedDict[str, _Record] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_s(self, address: str) -> float:
        """Seconds this address must still wait before its next attempt is checked (0: none)."""
        now = self.clock()
        with self._lock:
            record = self._records.get(address)
            if record is None:
                return 0.0
            if now - record.first_at > self.window_s and now >= record.blocked_until:
                del self._records[address]
                return 0.0
            return max(0.0, record.blocked_until - now)

    def failed(self, address: str) -> None:
        """Record a failed attempt."""
        now = self.clock()
        with self._lock:
            record = self._records.get(address)
            if record is None or now - record.first_at > self.window_s:
                record = _Record(0, now, now)
            record.failures += 1
            over = record.failures - self.free
            if over > 0:
                record.blocked_until = now + min(2.0 ** (over - 1), self.max_wait_s)
            self._records[address] = record
            self._records.move_to_end(address)
            while len(self._records) > self.max_addresses:
                self._records.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """A correct credential from this address: forget its failures."""
        if address in self._records:
            with self._lock:
                self._records.pop(address, None)


def retry_after(wait_s: float) -> str:
    """The Retry-After header value for a wait."""
    return str(max(1, math.ceil(wait_s)))
