"""The console in Debian's Chromium against a real `greenflow serve` with seeded data.

Screenshots of every page land in test-artifacts/console/ (git-ignored).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser.conftest import ARTIFACTS, LiveServer

pytestmark = pytest.mark.slow

VIEWPORT = {"width": 1366, "height": 768}  # a common laptop screen
TIMEZONE = "Europe/Berlin"  # not UTC, so local times differ from the UTC on hover


def _screenshot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _sign_in(page: Any, server: LiveServer, token: str) -> None:
    page.goto(f"{server.base_url}/console")
    assert "/console/login" in page.url
    page.fill("input[name=token]", token)
    page.click("form.stack button[type=submit]")
    page.wait_for_url(f"{server.base_url}/console")


class Recorder:
    """Every URL the browser requested, and every script error or failed load it saw."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.errors: list[str] = []

    def attach(self, context: Any, page: Any) -> None:
        """Listen on a browser context and its page."""
        context.on("request", lambda request: self.urls.append(request.url))
        page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))
        page.on(
            "console",
            lambda message: (
                self.errors.append(f"console: {message.text}") if message.type == "error" else None
            ),
        )


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    """Shared across the module so the last test can check every request of every test."""
    return Recorder()


@pytest.fixture
def page(browser: Any, recorder: Recorder, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh laptop-sized context (own cookies); light or dark per the test's `scheme` mark."""
    mark = request.node.get_closest_marker("scheme")
    context = browser.new_context(
        viewport=VIEWPORT,
        timezone_id=TIMEZONE,
        locale="en-GB",
        color_scheme=mark.args[0] if mark else "light",
    )
    context.set_default_timeout(10_000)
    new_page = context.new_page()
    recorder.attach(context, new_page)
    yield new_page
    context.close()


def test_sign_in_and_overview(page: Any, live_server: LiveServer) -> None:
    _sign_in(page, live_server, live_server.db.seeded.operator_token)
    cookies = {c["name"]: c for c in page.context.cookies()}
    cookie = cookies["greenflow_console"]
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    # Script cannot read the HttpOnly cookie.
    assert "greenflow_console" not in page.evaluate("document.cookie")
    assert page.inner_text("[data-testid=gpus-used]") == "5"
    assert "3 free of 8" in page.inner_text("#gpus")
    assert "g CO₂e/kWh" in page.inner_text("#intensity")
    assert "kg CO₂e" in page.inner_text("#budget")
    assert "resnet50-sweep" in page.inner_text("main")  # the deadline risk
    page.wait_for_selector("[data-chart=burn-down].drawn")
    assert page.locator(".chart.drawn canvas").count() >= 2
    # Times are local (Berlin) with UTC on hover.
    first_time = page.locator("#live time").first
    assert "UTC" not in first_time.inner_text()
    assert re.search(r"CET|GMT\+1|CEST", first_time.inner_text())
    assert first_time.get_attribute("title").endswith(" UTC")
    assert page.locator("#live table.events .badge.kind-hot_switch").count() == 2
    _screenshot(page, "overview")


def test_overview_refreshes_in_place(page: Any, live_server: LiveServer) -> None:
    seeded = live_server.db.seeded
    _sign_in(page, live_server, seeded.operator_token)
    assert page.evaluate("htmx.version").startswith("2.")
    assert "live refresh check" not in page.inner_text("#live")
    page.evaluate("window.__notReloaded = true")
    # Something changes behind the page's back (as the control loop would)...
    response = httpx.post(
        f"{live_server.base_url}/v1/jobs/{seeded.alice_queued_job_id}/cancel",
        json={"reason": "live refresh check"},
        headers={"Authorization": f"Bearer {seeded.operator_token}"},
    )
    assert response.status_code == 200
    # ...and the same request the page's 15 s poll makes brings it in without a reload.
    page.evaluate(
        "htmx.ajax('GET', location.pathname, {target: '#live', select: '#live', swap: 'outerHTML'})"
    )
    page.wait_for_selector("#live >> text=live refresh check")
    assert page.evaluate("window.__notReloaded") is True
    page.wait_for_selector("[data-chart=burn-down].drawn")
    assert "UTC" not in page.locator("#live time").first.inner_text()  # localised again


def test_running_job_with_hot_switch_history(page: Any, live_server: LiveServer) -> None:
    _sign_in(page, live_server, live_server.db.seeded.operator_token)
    page.click("nav >> text=Jobs")
    page.select_option("select[name=state]", "RUNNING")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r".*state=RUNNING.*"))
    rows = page.locator("table.jobs tbody tr")
    assert rows.count() == 2
    assert "cancel-me" not in page.inner_text("table.jobs")
    _screenshot(page, "jobs")
    page.click("table.jobs >> text=bert-finetune")
    page.wait_for_url(f"{live_server.base_url}/console/jobs/{live_server.db.seeded.running_job_id}")
    assert "RUNNING" in page.inner_text("h1")
    switches = page.locator("#hot-switches tr.hot-switch")
    assert switches.count() == 2
    assert "2 → 4" in switches.nth(0).inner_text()
    assert "dp2 → dp2-tp2" in switches.nth(0).inner_text()
    assert "4 → 3" in switches.nth(1).inner_text()
    assert page.locator("#timeline .badge.kind-hot_switch").count() == 2
    page.wait_for_selector("[data-chart=gpu-chart].drawn")
    page.wait_for_selector("[data-chart=rate-chart].drawn")
    assert "Planned (GPUs)" in page.inner_text("[data-chart=gpu-chart]")
    assert "on track" in page.inner_text("#projection")
    # Numbers carry units (g or kg CO2e, Wh or kWh depending on how much was spent so far).
    main = page.inner_text("main")
    assert re.search(r"\d g CO₂e|kg CO₂e", main) and re.search(r"\d k?Wh", main)
    _screenshot(page, "job")


def test_cancel_job_asks_first_and_changes_its_state(page: Any, live_server: LiveServer) -> None:
    seeded = live_server.db.seeded
    _sign_in(page, live_server, seeded.operator_token)
    url = f"{live_server.base_url}/console/jobs/{seeded.cancel_job_id}"
    page.goto(url)
    assert "QUEUED" in page.inner_text("h1")
    dialogs: list[str] = []

    def dismiss(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", dismiss)
    page.click("button:has-text('Cancel job')")
    assert dialogs and "cannot be undone" in dialogs[0]
    assert page.url == url
    assert "QUEUED" in page.inner_text("h1")  # saying no changes nothing

    page.once("dialog", lambda dialog: dialog.accept())
    page.fill("input[name=reason]", "superseded by a newer run")
    page.click("button:has-text('Cancel job')")
    page.wait_for_url(f"{url}?done=cancel")
    assert "CANCELLED" in page.inner_text("h1")
    assert "Job cancelled." in page.inner_text("main")
    last = page.locator("#timeline tbody tr").last.inner_text()
    assert "CANCELLED" in last and "superseded by a newer run" in last and "ops" in last
    assert page.locator("button:has-text('Cancel job')").count() == 0  # finished: no actions
    api = httpx.get(
        f"{live_server.base_url}/v1/jobs/{seeded.cancel_job_id}",
        headers={"Authorization": f"Bearer {seeded.operator_token}"},
    )
    assert api.json()["state"] == "CANCELLED"
    _screenshot(page, "job-cancelled")


def test_hold_and_priority_from_the_job_page(page: Any, live_server: LiveServer) -> None:
    seeded = live_server.db.seeded
    _sign_in(page, live_server, seeded.operator_token)
    url = f"{live_server.base_url}/console/jobs/{seeded.at_risk_job_id}"
    page.goto(url)
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button:has-text('Hold')")
    page.wait_for_url(f"{url}?done=hold")
    assert page.locator("h1 .badge.held").count() == 1
    page.fill("input[name=priority]", "7")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button:has-text('Set priority')")
    page.wait_for_url(f"{url}?done=priority")
    timeline = page.inner_text("#timeline")
    assert "priority 1 -> 7" in timeline and "held by operator" in timeline


def test_carbon_and_nodes_pages(page: Any, live_server: LiveServer) -> None:
    _sign_in(page, live_server, live_server.db.seeded.operator_token)
    page.click("nav >> text=Carbon")
    page.wait_for_selector("[data-chart=carbon-chart].drawn")
    legend = page.inner_text("[data-chart=carbon-chart]")
    assert "Measured intensity" in legend and "Forecast" in legend and "GPUs in use" in legend
    assert "Planned GPUs" in legend
    assert "OPTIMAL" in page.inner_text("#plan-summary")
    assert page.locator("table tr.current").count() == 1
    _screenshot(page, "carbon")
    page.click("nav >> text=Nodes")
    node_a = page.inner_text("[data-node=node-a]")
    node_b = page.inner_text("[data-node=node-b]")
    assert "healthy" in node_a and "bert-finetune" in node_a and "3 of 4" in node_a
    assert "stale heartbeat" in node_b and "resnet50-sweep" in node_b
    _screenshot(page, "nodes")


def test_user_sees_only_own_jobs(page: Any, live_server: LiveServer) -> None:
    seeded = live_server.db.seeded
    _sign_in(page, live_server, seeded.bob_token)
    page.click("nav >> text=Jobs")
    owners = page.locator("table.jobs tbody tr td:nth-child(3)").all_inner_texts()
    assert owners and set(owners) == {"bob"}
    assert page.locator("select[name=owner]").count() == 0
    _screenshot(page, "user-jobs")
    response = page.goto(f"{live_server.base_url}/console/jobs/{seeded.running_job_id}")
    assert response is not None and response.status == 404
    page.goto(f"{live_server.base_url}/console/jobs/{seeded.at_risk_job_id}")
    assert page.locator("button:has-text('Cancel job')").count() == 1
    assert page.locator("button:has-text('Hold'), button:has-text('Release')").count() == 0
    assert page.locator("button:has-text('Set priority')").count() == 0


@pytest.mark.scheme("dark")
def test_dark_mode_is_readable(page: Any, live_server: LiveServer) -> None:
    _sign_in(page, live_server, live_server.db.seeded.operator_token)
    page.wait_for_selector("[data-chart=burn-down].drawn")
    background, text = page.evaluate(
        "[getComputedStyle(document.body).backgroundColor, getComputedStyle(document.body).color]"
    )

    def luminance(css: str) -> float:
        r, g, b = (int(v) / 255 for v in re.findall(r"\d+", css)[:3])
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    assert luminance(background) < 0.15
    assert luminance(text) > 0.75
    _screenshot(page, "overview-dark")
    page.goto(f"{live_server.base_url}/console/jobs/{live_server.db.seeded.running_job_id}")
    page.wait_for_selector("[data-chart=gpu-chart].drawn")
    _screenshot(page, "job-dark")


def test_sign_out(page: Any, live_server: LiveServer) -> None:
    _sign_in(page, live_server, live_server.db.seeded.operator_token)
    page.click("text=Sign out")
    page.wait_for_url(f"{live_server.base_url}/console/login")
    assert not [c for c in page.context.cookies() if c["name"] == "greenflow_console"]
    page.goto(f"{live_server.base_url}/console/nodes")
    assert "/console/login" in page.url
    _screenshot(page, "login")


def test_every_request_stayed_on_the_server(recorder: Recorder, live_server: LiveServer) -> None:
    # Runs last in this module: it checks what the browser did in all the tests above.
    assert len(recorder.urls) > 20
    foreign = [u for u in recorder.urls if not u.startswith(live_server.base_url) and u != "data:,"]
    assert foreign == []
    assert any(u.endswith("/console/static/vendor/htmx.min.js") for u in recorder.urls)
    assert any(u.endswith("/console/static/vendor/uPlot.iife.min.js") for u in recorder.urls)
    # The 404 page of the user test is the only expected failed load.
    errors = [e for e in recorder.errors if "404" not in e]
    assert errors == []
