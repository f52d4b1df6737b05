"""The node-aware replay (`placement="nodes"`): plans go through the live service's placement,
a job spans nodes only where that is allowed, and counts placement lowers are counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.admission import AdmissionDecision
from scheduler_service.allocation.problem import AllocationProblem, JobSpec, make_plan
from scheduler_service.placement import Placement
from scheduler_service.simulate.engine import (
    NodePlacer,
    SimulationConfig,
    SimulationError,
    SimulationReport,
    _JobState,
    simulate_trace,
)
from scheduler_service.simulate.switch_cost import SwitchCostModel, model_params
from scheduler_service.simulate.trace import JobTables, TraceJob, load_trace
from tests.simulate.test_simulate import T0, _app, write_series, write_trace


def _replay(
    root: Path,
    rows: list[str],
    placement: str,
    spannable_nodes: int | None = None,
    moves: bool = True,
    switch_cost: str = "measured",
    moves_running: bool = True,
) -> SimulationReport:
    folder = root / "profiles"
    folder.mkdir(exist_ok=True)
    # Iterations/s at a global batch of 32: "small" runs on at most 2 GPUs, "mid" on 4, "wide" on 8.
    (folder / "small.csv").write_text("global_batch_size,1,2\n32,10,18\n")
    (folder / "mid.csv").write_text("global_batch_size,1,2,4\n32,10,18,30\n")
    (folder / "wide.csv").write_text("global_batch_size,1,2,4,8\n32,10,18,30,50\n")
    config = SimulationConfig(
        policy="static",
        num_nodes=2,
        gpus_per_node=4,
        slot_s=900.0,
        placement=placement,  # type: ignore[arg-type]
        spannable_nodes=spannable_nodes,
        placement_moves=moves,
        placement_moves_running=moves_running,
        switch_cost=switch_cost,  # type: ignore[arg-type]
    )
    return simulate_trace(
        load_trace(write_trace(root, rows)),
        load_intensity_csv(write_series(root, [100.0] * 24)),
        load_scaling_profiles(folder),
        config,
    )


def _outcome(report: SimulationReport, job_id: str) -> tuple[float | None, int, int]:
    o = next(o for o in report.outcomes if o.job_id == job_id)
    return o.jct_s, o.placement_lowered, o.nodes_max


def test_a_job_larger_than_any_node_spans_nodes_only_where_spanning_is_allowed(
    tmp_path: Path,
) -> None:
    # 180,000 iterations: 3,600 s on 8 GPUs (50 it/s), 6,000 s on 4 (30 it/s).
    rows = ["w,0,180000,wide,,32,8,3600"]
    pooled = _replay(tmp_path, rows, "pooled")
    spanning = _replay(tmp_path, rows, "nodes")
    inside = _replay(tmp_path, rows, "nodes", spannable_nodes=0)
    assert _outcome(pooled, "w") == (pytest.approx(3600.0), 0, 0)
    assert _outcome(spanning, "w") == (pytest.approx(3600.0), 0, 2)
    # Nodes that may not be spanned: the job gets at most one node (the live service's cap),
    # which is not a lowering: it was planned on 4.
    assert _outcome(inside, "w") == (pytest.approx(6000.0), 0, 1)
    assert spanning.placement == "nodes 2x4, 2 spannable, jobs moved to make room"
    assert inside.placement == "nodes 2x4, 0 spannable, jobs moved to make room"
    assert (spanning.jobs_spanning_nodes, inside.jobs_spanning_nodes) == (1, 0)


def test_a_count_placement_lowers_is_counted_and_run_as_placed(tmp_path: Path) -> None:
    # Four 2-GPU jobs fill both nodes (a, b on node 0; c, d on node 1); a and c end at 900 s,
    # leaving 2 free GPUs on each node. "e" (4 GPUs, 108,000 iterations: 3,600 s on 4) arrives
    # at 1,800 s: the pooled plan gives it 4, which only spanning both nodes holds.
    rows = [
        "a,0,16200,small,,32,2,900",
        "b,0,129600,small,,32,2,7200",
        "c,0,16200,small,,32,2,900",
        "d,0,129600,small,,32,2,7200",
        "e,1800,108000,mid,,32,4,3600",
    ]
    spanning = _replay(tmp_path, rows, "nodes")
    assert _outcome(spanning, "e") == (pytest.approx(3600.0), 0, 2)
    assert spanning.placement_lowered == 0
    # Placement that never moves a job to make room, and the flat 30 s switch.
    inside = _replay(tmp_path, rows, "nodes", spannable_nodes=0, moves=False, switch_cost="flat")
    jct_s, lowered, nodes_max = _outcome(inside, "e")
    # Lowered to 2 GPUs (18 it/s) on node 0 until b ends at 7,200 s, then 4 after a 30 s switch:
    # 5,400 s x 18 = 97,200 iterations, the other 10,800 take 360 s.
    assert jct_s == pytest.approx(5400.0 + 30.0 + 360.0)
    assert lowered >= 1 and nodes_max == 1
    assert inside.placement_lowered == lowered and inside.placement_lowered_jobs == 1
    # The last step it was lowered, it already held its 2 on node 0 and asked for 2 more there.
    reason = next(o.placement_reason for o in inside.outcomes if o.job_id == "e")
    assert reason.startswith("4 GPUs asked, 2 placed") and "a job runs inside one node" in reason
    assert inside.admitted_missed_lowered == 0  # no deadlines here: no promise to break
    # Pooled, the same plan runs as planned: the figures the node-aware replay corrects.
    assert _outcome(_replay(tmp_path, rows, "pooled"), "e") == (pytest.approx(3600.0), 0, 0)


def test_placement_moves_a_job_to_make_room_and_the_move_costs_it_a_switch(
    tmp_path: Path,
) -> None:
    # As above, inside one node: e's 4 GPUs fit on no node as a..d sit, so placement that may
    # move running jobs moves b (node 0, the first of the two equally free nodes) whole to node
    # 1, where c's 2 GPUs are free, and e runs on node 0's 4 from its arrival.
    rows = [
        "a,0,16200,small,,32,2,900",
        "b,0,129600,small,,32,2,7200",
        "c,0,16200,small,,32,2,900",
        "d,0,129600,small,,32,2,7200",
        "e,1800,108000,mid,,32,4,3600",
    ]
    # Placement that moves no running job (the live rule before its two-step move): e runs
    # lowered on 2 until b ends, as without moves.
    idle = _replay(tmp_path, rows, "nodes", spannable_nodes=0, moves_running=False)
    assert idle.placement_moves == 0 and _outcome(idle, "e")[1] >= 1
    assert idle.placement == "nodes 2x4, 0 spannable, jobs moved to make room (not running ones)"
    moved = _replay(tmp_path, rows, "nodes", spannable_nodes=0)
    assert moved.placement == "nodes 2x4, 0 spannable, jobs moved to make room"
    assert _outcome(moved, "e") == (pytest.approx(3600.0), 0, 1)
    assert moved.placement_lowered == 0 and moved.placement_moves == 1
    # b pays the switch of 2 new workers on a node that holds none of its state (the measured
    # model, its size unknown: DEFAULT_PARAMS); d stays where it is and finishes as planned.
    stall_s = SwitchCostModel().stall_s(model_params("small"), {0: 2}, {1: 2}, {0})
    assert stall_s > SwitchCostModel().start_s
    b, d = (next(o for o in moved.outcomes if o.job_id == j) for j in ("b", "d"))
    assert (b.placement_moves, d.placement_moves) == (1, 0)
    assert b.finish_s == pytest.approx(7200.0 + stall_s)
    assert d.finish_s == pytest.approx(7200.0)


def test_spannable_nodes_needs_node_placement_and_a_count_within_the_cluster() -> None:
    with pytest.raises(SimulationError, match="spannable_nodes"):
        SimulationConfig(policy="static", num_nodes=2, gpus_per_node=4, spannable_nodes=1)
    with pytest.raises(SimulationError, match="spannable_nodes"):
        SimulationConfig(
            policy="static", num_nodes=2, gpus_per_node=4, placement="nodes", spannable_nodes=3
        )


def _state(job_id: str, deadline_s: float | None, allowed: tuple[int, ...]) -> _JobState:
    tables = JobTables(allowed, tuple(10.0 * g for g in allowed), tuple(300.0 * g for g in allowed))
    job = TraceJob(job_id, 0.0, 1, "toy", deadline_s, 1, max(allowed), 0.0)
    return _JobState(trace=job, tables=tables, seen=tables, remaining_samples=0.0)


@pytest.mark.parametrize(
    ("spannable_nodes", "moves", "running"),
    [(0, False, False), (0, True, False), (0, True, True), (None, False, False)],
)
def test_admission_promises_only_what_its_plan_keeps_once_placed(
    spannable_nodes: int | None, moves: bool, running: bool
) -> None:
    # a and b hold 2 GPUs on nodes 0 and 1 (of 4 each); the new job e needs 4 GPUs (40
    # samples/s) for both 1 s slots to do its 80 samples by its deadline. Pooled (or spanning
    # both nodes) the plan keeps it; inside one node e gets 2 and misses it, unless placement
    # may move the running a or b onto the other's node to make room (not with `running`
    # off: only jobs that hold no GPUs move then).
    config = SimulationConfig(
        policy="carbon-agnostic",
        num_nodes=2,
        gpus_per_node=4,
        slot_s=1.0,
        switch_s=0.0,
        placement="nodes",
        spannable_nodes=spannable_nodes,
        placement_moves=moves,
        placement_moves_running=running,
    )
    states = {
        "a": _state("a", None, (1, 2)),
        "b": _state("b", None, (1, 2)),
        "e": _state("e", 2.0, (1, 2, 4)),
    }
    # Where earlier steps left them (best fit would have put both on node 0).
    placer = NodePlacer(
        config, placements={0: Placement(0, (0, 1)), 1: Placement(1, (0, 1))}, ids={"a": 0, "b": 1}
    )
    specs = [
        JobSpec(j, s.seen.allowed_gpus, s.seen.throughput_samples_per_s, s.seen.power_w, work, d)
        for (j, s), work, d in zip(
            states.items(), (1000.0, 1000.0, 80.0), (None, None, 2.0), strict=True
        )
    ]
    problem = AllocationProblem(
        start_at=T0,
        slot_s=1.0,
        capacity_gpus=(8, 8),
        intensity_g_per_kwh=(100.0, 100.0),
        jobs=tuple(specs),
    )
    plan = make_plan(
        problem, {"a": (2, 2), "b": (2, 2), "e": (4, 4)}, status="baseline", policy="t", solve_s=0.0
    )
    assert plan.deadline_met == {"e": True}
    lost = placer.lost_deadlines(problem, plan, {"e"}, states)
    broken = spannable_nodes == 0 and not running
    assert lost == (["e"] if broken else [])
    decision = AdmissionDecision(True, True, "deadline can be met", plan)
    refused = placer.refuse(decision, problem, {"e"}, states, best_effort=False)
    if broken:
        assert not refused.admitted and "placed on the nodes" in refused.reason
        queued = placer.refuse(decision, problem, {"e"}, states, best_effort=True)
        assert queued.admitted and not queued.guaranteed
    else:
        assert refused is decision


def test_cli_places_on_nodes_and_names_the_placement_in_its_report(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "wide.csv").write_text("global_batch_size,1,2,4,8\n32,10,18,30,50\n")
    carbon = write_series(tmp_path, [100.0] * 24)
    trace = write_trace(tmp_path, ["w,0,180000,wide,,32,8,3600"])
    out = tmp_path / "report.json"
    base = ["simulate", "--jobs", str(trace), "--carbon", str(carbon), "--profiles", str(profiles)]
    base += ["--cluster", "2x4", "--policy", "static", "--out", str(out)]
    runner = CliRunner()
    result = runner.invoke(_app(), [*base, "--placement", "nodes", "--spannable-nodes", "0"])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["placement"] == "nodes 2x4, 0 spannable, jobs moved to make room"
    assert payload["switch_cost"].startswith("measured: ")
    assert payload["avg_jct_s"] == pytest.approx(6000.0)
    assert payload["jobs_detail"][0]["nodes_max"] == 1
    running = runner.invoke(
        _app(),
        [*base, "--placement", "nodes", "--spannable-nodes", "0", "--no-placement-moves-running"],
    )
    assert running.exit_code == 0, running.output
    assert json.loads(out.read_text())["placement"] == (
        "nodes 2x4, 0 spannable, jobs moved to make room (not running ones)"
    )
    bad = runner.invoke(_app(), [*base, "--placement", "racks"])
    assert bad.exit_code == 2 and "pooled or nodes" in bad.output
    pooled_span = runner.invoke(_app(), [*base, "--spannable-nodes", "1"])
    assert pooled_span.exit_code == 2 and "spannable_nodes" in pooled_span.output
