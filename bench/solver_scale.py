"""Solver scale: solve time and gap to the LP bound for 100-5,000 jobs x 48 slots (JSON out).

Jobs are drawn from the ElasticFlow A100 scaling profiles (model, batch size) with power from
energy_model.power; remaining work is 0.5-12 h at one GPU; 30 % of jobs get a deadline between
0.7x and 2x their fastest possible run time. Carbon: a day of US-CAL-CISO 2021 (hourly) when the
shared data is present, else a synthetic day curve.

Per case: a cold solve (no previous plan), then a warm tick: the same case one slot later (work
of the cold plan's first slot done, finished jobs gone, deadlines one slot closer, each job's
current count = the cold plan's first slot) solved with `previous=` the cold plan. Each solve is
repeated `--repeat` times; `solve_s` is the median wall time (`solve_s_best` the best).

The LP bound is the compact LP relaxation (model.build_compact_lp, HiGHS) solved *outside* the
timed solve. Figures:
- `gap` = `problem.relative_gap(objective, bound)`, the one definition plans use too:
  (objective - bound) / (bound - M x deadlines no plan can meet). When the plan misses no more
  deadlines than the LP it is how far the completion, carbon and change terms are above the LP's;
  each deadline the plan drops beyond the LP adds M (more than all other terms) to the numerator.
- `deadline_misses_beyond_lp` = plan's misses - LP's misses (the LP's misses are the deadlines
  no plan can meet, when it equals `deadlines_impossible`). A positive value means the plan
  lost deadlines the LP kept. `objective_without_misses` / `lp_bound_without_misses` are each
  side with its own M x misses taken out (raw figures, not a gap).
- `--integer-bound` (slow, ~1 min per tick at 1,000 jobs): a lower bound on the best plan that
  books whole slots at allowed counts (Lagrangian relaxation of capacity, each job solved alone
  exactly; bench/bounds/integer.py), from the LP's capacity prices plus 15 subgradient steps:
  `integer_bound_without_misses`, `integer_bound_over_lp` (how much of any plan's gap to the LP
  no integer plan can close) and `gap_to_integer_bound` (the plan's own distance to it, an upper
  bound on how far it is from the optimum). Only for plans that meet every deadline that can be
  met (the bound keeps them as constraints).
- `steps_ran` / `plan_step`: the solver's steps that ran and the one whose plan it returned
  (`+repair`/`+polish` when those improved it).
- `--step-shares`: per case and time limit, over `--ticks` ticks, `plan_origin` (and its
  `plan_origin_share`) counts the step each returned plan came from; `ortools_share` the share
  from the OR-Tools model (LP roundings, MIPs; refined or not), `ortools_or_seeded_share` also
  counting ticks that kept such a plan through the warm start (`plan_root`: each tick's root),
  `ortools_ran_share` the share of ticks whose step budget ran the model at all.
- `--baseline-wins N`: on N random problems under budgets, how often the plan `solve` returns is
  a baseline's (they are candidates), and how often solving without them is worse or better.
Usage:
    python -m bench.solver_scale [--data DIR] [--cases 100:256,1000:2048] [--seed 0]
        [--time-limit-s 1.0] [--repeat 3] [--no-warm] [--integer-bound]
    python -m bench.solver_scale --mip-check 60:128:12,150:512:12   # integrality gap (slow)
    python -m bench.solver_scale --baseline-wins 50 --time-limit-s 0.5  # does a baseline win?
    python -m bench.solver_scale --step-shares 100:256,300:1024,1000:2048 --ticks 8 \
        --time-limits 0.5,1,5,10   # which step's plan wins, and the gap, per time limit
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

from bench.bounds.integer import capacity_duals, integer_bound
from energy_model.carbon.series import load_intensity_csv
from energy_model.power import job_power_w
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.highs import solve_lp, solve_mip
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    PlanArrays,
    evaluate_gpus,
    relative_gap,
    trim_after_finish,
)
from scheduler_service.allocation.solver import baseline_plans, solve, solve_with_baselines

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SLOT_S = 1800.0
SLOTS = 48
# Remaining work of a job, in hours at one GPU (uniform between the two).
WORK_H = (0.5, 12.0)


def make_jobs(
    num_jobs: int,
    max_gpus: int,
    data: Path,
    rng: np.random.Generator,
    work_h: tuple[float, float] = WORK_H,
) -> list[JobSpec]:
    """Random jobs with measured throughput tables (or a synthetic curve without the data)."""
    profiles_dir = data / "elasticflow" / "throughputs_A100"
    tables: list[dict[int, float]] = []
    if profiles_dir.is_dir():
        for profile in load_scaling_profiles(profiles_dir).values():
            for batch in profile.batch_sizes():
                table = profile.samples_per_s(batch)
                if table:
                    tables.append(table)
    else:
        tables = [{g: 100.0 * g**0.8 for g in (1, 2, 4, 8, 16, 32, 64)}]
    jobs = []
    for i in range(num_jobs):
        table = tables[int(rng.integers(len(tables)))]
        counts: list[int] = []
        rates: list[float] = []
        for g in sorted(table):
            if g <= max_gpus and (not rates or table[g] > rates[-1]):
                counts.append(g)
                rates.append(table[g])
        single = table.get(1, rates[0] / counts[0])
        power = [job_power_w(g, r, single) for g, r in zip(counts, rates, strict=True)]
        remaining = single * 3600.0 * float(rng.uniform(*work_h))
        deadline = None
        if rng.random() < 0.3:
            deadline = remaining / max(rates) * float(rng.uniform(0.7, 2.0))
        jobs.append(
            JobSpec(
                job_id=f"j{i}",
                allowed_gpus=tuple(counts),
                throughput_samples_per_s=tuple(rates),
                power_w=tuple(power),
                remaining_samples=remaining,
                deadline_s=deadline,
                priority=float(rng.choice([1.0, 1.0, 2.0])),
                current_gpus=0,
            )
        )
    return jobs


def intensity_day(data: Path) -> list[float]:
    """48 half-hour intensities: the first day of US-CAL-CISO 2021, or a synthetic dip."""
    path = data / "carbon" / "electricitymaps" / "US-CAL-CISO_2021_hourly.csv"
    if path.is_file():
        values = list(load_intensity_csv(path).intensity_g_per_kwh[:24])
        return [v for v in values for _ in range(2)]
    return [250.0 - 120.0 * np.sin(np.pi * t / SLOTS) for t in range(SLOTS)]


def next_tick(problem: AllocationProblem, plan: AllocationPlan) -> AllocationProblem:
    """The same cluster one slot later, after running the plan's first slot."""
    jobs = []
    for job in problem.jobs:
        g = plan.gpus[job.job_id][0]
        rate = job.throughput_samples_per_s[job.index_of(g)] if g else 0.0
        left = job.remaining_samples - rate * problem.slot_s
        if left <= job.remaining_samples * 1e-9:
            continue  # finished in the first slot
        deadline = None if job.deadline_s is None else job.deadline_s - problem.slot_s
        jobs.append(replace(job, remaining_samples=left, deadline_s=deadline, current_gpus=g))
    intensity = (*problem.intensity_g_per_kwh[1:], problem.intensity_g_per_kwh[0])
    return replace(
        problem,
        start_at=problem.start_at + timedelta(seconds=problem.slot_s),
        intensity_g_per_kwh=intensity,
        jobs=tuple(jobs),
    )


def measure(
    problem: AllocationProblem,
    previous: AllocationPlan | None,
    time_limit_s: float,
    seed: int,
    repeat: int,
    integer: bool = False,
) -> tuple[dict[str, object], AllocationPlan]:
    """Timed solves (repeated) and the plan's figures against the LP bound (solved untimed)."""
    times = []
    result = None
    for _ in range(repeat):
        began = time.perf_counter()
        result = solve_with_baselines(
            problem, previous=previous, time_limit_s=time_limit_s, seed=seed
        )
        times.append(time.perf_counter() - began)
    assert result is not None
    plan = result.plan
    began = time.perf_counter()
    lp = solve_lp(problem, PlanArrays(problem))
    lp_s = time.perf_counter() - began
    miss_cost = problem.deadline_miss_cost_s()
    misses = sum(1 for ok in plan.deadline_met.values() if not ok)
    lp_misses = float(lp.missed.sum())
    impossible = sum(1 for j in problem.jobs if problem.deadline_impossible(j))
    rest = plan.objective - miss_cost * misses
    rest_bound = lp.bound - miss_cost * lp_misses
    figures: dict[str, object] = {
        "jobs": len(problem.jobs),
        "slots": problem.num_slots,
        "gpus": max(problem.capacity_gpus),
        "solve_s": round(statistics.median(times), 3),
        "solve_s_best": round(min(times), 3),
        "gap": round(relative_gap(problem, plan.objective, lp.bound), 5),
        "deadline_misses_beyond_lp": round(misses - lp_misses, 2),
        "status": plan.status,
        "deadlines_met": f"{len(plan.deadline_met) - misses}/{len(plan.deadline_met)}",
        "deadlines_impossible": impossible,
        "lp_deadline_misses": round(lp_misses, 2),
        "objective_without_misses": round(rest, 1),
        "lp_bound_without_misses": round(rest_bound, 1),
        "lp_s_untimed": round(lp_s, 2),
        "gpu_changes": plan.gpu_changes,
        "steps_ran": list(result.ran),
        "plan_step": result.chosen,
    }
    if integer and misses == impossible:
        began = time.perf_counter()
        bound, _ = integer_bound(problem, capacity_duals(problem), rest)
        figures["integer_bound_without_misses"] = round(bound, 1)
        figures["integer_bound_over_lp"] = round((bound - rest_bound) / abs(rest_bound), 5)
        figures["gap_to_integer_bound"] = round((rest - bound) / abs(bound), 5)
        figures["integer_bound_s_untimed"] = round(time.perf_counter() - began, 1)
    return figures, plan


def run_case(
    num_jobs: int,
    gpus: int,
    data: Path,
    seed: int,
    time_limit_s: float,
    repeat: int,
    warm: bool,
    integer: bool = False,
    work_h: tuple[float, float] = WORK_H,
) -> dict[str, object]:
    """Solve one case cold, then (optionally) once more one slot later, warm-started."""
    rng = np.random.default_rng(seed)
    jobs = make_jobs(num_jobs, min(gpus, 64), data, rng, work_h)
    problem = AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=SLOT_S,
        capacity_gpus=(gpus,) * SLOTS,
        intensity_g_per_kwh=tuple(intensity_day(data)),
        jobs=tuple(jobs),
    )
    out, cold_plan = measure(problem, None, time_limit_s, seed, repeat, integer)
    if warm:
        later = next_tick(problem, cold_plan)
        out["warm"], _ = measure(later, cold_plan, time_limit_s, seed, repeat, integer)
    return out


def mip_check(
    num_jobs: int,
    gpus: int,
    slots: int,
    data: Path,
    seed: int,
    mip_limit_s: float,
    work_h: tuple[float, float] = WORK_H,
) -> dict[str, object]:
    """Integrality check on a small case: solve's plan and the exact MIP optimum vs the LP bound.

    Both gaps are `relative_gap` against the LP bound, like `gap` above.
    """
    rng = np.random.default_rng(seed)
    jobs = make_jobs(num_jobs, min(gpus, 64), data, rng, work_h)
    problem = AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=SLOT_S,
        capacity_gpus=(gpus,) * slots,
        intensity_g_per_kwh=tuple(intensity_day(data)[:slots]),
        jobs=tuple(jobs),
    )
    arrays = PlanArrays(problem)
    lp = solve_lp(problem, arrays)

    def gap_and_misses(gpus_plan: dict[str, tuple[int, ...]]) -> tuple[float, int]:
        ev = evaluate_gpus(problem, gpus_plan)
        misses = sum(1 for ok in ev.deadline_met.values() if not ok)
        return relative_gap(problem, ev.objective, lp.bound), misses

    plan = solve(problem, time_limit_s=1.0, seed=seed, use_lp=False)
    began = time.perf_counter()
    mip, _, optimal = solve_mip(problem, arrays, seed, max_nodes=None, safety_net_s=mip_limit_s)
    mip_s = time.perf_counter() - began
    heuristic_gap, heuristic_misses = gap_and_misses(plan.gpus)
    out: dict[str, object] = {
        "jobs": num_jobs,
        "slots": slots,
        "gpus": gpus,
        "lp_deadline_misses": round(float(lp.missed.sum()), 2),
        "heuristic_gap": round(heuristic_gap, 5),
        "heuristic_misses": heuristic_misses,
        "mip_s": round(mip_s, 2),
        "mip_optimal": optimal,  # within HiGHS' mip_rel_gap (1e-4)
    }
    if mip is not None:
        mip_gap, mip_misses = gap_and_misses(trim_after_finish(problem, mip))
        out["mip_gap"] = round(mip_gap, 5)
        out["mip_misses"] = mip_misses
    return out


# Plan origins that are the OR-Tools model's (the LP's roundings and the MIPs).
ORTOOLS_STEPS = ("lp_ceil", "lp_nearest", "lp_greedy", "lp_greedy_2", "near_mip", "exact_mip")


def plan_roots(chosen: list[str]) -> list[str]:
    """Per tick, the step the plan descends from: a plan that is the previous tick's plan kept
    (`warm_start`, refined or not) descends from whatever that plan descended from, so an
    OR-Tools plan carried over by the warm start still counts as seeded by the model."""
    roots: list[str] = []
    for step in chosen:
        origin = step.split("+")[0]
        roots.append(roots[-1] if origin == "warm_start" and roots else origin)
    return roots


def step_shares(
    num_jobs: int,
    gpus: int,
    data: Path,
    seed: int,
    time_limit_s: float,
    ticks: int,
    work_h: tuple[float, float] = WORK_H,
) -> dict[str, object]:
    """Which step produced the plan over `ticks` ticks (cold, then warm one slot later each),
    the share whose plan came from the OR-Tools model (`ORTOOLS_STEPS`, refined or not), the
    share that came from it or from its plan kept by the warm start (`plan_roots`), and the gap
    to the LP bound of each tick (LP solved untimed)."""
    rng = np.random.default_rng(seed)
    problem = AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=SLOT_S,
        capacity_gpus=(gpus,) * SLOTS,
        intensity_g_per_kwh=tuple(intensity_day(data)),
        jobs=tuple(make_jobs(num_jobs, min(gpus, 64), data, rng, work_h)),
    )
    previous: AllocationPlan | None = None
    origins: dict[str, int] = {}
    chosen: list[str] = []
    gaps: list[float] = []
    solve_s: list[float] = []
    model_ran = 0  # ticks in which the OR-Tools model (the LP, hence its roundings) was solved
    for _ in range(ticks):
        began = time.perf_counter()
        result = solve_with_baselines(
            problem, previous=previous, time_limit_s=time_limit_s, seed=seed
        )
        solve_s.append(time.perf_counter() - began)
        lp = solve_lp(problem, PlanArrays(problem))
        gaps.append(relative_gap(problem, result.plan.objective, lp.bound))
        chosen.append(result.chosen)
        model_ran += "lp" in result.ran
        origin = result.chosen.split("+")[0]
        origins[origin] = origins.get(origin, 0) + 1
        previous = result.plan
        problem = next_tick(problem, result.plan)
        if not problem.jobs:
            break
    ortools = sum(n for k, n in origins.items() if k in ORTOOLS_STEPS)
    roots = plan_roots(chosen)
    seeded = sum(1 for r in roots if r in ORTOOLS_STEPS)
    return {
        "jobs": num_jobs,
        "gpus": gpus,
        "time_limit_s": time_limit_s,
        "ticks": len(chosen),
        "ortools_share": round(ortools / len(chosen), 3),
        "ortools_or_seeded_share": round(seeded / len(chosen), 3),
        # The model can only win where the step budget let it run.
        "ortools_ran_share": round(model_ran / len(chosen), 3),
        "plan_origin": dict(sorted(origins.items())),
        "plan_origin_share": {k: round(n / len(chosen), 3) for k, n in sorted(origins.items())},
        "plan_root": roots,
        "plan_step": chosen,
        "gap_mean": round(statistics.fmean(gaps), 5),
        "gap_max": round(max(gaps), 5),
        "solve_s_mean": round(statistics.fmean(solve_s), 3),
        "solve_s_max": round(max(solve_s), 3),
    }


def random_budget_problem(rng: np.random.Generator, data: Path) -> AllocationProblem:
    """A problem like the property tests': 20-100 jobs, 8-48 slots, 16-128 GPUs, half of them
    under 2-4 hard budget periods at 0-60 % of what a full cluster at 300 W/GPU would emit."""
    num_jobs = int(rng.integers(20, 101))
    gpus = int(rng.integers(16, 129))
    slots = int(rng.integers(8, 49))
    jobs = make_jobs(num_jobs, min(gpus, 64), data, rng, (0.5, 6.0))
    intensity = np.array((intensity_day(data) * 2)[:slots])
    periods: list[BudgetPeriod] = []
    mode = BudgetMode.SOFT
    if rng.random() < 0.5:
        mode = BudgetMode.HARD
        cuts = np.sort(rng.uniform(0.0, slots * SLOT_S, int(rng.integers(1, 4))))
        edges = [0.0, *cuts, slots * SLOT_S]
        full_kg = gpus * 300.0 * intensity * SLOT_S / 3.6e9
        starts = np.arange(slots) * SLOT_S
        for lo, hi in itertools.pairwise(edges):
            share = np.clip(np.minimum(starts + SLOT_S, hi) - np.maximum(starts, lo), 0, None)
            kg = float((full_kg * share / SLOT_S).sum()) * float(rng.uniform(0.0, 0.6))
            periods.append(BudgetPeriod(float(lo), float(hi), kg))
    return AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=SLOT_S,
        capacity_gpus=(gpus,) * slots,
        intensity_g_per_kwh=tuple(float(x) for x in intensity),
        jobs=tuple(jobs),
        budget_periods=tuple(periods),
        budget_mode=mode,
        carbon_price_s_per_kg=float(rng.choice([0.0, 500.0])),
        change_cost_s=30.0,
    )


def baseline_wins(count: int, data: Path, seed: int, time_limit_s: float) -> dict[str, object]:
    """How often a baseline's plan is `solve`'s answer, and what solving without them costs.

    On `count` random problems (`random_budget_problem`): the step that produced each plan,
    how many times that was a baseline, and how many times `solve(use_baselines=False)` is
    worse or better on the objective than `solve` with them (the baselines take a share of the
    time budget from the other steps, so either can happen). `beaten_by_a_baseline`: problems
    where some baseline's own plan scores better than `solve(use_baselines=False)` (the claim
    tests/allocation/test_large_properties.py cannot make for every problem), with how many of
    them by a deadline (the baseline meets more) and the largest relative loss.
    """
    chosen: dict[str, int] = {}
    worse = better = beaten = beaten_on_deadlines = 0
    worst = worst_beaten = 0.0
    for i in range(count):
        problem = random_budget_problem(np.random.default_rng(seed + i), data)
        full = solve_with_baselines(problem, time_limit_s=time_limit_s, seed=seed)
        bare = solve(problem, time_limit_s=time_limit_s, seed=seed, use_baselines=False)
        origin = full.chosen.split("+")[0]
        chosen[origin] = chosen.get(origin, 0) + 1
        if bare.objective > full.plan.objective * (1 + 1e-9):
            worse += 1
            worst = max(worst, bare.objective / full.plan.objective - 1)
        elif bare.objective < full.plan.objective * (1 - 1e-9):
            better += 1
        plans = full.baselines or {p.policy: p for p in baseline_plans(problem, time_limit_s, seed)}
        winners = [p for p in plans.values() if bare.objective > p.objective * (1 + 1e-9)]
        if winners:
            beaten += 1
            misses = sum(not ok for ok in bare.deadline_met.values())
            if any(sum(not ok for ok in p.deadline_met.values()) < misses for p in winners):
                beaten_on_deadlines += 1
            best = min(p.objective for p in winners)
            worst_beaten = max(worst_beaten, bare.objective / best - 1)
    return {
        "problems": count,
        "time_limit_s": time_limit_s,
        "baseline_chosen": sum(n for k, n in chosen.items() if k.startswith("baseline:")),
        "plan_step": dict(sorted(chosen.items())),
        "worse_without_baselines": worse,
        "worst_loss_without_baselines": round(worst, 5),
        "better_without_baselines": better,
        "beaten_by_a_baseline": beaten,
        "beaten_by_a_baseline_on_deadlines": beaten_on_deadlines,
        "worst_loss_to_a_baseline": round(worst_beaten, 5),
    }


def main() -> None:
    """Parse options, run every case, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--cases", default="100:256,1000:256,1000:2048,5000:8192")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-warm", action="store_true")
    parser.add_argument(
        "--mip-check",
        default="",
        help="JOBS:GPUS:SLOTS,... small cases where the exact MIP is solved too (integrality gap)",
    )
    parser.add_argument("--mip-limit-s", type=float, default=300.0)
    parser.add_argument(
        "--step-shares",
        default="",
        help="JOBS:GPUS,... which step's plan wins over --ticks ticks at each --time-limits limit",
    )
    parser.add_argument("--ticks", type=int, default=8)
    parser.add_argument("--time-limits", default="0.5,1,5,10")
    parser.add_argument(
        "--baseline-wins",
        type=int,
        default=0,
        help="N: on N random 20-100-job problems, how often a baseline's plan wins (no cases)",
    )
    parser.add_argument(
        "--integer-bound",
        action="store_true",
        help="also a lower bound on the best whole-slot plan (slow; bench/bounds/integer.py)",
    )
    parser.add_argument(
        "--work-hours",
        default=f"{WORK_H[0]:g}:{WORK_H[1]:g}",
        help="LO:HI hours of work per job at one GPU (sensitivity: longer jobs, less slot rounding)",
    )
    args = parser.parse_args()
    lo_h, hi_h = (float(x) for x in args.work_hours.split(":"))
    if not 0 < lo_h <= hi_h:
        parser.error(f"--work-hours must be LO:HI with 0 < LO <= HI, got {args.work_hours!r}")
    if args.step_shares:
        shares = []
        for spec in args.step_shares.split(","):
            jobs, gpus = (int(x) for x in spec.split(":"))
            for limit in (float(x) for x in args.time_limits.split(",")):
                shares.append(
                    step_shares(jobs, gpus, args.data, args.seed, limit, args.ticks, (lo_h, hi_h))
                )
                print(json.dumps(shares[-1]), file=sys.stderr)
        loads = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps({"step_shares": shares, "load_avg_1_5_15": loads}, indent=2))
        return
    if args.baseline_wins > 0:
        wins = baseline_wins(args.baseline_wins, args.data, args.seed, args.time_limit_s)
        wins["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps({"baseline_wins": wins}, indent=2))
        return
    if args.mip_check:
        checks = []
        for spec in args.mip_check.split(","):
            jobs, gpus, slots = (int(x) for x in spec.split(":"))
            checks.append(
                mip_check(jobs, gpus, slots, args.data, args.seed, args.mip_limit_s, (lo_h, hi_h))
            )
            print(json.dumps(checks[-1]), file=sys.stderr)
        print(json.dumps({"mip_checks": checks}, indent=2))
        return
    cases = []
    for spec in args.cases.split(","):
        jobs, gpus = (int(x) for x in spec.split(":"))
        cases.append(
            run_case(
                jobs,
                gpus,
                args.data,
                args.seed,
                args.time_limit_s,
                args.repeat,
                not args.no_warm,
                args.integer_bound,
                (lo_h, hi_h),
            )
        )
        print(json.dumps(cases[-1]), file=sys.stderr)
    load = os.getloadavg()
    print(
        json.dumps(
            {
                "time_limit_s": args.time_limit_s,
                "work_hours": [lo_h, hi_h],
                "load_avg_1_5_15": [round(x, 2) for x in load],
                "cases": cases,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
