"""Team budgets, periods in a time zone, and reloading greenflow.toml (issue 22)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import AllocationPlan, evaluate_gpus
from scheduler_service.app import create_app
from scheduler_service.budget.enforcement import (
    pause_jobs_over_team_budget,
    team_budget_wake_reason,
)
from scheduler_service.budget.ledger import exhausted_hard_queues, team_statuses
from scheduler_service.budget.periods import period_containing, split_interval
from scheduler_service.db import migrate
from scheduler_service.db.models import GpuSlot, Job, Node
from scheduler_service.db.session import transaction
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.planning import JobModels, read_snapshot
from scheduler_service.settings import ConfigError, Settings, load_config
from tests.api.conftest import Tokens, auth, make_tokens
from tests.browser.test_console_http import sign_in
from tests.budget.test_report import _scrape, _seed
from tests.service.test_snapshot import _forecast
from tests.support.processes import free_port, running


def _utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def test_periods_start_at_local_midnight_of_the_time_zone() -> None:
    # 00:30 in Berlin on 28 November is still the 27th in UTC.
    day = period_containing(_utc(2026, 11, 27, 23, 30), "day", "Europe/Berlin")
    assert (day.start_at, day.end_at) == (_utc(2026, 11, 27, 23), _utc(2026, 11, 28, 23))
    # The spring-forward day in Berlin is 23 hours long.
    dst = period_containing(_utc(2026, 3, 29, 12), "day", "Europe/Berlin")
    assert (dst.end_at - dst.start_at).total_seconds() == 23 * 3600
    week = period_containing(_utc(2026, 11, 27, 12), "week", "America/New_York")
    assert (week.start_at, week.end_at) == (_utc(2026, 11, 23, 5), _utc(2026, 11, 30, 5))
    month = period_containing(_utc(2026, 12, 1, 3), "month", "America/New_York")
    assert (month.start_at, month.end_at) == (_utc(2026, 11, 1, 4), _utc(2026, 12, 1, 5))
    # An interval across local midnight is charged to both days.
    parts = split_interval(
        _utc(2026, 11, 27, 22, 50), _utc(2026, 11, 27, 23, 10), "day", "Europe/Berlin"
    )
    assert [(lo, hi) for _, lo, hi in parts] == [
        (_utc(2026, 11, 27, 22, 50), _utc(2026, 11, 27, 23)),
        (_utc(2026, 11, 27, 23), _utc(2026, 11, 27, 23, 10)),
    ]
    assert period_containing(_utc(2026, 11, 27, 23, 30), "day") == period_containing(
        _utc(2026, 11, 27, 23, 30), "day", "UTC"
    )


TEAMS = """
[budget]
period = "month"
time_zone = "Europe/Berlin"
limit_kg_co2e = 100.0
[budget.teams.nlp]
queues = ["a"]
limit_kg_co2e = {nlp_kg}
[budget.teams.vision]
queues = ["b", "c"]
limit_kg_co2e = 5.0
enforcement = "soft"
"""


def test_team_config_is_validated_like_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "greenflow.toml"
    path.write_text(TEAMS.format(nlp_kg=1.0))
    config = load_config(path)
    assert config.budget.team_of("c") == "vision" and config.budget.team_of("z") is None
    for bad, message in (
        (TEAMS.format(nlp_kg=1.0).replace('["b", "c"]', '["a"]'), "'a' is in the budgets of both"),
        (TEAMS.format(nlp_kg=1.0).replace("Europe/Berlin", "Mars/Olympus"), "unknown time zone"),
        (TEAMS.format(nlp_kg=-1.0), "budget.teams.nlp.limit_kg_co2e"),
    ):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=message):
            load_config(path)


@pytest.fixture
def team_app(tmp_path: Path) -> Iterator[tuple[TestClient, Tokens, Path]]:
    url = f"sqlite:///{tmp_path / 'greenflow.db'}"
    migrate.upgrade(url, "head")
    path = tmp_path / "greenflow.toml"
    path.write_text(TEAMS.format(nlp_kg=1e-9))
    app = create_app(
        Settings(database_url=url, run_control_loop=False, config=path), load_config(path)
    )
    with TestClient(app) as client:
        yield client, make_tokens(url), path
    app.state.engine.dispose()


def test_each_team_budget_counts_its_queues_jobs(team_app: tuple[TestClient, Tokens, Path]) -> None:
    client, tokens, _ = team_app
    job_a, job_b = _seed(client, tokens)
    budget = client.get("/v1/budget", headers=auth(tokens.operator)).json()
    assert budget["time_zone"] == "Europe/Berlin"
    teams = {t["name"]: t for t in budget["teams"]}
    assert set(teams) == {"nlp", "vision"}
    cluster_kg = budget["periods"][0]["spent_kg_co2e"]
    nlp_kg = teams["nlp"]["current"]["spent_kg_co2e"]
    vision_kg = teams["vision"]["current"]["spent_kg_co2e"]
    report = client.get(
        "/v1/report",
        params={"period": datetime.now(UTC).strftime("%Y-%m")},
        headers=auth(tokens.operator),
    ).json()
    rows = {r["key"]: r for r in report["rows"]}
    # A team's spend is its jobs' (their idle and host shares included); the cluster's adds
    # the unattributed overhead.
    assert nlp_kg == pytest.approx(rows[str(job_a)]["emissions_kg"])
    assert vision_kg == pytest.approx(rows[str(job_b)]["emissions_kg"])
    assert cluster_kg == pytest.approx(nlp_kg + vision_kg + rows["(unattributed)"]["emissions_kg"])
    # nlp's hard budget (1e-9 kg) is spent: its queue's jobs stop; vision's is soft.
    app = client.app
    with transaction(app.state.session_factory) as session:  # type: ignore[attr-defined]
        assert exhausted_hard_queues(session, app.state.config) == {"a"}  # type: ignore[attr-defined]
    assert teams["nlp"]["current"]["left_kg_co2e"] == 0.0
    # Bob has no jobs: he sees no team budget; Alice sees both of her queues' teams.
    assert client.get("/v1/budget", headers=auth(tokens.bob)).json()["teams"] == []
    assert len(client.get("/v1/budget", headers=auth(tokens.alice)).json()["teams"]) == 2
    # The console's carbon page lists the team budgets the caller may see.
    sign_in(client, tokens.bob)
    assert "Team budgets" not in client.get("/console/carbon").text
    sign_in(client, tokens.operator)
    page = client.get("/console/carbon").text
    assert "Team budgets" in page and "nlp" in page and "vision" in page
    scraped = _scrape(client)
    assert scraped['greenflow_budget_emissions_kg{budget="nlp"}'] == pytest.approx(nlp_kg)
    assert scraped['greenflow_budget_limit_kg{budget="vision"}'] == 5.0


def test_reload_applies_a_good_file_and_keeps_the_config_on_a_bad_one(
    team_app: tuple[TestClient, Tokens, Path],
) -> None:
    client, tokens, path = team_app
    ops = auth(tokens.operator)

    def nlp_limit() -> float:
        teams = client.get("/v1/budget", headers=ops).json()["teams"]
        return float(next(t for t in teams if t["name"] == "nlp")["current"]["limit_kg_co2e"])

    assert nlp_limit() == 1e-9
    path.write_text(TEAMS.format(nlp_kg=2.5))
    response = client.post("/v1/config/reload", headers=ops)
    assert response.status_code == 200, response.text
    assert response.json() == {"reloaded": True, "changed": ["budget"]}
    assert nlp_limit() == 2.5
    for bad, message in (
        ("[budget\n", "not valid TOML"),
        (TEAMS.format(nlp_kg=2.5) + "[cluster]\npue = 9\n", "cluster.pue"),
        (
            TEAMS.format(nlp_kg=2.5) + '[carbon]\nregion = "elsewhere"\n',
            "applies only at a restart",
        ),
    ):
        path.write_text(bad)
        refused = client.post("/v1/config/reload", headers=ops)
        assert refused.status_code == 400 and message in refused.json()["detail"], refused.text
        assert "running config is kept" in refused.json()["detail"]
        assert nlp_limit() == 2.5
    assert client.post("/v1/config/reload", headers=auth(tokens.alice)).status_code == 403


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sighup_reloads_a_running_server(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'greenflow.db'}"
    migrate.upgrade(url, "head")
    tokens = make_tokens(url)
    path = tmp_path / "greenflow.toml"
    path.write_text(TEAMS.format(nlp_kg=1.0))
    port = free_port()
    env = {
        "GREENFLOW_DATABASE_URL": url,
        "GREENFLOW_CONFIG": str(path),
        "GREENFLOW_PORT": str(port),
    }
    base = f"http://127.0.0.1:{port}"

    def limits() -> dict[str, float]:
        body = httpx.get(f"{base}/v1/budget", headers=auth(tokens.operator)).json()
        return {t["name"]: t["current"]["limit_kg_co2e"] for t in body["teams"]}

    with running(["serve"], env, tmp_path / "serve.log", health_url=f"{base}/healthz") as server:
        assert limits() == {"nlp": 1.0, "vision": 5.0}
        path.write_text(TEAMS.format(nlp_kg=3.0))
        server.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while limits()["nlp"] != 3.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert limits()["nlp"] == 3.0
        # A bad file on SIGHUP: logged, the server runs on with the config it had.
        path.write_text("[budget]\nlimit_kg_co2e = -1\n")
        server.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert server.poll() is None
        assert limits() == {"nlp": 3.0, "vision": 5.0}
    assert "config reload refused" in (tmp_path / "serve.log").read_text()


def test_a_spent_hard_team_budget_pauses_and_holds_back_only_its_jobs(
    team_app: tuple[TestClient, Tokens, Path],
) -> None:
    client, tokens, path = team_app
    job_a, job_b = _seed(client, tokens)  # nlp's budget (queue a) is 1e-9 kg: spent
    app: Any = client.app
    config = app.state.config
    with transaction(app.state.session_factory) as session:
        for job_id, slot in ((job_a, 0), (job_b, 1)):
            job = session.get(Job, job_id)
            assert job is not None
            job.state, job.current_gpus = JobState.RUNNING.value, 1
            node = session.scalar(select(Node).where(Node.name == "node-1"))
            assert node is not None
            NodeRepository(session).assign(node.id, [slot], job_id)
    now = datetime.now(UTC)
    with transaction(app.state.session_factory) as session:
        # The budget watchdog wakes the tick: nlp's budget is spent while its job runs.
        reason = team_budget_wake_reason(session, config, now)
        assert reason is not None and "nlp" in reason and "vision" not in reason
        assert pause_jobs_over_team_budget(session, config, now) == [job_a]
        # Once the pause is on its way the watchdog is quiet.
        assert team_budget_wake_reason(session, config, now) is None
        # A pause already on its way is not sent twice.
        assert pause_jobs_over_team_budget(session, config, now) == []
    with transaction(app.state.session_factory) as session:
        newest = AllocationRepository(session).newest_by_job([job_a, job_b])
        assert newest[job_a].gpus == 0 and newest[job_a].generation == 2
        assert "team 'nlp'" in newest[job_a].reason and newest[job_a].status == "pending"
        assert newest[job_b].generation == 1  # vision's jobs go on
        paused = session.get(Job, job_a)
        assert paused is not None and paused.state == JobState.RESIZING.value
        slots = session.scalars(select(GpuSlot).where(GpuSlot.job_id.is_not(None)))
        assert {s.job_id for s in slots} == {job_b}
        # The planner's snapshot leaves nlp's jobs out until the next period; vision's stay.
        planning = read_snapshot(session, config, _forecast(), JobModels(), now)
        assert set(planning.jobs) == {str(job_b)}
        normal = planning.problem.jobs[0].priority
    # vision's budget is soft: once spent its jobs still run, at the lowest priority.
    path.write_text(TEAMS.format(nlp_kg=1e-9).replace("5.0", "1e-9"))
    assert client.post("/v1/config/reload", headers=auth(tokens.operator)).status_code == 200
    with transaction(app.state.session_factory) as session:
        planning = read_snapshot(session, app.state.config, _forecast(), JobModels(), now)
        assert set(planning.jobs) == {str(job_b)}
        assert planning.problem.jobs[0].priority < normal
        assert pause_jobs_over_team_budget(session, app.state.config, now) == []


def test_the_plan_keeps_a_teams_hard_budget_and_only_its_jobs_give_way(
    team_app: tuple[TestClient, Tokens, Path],
) -> None:
    client, tokens, path = team_app
    job_a, job_b = _seed(client, tokens)
    app: Any = client.app
    now = datetime.now(UTC)
    with transaction(app.state.session_factory) as session:
        spent_kg = team_statuses(session, app.state.config, now)["nlp"].spent_kg
    # nlp (queue a, hard) has 20 g left this month: some slots of its job, not the horizon.
    path.write_text(TEAMS.format(nlp_kg=spent_kg + 0.02))
    assert client.post("/v1/config/reload", headers=auth(tokens.operator)).status_code == 200
    config = app.state.config
    with transaction(app.state.session_factory) as session:
        planning = read_snapshot(session, config, _forecast(), JobModels(), now)
    problem = planning.problem
    assert set(planning.jobs) == {str(job_a), str(job_b)}
    (nlp,) = problem.team_budgets  # vision's budget is soft: not a constraint
    assert nlp.team == "nlp" and nlp.job_ids == {str(job_a)}
    assert nlp.periods[0].budget_left_kg == pytest.approx(0.02, rel=1e-6)
    greenflow = get_policy("greenflow")
    free = greenflow(replace(problem, team_budgets=()), previous=None, time_limit_s=2.0, seed=0)
    plan = greenflow(problem, previous=None, time_limit_s=2.0, seed=0)

    def team_kg(p: AllocationPlan, job_id: str) -> float:
        kg_per_w = problem.slot_emissions_kg_per_w()
        spec = next(j for j in problem.jobs if j.job_id == job_id)
        return sum(
            (0.0 if g == 0 else spec.power_w[spec.allowed_gpus.index(g)]) * kg_per_w[t]
            for t, g in enumerate(p.gpus[job_id])
        )

    # Unconstrained, nlp's job would spend far more than it has left; the plan keeps it within.
    assert team_kg(free, str(job_a)) > 0.02 * 2
    assert 0.0 < team_kg(plan, str(job_a)) <= 0.02 * (1 + 1e-6)
    # vision's job, starved by nlp's in the unconstrained plan, takes the GPUs nlp's job gives
    # up (as many as its allowed counts fit): only the team over its budget gives way. nlp's
    # job, planned again under its 20 g, runs where its budget pays for it.
    assert free.gpus[str(job_b)][:4] == (0, 0, 0, 0)
    vision = next(j for j in problem.jobs if j.job_id == str(job_b))
    for a, b in zip(plan.gpus[str(job_a)][:4], plan.gpus[str(job_b)][:4], strict=True):
        assert b == max(g for g in vision.allowed_gpus if g <= 4 - a), (a, b)
    assert any("team's hard budget" in note for note in plan.notes)
    assert evaluate_gpus(problem, plan.gpus).budget_ok
    assert not evaluate_gpus(problem, free.gpus).budget_ok
