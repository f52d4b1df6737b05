"""The scheduler's secret toward each agent: derived, scoped to one node, rotated at registration.

The secret the scheduler presents on its calls to a node's agent is
HMAC-SHA256(scheduler key, node id, node name, nonce), where the nonce is new at every
registration. The database keeps only the nonce and which key was used, so a copy of the
database alone cannot call any agent, a secret never works for another node, and a node that
registers again invalidates its previous secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from scheduler_service.settings import ConfigError, Settings

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 32
KEY_FILE_NAME = "greenflow.key"


@dataclass(frozen=True)
class NodeSecrets:
    """Derives per-node agent secrets from the scheduler key."""

    key: bytes

    @classmethod
    def generate(cls) -> NodeSecrets:
        """A fresh random key (one process only: tests, and loops built without an app)."""
        return cls(secrets.token_bytes(32))

    @property
    def key_id(self) -> str:
        """A short public fingerprint of the key (stored per node; reveals nothing of the key)."""
        return hashlib.sha256(b"greenflow-key-id:" + self.key).hexdigest()[:16]

    @staticmethod
    def new_nonce() -> str:
        """A fresh nonce for a registration."""
        return secrets.token_hex(16)

    def agent_secret(self, node_id: int, node_name: str, nonce: str) -> str:
        """The secret toward this node's agent for the registration that drew `nonce`."""
        message = f"greenflow-agent-secret\x00{node_id}\x00{node_name}\x00{nonce}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()


def default_key_file(database_url: str) -> Path:
    """greenflow.key beside a SQLite database file, else in the working directory."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(str(url.database)).with_name(KEY_FILE_NAME)
    return Path.cwd() / KEY_FILE_NAME


def _create_key_file(path: Path) -> None:
    """Write a new random key to `path` unless another process just did (0600, atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(secrets.token_urlsafe(48) + "\n")
        os.link(tmp, path)  # fails if the file appeared meanwhile: theirs wins
        log.warning(
            "created a new scheduler key at %s; every replica needs the same key "
            "(GREENFLOW_SECRET_KEY or GREENFLOW_SECRET_KEY_FILE)",
            path,
        )
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def load_node_secrets(settings: Settings) -> NodeSecrets:
    """The scheduler key from GREENFLOW_SECRET_KEY, its file, or the default file (created)."""
    if settings.secret_key is not None:
        text = settings.secret_key.get_secret_value().strip()
        source = "GREENFLOW_SECRET_KEY"
    else:
        path = settings.secret_key_file
        if path is None:
            path = default_key_file(settings.database_url)
            if not path.exists():
                _create_key_file(path)
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the scheduler key file {path}: {exc}") from exc
        source = str(path)
    if len(text) < MIN_KEY_CHARS:
        raise ConfigError(
            f"the scheduler key from {source} is too short: give at least {MIN_KEY_CHARS} "
            "random characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(48))'`)"
        )
    return NodeSecrets(text.encode())
