"""Fixtures for the console tests: a seeded database, the app in-process, a real server, Chromium."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scheduler_service.app import create_app
from scheduler_service.console.router import STATIC_DIR, VENDOR_FILES
from scheduler_service.db import migrate
from scheduler_service.settings import GreenflowConfig, Settings, load_config
from tests.browser.seed import Seeded, seed
from tests.support.processes import free_port, running

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "test-artifacts" / "console"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# A small budget so the seeded emissions show on the burn-down.
CONFIG_TOML = """
[budget]
period = "day"
limit_kg_co2e = 4.0
enforcement = "hard"

# Generous, so node-a (heartbeat seconds before seeding) stays healthy on a slow machine.
[cluster]
heartbeat_timeout_s = 900
"""


@dataclass(frozen=True)
class SeededDb:
    """A migrated, seeded SQLite database and the config the app runs with."""

    url: str
    config_path: Path
    seeded: Seeded


def make_seeded_db(directory: Path) -> SeededDb:
    """Migrate a fresh SQLite file with Alembic and seed it."""
    url = f"sqlite:///{directory / 'greenflow.db'}"
    migrate.upgrade(url)
    config_path = directory / "greenflow.toml"
    config_path.write_text(CONFIG_TOML, encoding="utf-8")
    return SeededDb(url=url, config_path=config_path, seeded=seed(url))


@pytest.fixture(scope="module")
def seeded_db(tmp_path_factory: pytest.TempPathFactory) -> SeededDb:
    """One seeded database per test module."""
    return make_seeded_db(tmp_path_factory.mktemp("console-db"))


@pytest.fixture(scope="module")
def app_client(seeded_db: SeededDb) -> Iterator[TestClient]:
    """The whole app in-process on the seeded database (no control loop)."""
    settings = Settings(database_url=seeded_db.url, run_control_loop=False)
    app = create_app(settings, load_config(seeded_db.config_path))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def fresh_client(seeded_db: SeededDb, static_dir: Path | None = None) -> TestClient:
    """A new client (own cookie jar) on the seeded database; optionally another static folder."""
    settings = Settings(database_url=seeded_db.url, run_control_loop=False)
    app = create_app(settings, GreenflowConfig())
    if static_dir is not None:
        app.state.console_static_dir = static_dir
    return TestClient(app)


def ensure_console_assets() -> None:
    """Install the pinned front-end libraries (the documented set-up step) when they are missing."""
    vendor = STATIC_DIR / "vendor"
    if all((vendor / name).is_file() for name in VENDOR_FILES):
        return
    script = REPO_ROOT / "scripts" / "install_console_assets.sh"
    if shutil.which("npm") is None:
        pytest.fail(f"console assets are not installed and npm is missing: run {script}")
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"{script} failed:\n{result.stdout}\n{result.stderr}")


@dataclass(frozen=True)
class LiveServer:
    """`greenflow serve` on a free port over the seeded database."""

    base_url: str
    db: SeededDb


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real scheduler process on 127.0.0.1 with seeded data and the control loop off."""
    ensure_console_assets()
    directory = tmp_path_factory.mktemp("console-server")
    db = make_seeded_db(directory)
    port = free_port()
    env = {
        "GREENFLOW_DATABASE_URL": db.url,
        "GREENFLOW_CONFIG": str(db.config_path),
        "GREENFLOW_RUN_CONTROL_LOOP": "false",
    }
    base_url = f"http://127.0.0.1:{port}"
    with running(
        ["serve", "--host", "127.0.0.1", "--port", str(port)],
        env,
        directory / "server.log",
        health_url=f"{base_url}/healthz",
    ):
        yield LiveServer(base_url=base_url, db=db)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Debian's Chromium driven by Playwright (never a downloaded browser)."""
    if not CHROMIUM.exists():
        pytest.fail(
            "Chromium is not installed at /usr/bin/chromium: `apt-get install -y chromium` "
            "(.ci/run does this)"
        )
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


def pytest_configure(config: pytest.Config) -> None:
    """Register the browser tests' marker."""
    config.addinivalue_line("markers", "scheme(name): colour scheme of the browser page")
