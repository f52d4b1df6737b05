"""A PostgreSQL server of the test's own (initdb + pg_ctl in a temp dir, on a free port), which
the test may stop and start again: the shared server must never go down under other tests."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import free_port


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def _as_server_user() -> list[str]:
    # initdb and postgres refuse to run as root: run them as the postgres user then.
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


@dataclass
class PrivatePostgres:
    """One private server: its data directory, port and URL."""

    bin_dir: Path
    data_dir: Path
    port: int

    @property
    def url(self) -> str:
        """SQLAlchemy URL of its `postgres` database (trust auth)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [*_as_server_user(), str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", options, "-l", str(self.data_dir / "server.log"), "-w", "start")

    def stop(self) -> None:
        """Stop it at once (open connections are cut, as in an outage)."""
        self._ctl("-m", "immediate", "-w", "stop")


def postgres_available() -> bool:
    """Whether initdb/pg_ctl exist and can run here."""
    if _bin_dir() is None:
        return False
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return False
    return True


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A fresh server in a temp dir of its own (the server user must reach it), stopped and
    removed afterwards."""
    bin_dir = _bin_dir()
    assert bin_dir is not None
    home = Path(tempfile.mkdtemp(prefix="greenflow-pg-"))
    data_dir = home / "pgdata"
    data_dir.mkdir(mode=0o700)
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(home, owner.pw_uid, owner.pw_gid)
        os.chown(data_dir, owner.pw_uid, owner.pw_gid)
    subprocess.run(
        [
            *_as_server_user(),
            str(bin_dir / "initdb"),
            "-D",
            str(data_dir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    server = PrivatePostgres(bin_dir, data_dir, free_port())
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            server.stop()  # unless the test left it stopped
        shutil.rmtree(home, ignore_errors=True)
