"""A job's output on its console page, in Debian's Chromium, from a job that really runs.

`greenflow serve` and an agent with two simulated slots (the stack of tests/e2e/test_examples.py);
a small job module is submitted with `--workdir`. It prints a line per loss call (with markup
in it, which the page must show as text) and records its loss with `greenflow_log`. The
operator narrows the GPUs it may use to one, so the scheduler hot-switches it from two slots to
one. The job page then shows rank 0's newest output, refreshing by itself, and the loss per step
drawn by uPlot, with the start and the hot switch marked at the steps they happened.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.browser.conftest import ARTIFACTS, ensure_console_assets
from tests.e2e.test_examples import Stack, start_stack
from tests.support.processes import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB_MODULE = '''\
"""A small regression: prints a line per loss call and logs the loss."""

import torch
from torch.utils.data import Dataset

from worker_agent.joblog import greenflow_log

CALLS = [0]


class Points(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8) + 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def loss(model, batch):
    value = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
    CALLS[0] += 1
    print(f"call {CALLS[0]} <b>not bold</b> loss={value.item():.4f}")
    greenflow_log(loss=value.item(), calls=CALLS[0])
    return value


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU()), torch.nn.Linear(32, 1)]
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def job(lr: float = 0.01):
    return {
        "model": Regressor,
        "dataset": Points(4096),
        "loss": loss,
        "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9},
    }
'''


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, entrypoints=("regress_job",))
    try:
        yield s
    finally:
        s.stop()


def _chart_spec(page: Any) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(page.locator("script#curve-chart").text_content())
    return spec


def test_job_page_shows_the_log_tail_and_the_loss_across_a_hot_switch(
    stack: Stack, tmp_path: Path, browser: Any
) -> None:
    ensure_console_assets()
    start_stack(stack, tmp_path)
    workdir = tmp_path / "regress"
    workdir.mkdir()
    (workdir / "regress_job.py").write_text(JOB_MODULE)
    spec = {
        "name": "regress",
        "workload": "regress_job:job",
        "global_batch_size": 8,
        "total_steps": 10_000_000,  # runs until the test cancels it
        "min_gpus": 1,
        "max_gpus": 2,
    }
    (workdir / "job.yaml").write_text(yaml.safe_dump(spec))
    submitted = run_cli(
        ["submit", str(workdir / "job.yaml"), "--workdir", str(workdir)],
        env=stack.cli_env,
        timeout_s=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(stack.get("/v1/jobs")["items"][0]["id"])

    def job() -> dict[str, Any]:
        return dict(stack.get(f"/v1/jobs/{job_id}"))

    def switches() -> list[dict[str, Any]]:
        return [e for e in stack.events(job_id) if e["kind"] == "hot_switch"]

    stack.wait_until("the job on both slots", lambda: job()["current_gpus"] == 2, 240)
    # The operator allows it one GPU: the next plan hot-switches it down.
    narrowed = stack.api.post(f"/v1/jobs/{job_id}/gpus", json={"min_gpus": 1, "max_gpus": 1})
    assert narrowed.status_code == 200, narrowed.text
    stack.wait_until("a hot switch", lambda: bool(switches()), 180)
    switch_step = int(switches()[0]["details"]["step"])
    # Some steps after the switch, so the curve runs on past it.
    stack.wait_until("steps after the switch", lambda: job()["step"] > switch_step + 20, 120)

    context = browser.new_context(viewport={"width": 1366, "height": 900}, locale="en-GB")
    context.set_default_timeout(20_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(f"{stack.url}/console/login?next=/console/jobs/{job_id}")
        page.fill("input[name=token]", stack.tokens.alice)
        page.click("form.stack button[type=submit]")
        page.wait_for_url(f"{stack.url}/console/jobs/{job_id}")

        # The output panel is fetched from the agent after the page loads.
        tail = page.locator("#log-tail")
        tail.wait_for()
        first = tail.inner_text()
        assert "<b>not bold</b> loss=" in first  # shown as text, not as markup
        assert page.locator("#job-output-panel b").count() == 0
        # Scrolled to its newest line.
        assert page.evaluate(
            "() => { const el = document.getElementById('log-tail');"
            " return el.scrollTop + el.clientHeight >= el.scrollHeight - 2; }"
        )
        assert page.locator(".chart[data-chart=curve-chart].drawn canvas").count() >= 1
        chart = _chart_spec(page)
        assert chart["x_kind"] == "step"
        assert [s["label"] for s in chart["series"]] == ["loss"]
        assert "calls" in page.locator("#other-scalars").inner_text()
        steps, losses = chart["x"], chart["series"][0]["values"]
        assert steps == sorted(steps) and steps[0] <= switch_step < steps[-1]
        assert all(isinstance(v, float) for v in losses)
        # The regression learns: late steps' loss well under the first ones'.
        assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:3]) / 3, losses
        kinds = {(m["kind"], m["x"]) for m in chart["marks"]}
        assert ("start", 0) in kinds and ("hot_switch", switch_step) in kinds, chart["marks"]
        page.screenshot(path=str(ARTIFACTS / "job-output.png"), full_page=True)

        # It refreshes by itself: newer output and more steps, without reloading the page.
        page.wait_for_function(
            "(first) => { const el = document.getElementById('log-tail');"
            " return el !== null && el.innerText !== first; }",
            arg=first,
            timeout=30_000,
        )
        later = _chart_spec(page)
        assert later["x"][-1] > steps[-1]
        # The page's own refresh (#live, every 15 s) keeps the panel rather than reloading it.
        page.wait_for_timeout(16_000)
        assert page.locator("#job-output-panel").count() == 1
        assert page.locator("#log-tail").count() == 1
        assert not errors, errors
    except Exception:
        # What the page showed, for the failure's report.
        (ARTIFACTS / "job-output-failed.html").write_text(page.content())
        page.screenshot(path=str(ARTIFACTS / "job-output-failed.png"), full_page=True)
        raise
    finally:
        context.close()
        stack.api.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "test over"})
