"""Only one scheduler replica runs the control loop: a PostgreSQL session advisory lock."""

from __future__ import annotations

import logging

from sqlalchemy import Connection, Engine, text

log = logging.getLogger(__name__)

# Arbitrary constant naming the lock ("GreenFlow control loop").
LOOP_LOCK_KEY = 0x6772_6E66_6C6F_7700 & 0x7FFF_FFFF_FFFF_FFFF


class LeaderLock:
    """Held while this process keeps its dedicated session; SQLite (one replica) needs none."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: Connection | None = None

    @property
    def needs_lock(self) -> bool:
        """Only PostgreSQL can have several replicas."""
        return self.engine.dialect.name == "postgresql"

    def try_acquire(self) -> bool:
        """True when this process is (or just became) the leader."""
        if not self.needs_lock:
            return True
        try:
            if self._conn is not None:
                # Still ours while the session lives; a dead connection means we lost it.
                self._conn.execute(text("SELECT 1"))
                return True
            # Autocommit: a session-level advisory lock needs no transaction, and one left open
            # would sit "idle in transaction" for the life of the process (holding back vacuum).
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            got = bool(
                conn.execute(
                    text("SELECT pg_try_advisory_lock(:key)"), {"key": LOOP_LOCK_KEY}
                ).scalar()
            )
            if got:
                self._conn = conn
                log.info("this replica now runs the control loop")
                return True
            conn.invalidate()
            conn.close()
            return False
        except Exception:
            log.exception("leader lock check failed; stepping down")
            self.release()
            return False

    def release(self) -> None:
        """Give up leadership: unlock, and end the session rather than return it to the pool."""
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": LOOP_LOCK_KEY})
            except Exception:
                log.debug("unlocking failed; dropping the session frees the lock", exc_info=True)
            try:
                # A pooled connection would keep the session, and with it the lock, alive.
                self._conn.invalidate()
                self._conn.close()
            except Exception:
                log.debug("closing the leader connection failed", exc_info=True)
            self._conn = None
