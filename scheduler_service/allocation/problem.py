"""Plain data of the allocation problem and plan, and the one objective every policy is judged on.

Times inside a problem are seconds from `AllocationProblem.start_at`; `start_at` itself is a
timezone-aware UTC datetime so plans can be mapped back to wall-clock time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TypeVar

import numpy as np

from energy_model.emissions import GRAMS_PER_KG, SECONDS_PER_HOUR, WATTS_PER_KILOWATT

K = TypeVar("K")

# Cap on the budget-aware tail (slots per unit of leftover work fraction): see budget_tail_slots.
BUDGET_TAIL_MAX_SLOTS = 1e5


class BudgetMode(StrEnum):
    """How the carbon budget binds: `hard` = constraint per period, `soft` = priced only."""

    HARD = "hard"
    SOFT = "soft"


class InvalidProblem(ValueError):
    """The problem's data is inconsistent (the message names the field)."""


def allowed_gpu_counts(min_gpus: int, max_gpus: int, powers_of_two: bool = True) -> tuple[int, ...]:
    """GPU counts a job may run at: powers of two in [min_gpus, max_gpus] by default."""
    if min_gpus < 1 or max_gpus < min_gpus:
        raise InvalidProblem(f"need 1 <= min_gpus <= max_gpus, got {min_gpus}, {max_gpus}")
    if not powers_of_two:
        return tuple(range(min_gpus, max_gpus + 1))
    counts = tuple(2**i for i in range(0, 31) if min_gpus <= 2**i <= max_gpus)
    if not counts:
        raise InvalidProblem(f"no power of two between min_gpus={min_gpus} and max_gpus={max_gpus}")
    return counts


@dataclass(frozen=True)
class JobSpec:
    """One job as the solver sees it: its options (counts, speed, power) and its remaining work."""

    job_id: str
    allowed_gpus: tuple[int, ...]
    throughput_samples_per_s: tuple[float, ...]  # one per allowed count
    power_w: tuple[float, ...]  # total job power at each allowed count
    remaining_samples: float
    deadline_s: float | None = None  # seconds from problem start; None = no deadline
    priority: float = 1.0
    current_gpus: int = 0
    best_effort: bool = False  # admitted without a deadline guarantee when it cannot be met
    requested_gpus: int = 0  # the count a fixed-size policy runs it at (0 = largest allowed)
    # It ran before the problem's start: resuming it from 0 GPUs stalls it like a count change.
    started: bool = False
    # Seconds `deadline_s` lies before the promised deadline (the builder's margin): a finish
    # inside it misses `deadline_s` but keeps the promise, so it costs far less than a finish
    # after the promise (`evaluate_gpus`).
    deadline_margin_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.allowed_gpus)
        if n == 0:
            raise InvalidProblem(f"job {self.job_id}: allowed_gpus is empty")
        if list(self.allowed_gpus) != sorted(set(self.allowed_gpus)) or self.allowed_gpus[0] < 1:
            raise InvalidProblem(f"job {self.job_id}: allowed_gpus must be increasing and >= 1")
        if len(self.throughput_samples_per_s) != n or len(self.power_w) != n:
            raise InvalidProblem(
                f"job {self.job_id}: throughput_samples_per_s and power_w need one value per "
                f"allowed count ({n})"
            )
        if any(not (v > 0 and math.isfinite(v)) for v in self.throughput_samples_per_s):
            raise InvalidProblem(f"job {self.job_id}: throughput_samples_per_s must be > 0")
        if any(not (v >= 0 and math.isfinite(v)) for v in self.power_w):
            raise InvalidProblem(f"job {self.job_id}: power_w must be >= 0")
        if not self.remaining_samples > 0:
            raise InvalidProblem(f"job {self.job_id}: remaining_samples must be > 0")
        if self.priority <= 0:
            raise InvalidProblem(f"job {self.job_id}: priority must be > 0")
        if not (self.deadline_margin_s >= 0 and math.isfinite(self.deadline_margin_s)):
            raise InvalidProblem(f"job {self.job_id}: deadline_margin_s must be >= 0")
        if self.current_gpus != 0 and self.current_gpus not in self.allowed_gpus:
            raise InvalidProblem(
                f"job {self.job_id}: current_gpus {self.current_gpus} is not an allowed count"
            )

    @property
    def fixed_gpus(self) -> int:
        """The allowed count closest to `requested_gpus` from below (largest when unset)."""
        if not self.requested_gpus:
            return self.allowed_gpus[-1]
        fitting = [g for g in self.allowed_gpus if g <= self.requested_gpus]
        return fitting[-1] if fitting else self.allowed_gpus[0]

    def index_of(self, gpus: int) -> int:
        """Position of `gpus` in `allowed_gpus` (-1 for 0 GPUs)."""
        return -1 if gpus == 0 else self.allowed_gpus.index(gpus)


@dataclass(frozen=True)
class BudgetPeriod:
    """Carbon budget still unspent in one budget period (a day, a week) touched by the horizon."""

    start_s: float  # period bounds in seconds from problem start (may be negative / past horizon)
    end_s: float
    budget_left_kg: float


@dataclass(frozen=True)
class TeamBudget:
    """One team's hard budget: only its jobs' emissions count against its periods' kg left."""

    team: str
    job_ids: frozenset[str]
    periods: tuple[BudgetPeriod, ...]


@dataclass(frozen=True)
class AllocationProblem:
    """Everything one planning tick needs: slots, capacity, carbon, budget and jobs."""

    start_at: datetime
    slot_s: float
    capacity_gpus: tuple[int, ...]  # one per slot; its length is the horizon
    intensity_g_per_kwh: tuple[float, ...]  # forecast, one per slot
    jobs: tuple[JobSpec, ...]
    pue: float = 1.0
    budget_periods: tuple[BudgetPeriod, ...] = ()
    budget_mode: BudgetMode = BudgetMode.HARD
    # Seconds of priority-weighted completion time that one kg CO2e is worth (soft trade-off).
    carbon_price_s_per_kg: float = 0.0
    # Priority-weighted seconds charged per GPU-count change: a tie-breaker towards stable plans.
    change_cost_s: float = 1.0
    # Teams' hard budgets (whatever `budget_mode`): every plan is cut to them (`make_plan`).
    team_budgets: tuple[TeamBudget, ...] = ()
    # Seconds of progress a job loses when its count changes or it resumes after running (a hot
    # switch's stall). Plans count it, so a promised finish survives the switches they plan
    # (issue 23); 0: not modelled. Shorter than a slot.
    switch_stall_s: float = 0.0

    def __post_init__(self) -> None:
        if self.start_at.tzinfo is None:
            raise InvalidProblem("start_at must be timezone-aware UTC")
        if self.slot_s <= 0:
            raise InvalidProblem(f"slot_s must be > 0, got {self.slot_s}")
        if not self.capacity_gpus:
            raise InvalidProblem("capacity_gpus is empty: the horizon needs at least one slot")
        if len(self.intensity_g_per_kwh) != len(self.capacity_gpus):
            raise InvalidProblem("intensity_g_per_kwh needs one value per slot of capacity_gpus")
        if any(c < 0 for c in self.capacity_gpus):
            raise InvalidProblem("capacity_gpus must be >= 0")
        if any(not (i >= 0 and math.isfinite(i)) for i in self.intensity_g_per_kwh):
            raise InvalidProblem("intensity_g_per_kwh must be finite and >= 0")
        if self.pue < 1.0:
            raise InvalidProblem(f"pue must be >= 1, got {self.pue}")
        if len({j.job_id for j in self.jobs}) != len(self.jobs):
            raise InvalidProblem("job_id values must be unique")
        if self.carbon_price_s_per_kg < 0 or self.change_cost_s < 0:
            raise InvalidProblem("carbon_price_s_per_kg and change_cost_s must be >= 0")
        if not 0 <= self.switch_stall_s < self.slot_s:
            raise InvalidProblem(
                f"switch_stall_s must be >= 0 and shorter than a slot, got {self.switch_stall_s}"
            )

    @property
    def num_slots(self) -> int:
        """Number of slots in the horizon."""
        return len(self.capacity_gpus)

    @property
    def horizon_s(self) -> float:
        """Length of the horizon in seconds."""
        return self.num_slots * self.slot_s

    def slot_emissions_kg_per_w(self) -> np.ndarray:
        """kg CO2e per W of IT power drawn for one whole slot, per slot (PUE included)."""
        intensity = np.asarray(self.intensity_g_per_kwh, dtype=float)
        hours = self.slot_s / SECONDS_PER_HOUR
        return intensity * hours * self.pue / WATTS_PER_KILOWATT / GRAMS_PER_KG

    def period_slots(
        self, periods: tuple[BudgetPeriod, ...] | None = None
    ) -> list[tuple[BudgetPeriod, np.ndarray]]:
        """Per budget period (the cluster's, or `periods`), the share of each slot inside it (0..1)."""
        starts = np.arange(self.num_slots) * self.slot_s
        ends = starts + self.slot_s
        out = []
        for period in self.budget_periods if periods is None else periods:
            overlap = np.clip(
                np.minimum(ends, period.end_s) - np.maximum(starts, period.start_s), 0, None
            )
            share = overlap / self.slot_s
            if share.any():
                out.append((period, share))
        return out

    def deadline_position(self, job: JobSpec) -> tuple[int, float] | None:
        """(slot holding the deadline, fraction of that slot before it); None without deadline.

        A deadline at or beyond the horizon's end returns (num_slots, 0.0); before start, (0, 0).
        """
        if job.deadline_s is None:
            return None
        if job.deadline_s >= self.horizon_s:
            return self.num_slots, 0.0
        if job.deadline_s <= 0:
            return 0, 0.0
        slot = int(job.deadline_s // self.slot_s)
        return slot, (job.deadline_s - slot * self.slot_s) / self.slot_s

    def deadline_impossible(self, job: JobSpec) -> bool:
        """Whether no plan can meet the job's deadline (its work at the fastest count takes longer)."""
        return (
            job.deadline_s is not None
            and job.remaining_samples / self.usable_max_rate(job) > job.deadline_s + 1e-6
        )

    def certain_miss_cost_s(self) -> float:
        """Miss cost of the deadlines no plan can meet: the same in every plan and in the bound."""
        impossible = sum(1 for job in self.jobs if self.deadline_impossible(job))
        return self.deadline_miss_cost_s() * impossible if impossible else 0.0

    def certain_break_cost_s(self) -> float:
        """What every plan pays beyond `certain_miss_cost_s` for promises no plan can keep (the
        models and their bounds count a miss once, `evaluate_gpus` a broken promise more)."""
        extra = self.margin_jobs()
        if not extra:
            return 0.0
        broken = sum(
            1
            for job in self.jobs
            if job.deadline_s is not None
            and self.deadline_impossible(
                replace(job, deadline_s=job.deadline_s + job.deadline_margin_s)
            )
        )
        return self.deadline_miss_cost_s() * extra * broken if broken else 0.0

    def usable_max_rate(self, job: JobSpec) -> float:
        """Fastest samples/s over the job's counts that fit the largest slot capacity."""
        cap = max(self.capacity_gpus)
        rates = [
            r
            for g, r in zip(job.allowed_gpus, job.throughput_samples_per_s, strict=True)
            if g <= cap
        ]
        return max(rates) if rates else job.throughput_samples_per_s[0]

    def leftover_budget_rate_kg_per_s(self) -> float | None:
        """kg per second the budget pays after the horizon (hard mode): the last period's rate.

        The period holding the horizon's end sets it (its budget left over its time from the
        horizon's start or its own, whichever is later); None when no period holds the end, the
        mode is soft, or that budget is spent (then nothing is known about the rate).
        """
        if self.budget_mode is not BudgetMode.HARD:
            return None
        horizon_s = self.horizon_s
        holding = [p for p in self.budget_periods if p.start_s < horizon_s <= p.end_s]
        if not holding:
            return None
        last = max(holding, key=lambda p: p.start_s)
        length_s = last.end_s - max(last.start_s, 0.0)
        if last.budget_left_kg <= 0 or length_s <= 0:
            return None
        rate_kg_per_s = last.budget_left_kg / length_s
        # A budget left of a few denormal kg divides to 0.0: as spent as a budget of 0.
        return rate_kg_per_s if rate_kg_per_s > 0 else None

    def margin_jobs(self) -> int:
        """Jobs whose `deadline_s` lies a margin before the promised deadline."""
        return sum(
            1 for job in self.jobs if job.deadline_s is not None and job.deadline_margin_s > 0
        )

    def deadline_miss_cost_s(self) -> float:
        """Weight of one missed deadline: above any other objective term, so misses come first."""
        arrays = plan_arrays(self)
        tail = float((arrays.priority * self.slot_s * (arrays.tail_slots + 1.0)).sum())
        rest = float(arrays.priority.sum()) * self.horizon_s + tail
        carbon = (
            self.carbon_price_s_per_kg
            * float(arrays.power_w.max(axis=1, initial=0.0).sum())
            * float(self.slot_emissions_kg_per_w().sum())
        )
        changes = self.change_cost_s * len(self.jobs) * (self.num_slots + 1)
        return 10.0 * (rest + carbon + changes + 1.0)


@dataclass(frozen=True)
class AllocationPlan:
    """The solver's answer: GPUs per job per slot and what that plan is expected to cost."""

    start_at: datetime
    slot_s: float
    gpus: dict[str, tuple[int, ...]]  # job_id -> GPU count per slot
    completion_s: dict[str, float | None]  # projected finish, s from start (None: after horizon)
    energy_kwh_per_slot: tuple[float, ...]
    emissions_kg_per_slot: tuple[float, ...]
    deadline_met: dict[str, bool]  # jobs with a deadline only
    missed_reasons: dict[str, str]
    gpu_changes: int
    objective: float  # see plan_objective; lower is better
    status: str  # optimal | feasible | heuristic | baseline
    gap: float | None  # relative gap to the best bound (None: no bound known)
    bound: float | None
    solve_s: float
    policy: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The heuristic's capacity price per slot (objective units per GPU for the slot; 0 where GPUs
    # were spare; empty when not known): the next tick's warm start values finishing with it.
    gpu_price_per_slot: tuple[float, ...] = ()
    # Which solver step produced the plan ("lp_ceil+polish": the LP's ceil rounding, then the
    # local search; empty for other policies' plans). See docs/allocation.md, "How solve works".
    step: str = ""
    # Jobs whose GPUs a team's hard budget cut: job id -> the team (`cut_to_team_budgets`).
    team_cut: dict[str, str] = field(default_factory=dict)

    @property
    def energy_kwh(self) -> float:
        """Total projected energy (kWh, facility side)."""
        return float(sum(self.energy_kwh_per_slot))

    @property
    def emissions_kg(self) -> float:
        """Total projected emissions (kg CO2e)."""
        return float(sum(self.emissions_kg_per_slot))

    def completion_at(self, job_id: str) -> datetime | None:
        """Projected completion as a UTC datetime (None when beyond the horizon)."""
        value = self.completion_s.get(job_id)
        return None if value is None else self.start_at + timedelta(seconds=value)

    def first_slot(self) -> dict[str, int]:
        """GPU count per job for the slot about to start."""
        return {job_id: counts[0] for job_id, counts in self.gpus.items()}


@dataclass(frozen=True)
class PlanEvaluation:
    """Every figure of a GPU matrix under a problem (shared by the solver and the baselines)."""

    completion_s: dict[str, float | None]
    deadline_met: dict[str, bool]
    energy_kwh_per_slot: np.ndarray
    emissions_kg_per_slot: np.ndarray
    gpu_changes: int
    objective: float
    capacity_ok: bool
    allowed_ok: bool
    budget_ok: bool
    unfinished_area: dict[str, float]  # slots x remaining fraction: fractional completion
    # Samples each job's counts get done within the horizon (switch stalls taken off).
    done_samples: dict[str, float] = field(default_factory=dict)


class PlanArrays:
    """Per-job option tables padded to a rectangle, for vectorised model building."""

    def __init__(self, problem: AllocationProblem) -> None:
        jobs = problem.jobs
        self.num_jobs = len(jobs)
        self.num_options = max((len(j.allowed_gpus) for j in jobs), default=1)
        shape = (self.num_jobs, self.num_options)
        self.gpus = np.zeros(shape, dtype=np.int64)
        self.throughput = np.zeros(shape)
        self.power_w = np.zeros(shape)
        self.valid = np.zeros(shape, dtype=bool)
        for i, job in enumerate(jobs):
            n = len(job.allowed_gpus)
            self.gpus[i, :n] = job.allowed_gpus
            self.throughput[i, :n] = job.throughput_samples_per_s
            self.power_w[i, :n] = job.power_w
            self.valid[i, :n] = True
        self.remaining = np.array([j.remaining_samples for j in jobs], dtype=float)
        self.priority = np.array([j.priority for j in jobs], dtype=float)
        # Fraction of the job's remaining work done by one whole slot at each option.
        self.progress = (
            self.throughput * problem.slot_s / np.maximum(self.remaining, 1e-12)[:, None]
        )
        # Counts above every slot's capacity can never run: leave them out of the models.
        cap = max(problem.capacity_gpus)
        fits = self.gpus <= cap
        # usable_max_rate, vectorised: fastest count that fits (else the smallest count's rate).
        fitting = np.where(self.valid & fits, self.throughput, -np.inf).max(axis=1, initial=-np.inf)
        self.max_throughput = np.where(np.isfinite(fitting), fitting, self.throughput[:, 0])
        fits[:, 0] |= ~fits.any(axis=1)  # keep one option per job (it stays off by capacity)
        self.valid &= fits
        # Slots still needed at the fastest rate per unit of leftover work fraction.
        self.tail_slots = self.remaining / (self.max_throughput * problem.slot_s)
        # Emissions of finishing all remaining work after the horizon at the job's most
        # efficient count and the horizon's cleanest intensity (deferring is never free);
        # leftover_kg_per_fraction, vectorised.
        joules_per_sample = np.where(
            self.gpus > 0, self.power_w / np.where(self.gpus > 0, self.throughput, 1.0), np.inf
        ).min(axis=1, initial=np.inf)
        kwh = self.remaining * joules_per_sample / SECONDS_PER_HOUR / WATTS_PER_KILOWATT
        intensity = min(problem.intensity_g_per_kwh)
        self.tail_kg = kwh * problem.pue * intensity / GRAMS_PER_KG
        rate_kg_per_s = problem.leftover_budget_rate_kg_per_s()
        if rate_kg_per_s is not None:
            # Under a hard budget leftover work also waits for budget: at the last period's rate,
            # jobs served least kg first, a job's leftover finishes when its kg and the kg of the
            # jobs before it are paid; summed over jobs, each leftover kg of job j delays j and
            # every job with more kg to go (budget_tail_slots). Whichever tail is longer counts.
            self.tail_slots = np.maximum(
                self.tail_slots,
                budget_tail_slots(self.tail_kg, self.priority, rate_kg_per_s, problem.slot_s),
            )


def budget_tail_slots(
    tail_kg: np.ndarray, priority: np.ndarray, rate_kg_per_s: float, slot_s: float
) -> np.ndarray:
    """Per job: slots of priority-weighted waiting per unit of leftover fraction under a budget.

    Leftover work runs after the horizon as the budget pays for it (`rate_kg_per_s`), jobs
    served least kg first (ties by job order). Job j's leftover kg then delays j and every job
    served after it, so it costs kg_j * (sum of their priorities) / rate seconds, divided here by
    priority_j * slot_s to be in the objective's tail units.
    """
    order = np.lexsort((np.arange(len(tail_kg)), tail_kg))
    behind = np.empty_like(priority)
    behind[order] = np.cumsum(priority[order][::-1])[::-1]
    with np.errstate(over="ignore"):  # an astronomic tail is capped just below
        slots = tail_kg * behind / (rate_kg_per_s * priority * slot_s)
    # A nearly spent budget would make the tail astronomic and drown every other term in float
    # rounding; past this many slots per leftover fraction the plan's choices no longer change.
    return np.asarray(np.minimum(slots, BUDGET_TAIL_MAX_SLOTS), dtype=float)


_ARRAYS_CACHE: dict[int, tuple[AllocationProblem, PlanArrays]] = {}


def plan_arrays(problem: AllocationProblem) -> PlanArrays:
    """PlanArrays of a problem, reused while the same problem object is being evaluated."""
    hit = _ARRAYS_CACHE.get(id(problem))
    if hit is not None and hit[0] is problem:
        return hit[1]
    arrays = PlanArrays(problem)
    # One entry is enough (a solve evaluates one problem many times) and keeps memory flat.
    _ARRAYS_CACHE.clear()
    _ARRAYS_CACHE[id(problem)] = (problem, arrays)
    return arrays


def leftover_kg_per_fraction(problem: AllocationProblem, job: JobSpec) -> float:
    """kg CO2e to finish all of a job's remaining work after the horizon (optimistic)."""
    joules_per_sample = min(
        p / t for p, t in zip(job.power_w, job.throughput_samples_per_s, strict=True)
    )
    kwh = job.remaining_samples * joules_per_sample / SECONDS_PER_HOUR / WATTS_PER_KILOWATT
    return kwh * problem.pue * min(problem.intensity_g_per_kwh) / GRAMS_PER_KG


def option_matrix(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]], arrays: PlanArrays
) -> tuple[np.ndarray, np.ndarray]:
    """(option index per job and slot, -1 = off or not allowed; GPU count as given)."""
    num_slots = problem.num_slots
    off = (0,) * num_slots
    rows = [gpus.get(job.job_id, off) for job in problem.jobs]
    for job, row in zip(problem.jobs, rows, strict=True):
        if len(row) != num_slots:
            raise InvalidProblem(f"plan for job {job.job_id} has {len(row)} slots, not {num_slots}")
    counts = np.array(rows, dtype=np.int64).reshape(len(problem.jobs), num_slots)
    # Padding options have 0 GPUs, so they never match a running count.
    match = (arrays.gpus[:, :, None] == counts[:, None, :]) & (arrays.gpus[:, :, None] > 0)
    options = np.where(match.any(axis=1), match.argmax(axis=1), -1)
    return options, counts


def evaluate_gpus(problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]) -> PlanEvaluation:
    """Completion, energy, emissions, changes, checks and objective of a GPU matrix.

    Vectorised over jobs x slots (the solver evaluates every candidate plan with it). A job runs
    a slot at its count from the slot's start; it finishes inside the first slot whose work covers
    what is left. A plan books GPUs for whole slots, so energy and emissions charge the whole slot
    (an upper bound that keeps hard budgets safe; the simulator charges what really ran).
    """
    num_slots, slot_s = problem.num_slots, problem.slot_s
    arrays = plan_arrays(problem)
    num_jobs = arrays.num_jobs
    options, counts = option_matrix(problem, gpus, arrays)
    rows = np.arange(num_jobs)[:, None]
    on = options >= 0
    k = np.maximum(options, 0)
    rate = np.where(on, arrays.throughput[rows, k], 0.0)
    power = np.where(on, arrays.power_w[rows, k], 0.0)
    remaining = arrays.remaining
    current = np.array([j.current_gpus for j in problem.jobs], dtype=np.int64)
    prev = np.concatenate([current[:, None], counts[:, :-1]], axis=1)
    # A switch stall (a count change, or a resume after the job ran) starts the slot: the job
    # runs the rest of it.
    stall = np.zeros_like(rate)
    if problem.switch_stall_s > 0:
        started = np.array([j.started for j in problem.jobs], dtype=bool)
        ran_before = started[:, None] | (np.cumsum(on, axis=1) - on > 0)
        stall = np.where(on & (counts != prev) & ran_before, problem.switch_stall_s, 0.0)
    work = rate * (slot_s - stall)
    done_after = np.cumsum(work, axis=1)
    done_before = done_after - work
    # Finishing slot: the first slot run whose work covers what is left (1e-9 s tolerance).
    finishes = on & (remaining[:, None] - done_before <= work + rate * 1e-9)
    finished: np.ndarray = np.any(finishes, axis=1)
    t_fin = np.where(finished, finishes.argmax(axis=1), num_slots)
    slots = np.arange(num_slots)[None, :]
    before = slots < t_fin[:, None]
    fin_rows = np.flatnonzero(finished)
    finish_s = np.full(num_jobs, np.nan)
    finish_s[fin_rows] = (
        t_fin[fin_rows] * slot_s
        + stall[fin_rows, t_fin[fin_rows]]
        + (remaining[fin_rows] - done_before[fin_rows, t_fin[fin_rows]])
        / rate[fin_rows, t_fin[fin_rows]]
    )
    unfinished_area = np.where(before, 1.0 - done_after / remaining[:, None], 0.0).sum(axis=1)
    done = np.where(finished, remaining, done_after[:, -1])
    # Changes: against the count before (current_gpus for slot 0); a finished job handing its
    # GPUs back is not a hot switch.
    release = (counts == 0) & (slots > t_fin[:, None])
    changes = int(((counts != prev) & ~release).sum())
    allowed_ok = bool(np.all(on | (counts == 0)))
    used = np.where(on, counts, 0).sum(axis=0)
    slot_kwh_per_w = slot_s / SECONDS_PER_HOUR / WATTS_PER_KILOWATT * problem.pue
    energy = power.sum(axis=0) * slot_kwh_per_w
    emissions = power.sum(axis=0) * problem.slot_emissions_kg_per_w()
    leftover = np.maximum(0.0, 1.0 - done / remaining)
    tail = leftover * arrays.tail_slots
    weighted_s = float((arrays.priority * slot_s * (unfinished_area + tail)).sum())
    leftover_kg = float((leftover * arrays.tail_kg).sum())
    completion: dict[str, float | None] = {}
    met: dict[str, bool] = {}
    unfinished: dict[str, float] = {}
    misses = 0
    broken = 0  # misses of the promised deadline itself (past the margin too)
    margin_jobs = 0  # `problem.margin_jobs()`, counted in the loop below
    horizon_s = problem.horizon_s

    def meets(i: int, job: JobSpec, finish: float | None, deadline_s: float) -> bool:
        if finish is not None or deadline_s < horizon_s:
            return finish is not None and finish <= deadline_s + 1e-6
        # Past the horizon the job may run at full speed until its deadline (after a switch to
        # it, unless it runs at it in the last slot).
        after_s = deadline_s - horizon_s
        if rate[i, -1] != arrays.max_throughput[i] and (job.started or on[i].any()):
            after_s -= problem.switch_stall_s
        return bool(
            done[i] + arrays.max_throughput[i] * after_s >= job.remaining_samples * (1 - 1e-9)
        )

    # Deadline jobs met only by work after the horizon, by the deadline they are judged against
    # (seen, then promised): (deadline, GPU-seconds of that work, row).
    after_seen: list[AfterHorizonWork] = []
    after_promised: list[AfterHorizonWork] = []
    kept: dict[int, bool] = {}  # row -> promise kept (margin included)

    capacity = problem.capacity_gpus[-1]

    def after_need(i: int, job: JobSpec, deadline_s: float) -> AfterHorizonWork:
        return AfterHorizonWork(deadline_s, job, job.remaining_samples - float(done[i]), i)

    for i, job in enumerate(problem.jobs):
        finish = None if not finished[i] else float(finish_s[i])
        completion[job.job_id] = finish
        unfinished[job.job_id] = float(unfinished_area[i])
        if job.deadline_s is not None:
            ok = meets(i, job, finish, job.deadline_s)
            met[job.job_id] = ok
            margin_jobs += job.deadline_margin_s > 0
            promised_s = job.deadline_s + job.deadline_margin_s
            kept[i] = ok or (job.deadline_margin_s > 0 and meets(i, job, finish, promised_s))
            if finish is None and ok and job.deadline_s >= horizon_s:
                after_seen.append(after_need(i, job, job.deadline_s))
            if finish is None and kept[i] and promised_s >= horizon_s:
                after_promised.append(after_need(i, job, promised_s))
    # Each job alone may run at full speed after the horizon; together they may not: a plan that
    # leaves more work after it than the cluster's GPU-seconds up to the deadlines misses them
    # (issue 23: two long jobs each counting on the whole cluster after the horizon let every
    # tick give away the capacity one of them needed, and its promise broke). The work is
    # counted at its fewest GPU-seconds (`least_gpu_s`), then as whole counts that fit together
    # at every instant (`unschedulable_after_horizon`), so only a plan no preemptive schedule
    # after the horizon can mend misses: a stricter count (one count per job, as admission's
    # check) made plans give up on a promise it wrongly called lost, and then it was.
    for i in unschedulable_after_horizon(after_seen, capacity, horizon_s):
        met[problem.jobs[i].job_id] = False
    for i in unschedulable_after_horizon(after_promised, capacity, horizon_s):
        kept[i] = False
    for i, job in enumerate(problem.jobs):
        if job.deadline_s is not None and not met[job.job_id]:
            misses += 1
            broken += not kept[i]
    capacity_ok = bool(np.all(used <= np.asarray(problem.capacity_gpus)))
    budget_ok = True
    if problem.budget_mode is BudgetMode.HARD:
        for period, share in problem.period_slots():
            if float((emissions * share).sum()) > period.budget_left_kg * (1 + 1e-6) + 1e-9:
                budget_ok = False
    if problem.team_budgets and not within_team_budgets(problem, power):
        budget_ok = False
    miss_cost_s = problem.deadline_miss_cost_s()
    objective = (
        miss_cost_s * misses
        + miss_cost_s * margin_jobs * broken
        + weighted_s
        + problem.carbon_price_s_per_kg * (float(emissions.sum()) + leftover_kg)
        + problem.change_cost_s * changes
    )
    return PlanEvaluation(
        completion_s=completion,
        deadline_met=met,
        energy_kwh_per_slot=energy,
        emissions_kg_per_slot=emissions,
        gpu_changes=changes,
        objective=objective,
        capacity_ok=capacity_ok,
        allowed_ok=allowed_ok,
        budget_ok=budget_ok,
        unfinished_area=unfinished,
        done_samples={job.job_id: float(done[i]) for i, job in enumerate(problem.jobs)},
    )


def after_horizon_gpu_s(
    job: JobSpec, left_samples: float, last_gpus: int, window_s: float, problem: AllocationProblem
) -> float:
    """GPU-seconds a job's work left at the horizon needs at the count that alone finishes it in
    `window_s` with the fewest (a count other than the last slot's starts with a switch stall,
    counted in both: the GPUs are held through it); inf when no count fits the window."""
    if left_samples <= 0:
        return 0.0
    capacity = problem.capacity_gpus[-1]
    stall_s = problem.switch_stall_s
    options = [
        g * (left_samples / r + (0.0 if g == last_gpus else stall_s))
        for g, r in zip(job.allowed_gpus, job.throughput_samples_per_s, strict=True)
        if g <= capacity
        and r * (window_s - (0.0 if g == last_gpus else stall_s)) >= left_samples * (1 - 1e-9)
    ]
    return min(options, default=math.inf)


def least_gpu_s(job: JobSpec, left_samples: float, window_s: float, capacity_gpus: int) -> float:
    """Fewest GPU-seconds that do `left_samples` of a job's work within `window_s`, its counts
    mixed over time (two counts, or one and idle: the lower convex hull of GPUs over rate);
    inf when its fastest count cannot. No stalls: a bound no schedule beats."""
    if left_samples <= 0:
        return 0.0
    if window_s <= 0:
        return math.inf
    need_rate = left_samples / window_s
    points = [(0.0, 0.0)] + [
        (r, float(g))
        for g, r in zip(job.allowed_gpus, job.throughput_samples_per_s, strict=True)
        if g <= capacity_gpus
    ]
    best = math.inf
    for rate_a, gpus_a in points:
        if rate_a > need_rate * (1 + 1e-12):
            continue
        for rate_b, gpus_b in points:
            if rate_b < need_rate * (1 - 1e-12):
                continue
            if rate_b <= rate_a:
                gpus = gpus_b if rate_b == rate_a else math.inf
            else:
                gpus = gpus_a + (gpus_b - gpus_a) * (need_rate - rate_a) / (rate_b - rate_a)
            best = min(best, gpus * window_s)
    return best


@dataclass(frozen=True)
class AfterHorizonWork:
    """A deadline job's work left at the horizon: due `deadline_s` (from the problem's start)."""

    deadline_s: float
    job: JobSpec
    left_samples: float
    row: int


def overcommitted_after_horizon(
    work: Sequence[AfterHorizonWork], capacity_gpus: int, horizon_s: float
) -> list[int]:
    """Rows of `work` due at a deadline by which the GPU-seconds the work needs exceed the
    cluster's from the horizon on: the work due by then, and the part of each later job's that
    its fastest count cannot do between then and its own deadline, each at its fewest
    GPU-seconds (`least_gpu_s`). A necessary condition only (no stalls, work divisible)."""
    ordered = sorted(work, key=lambda w: (w.deadline_s, w.row))
    fastest = [max(w.job.throughput_samples_per_s) for w in ordered]
    own = [
        least_gpu_s(w.job, w.left_samples, w.deadline_s - horizon_s, capacity_gpus) for w in ordered
    ]
    crowded: list[int] = []
    due = 0.0
    for k, w in enumerate(ordered):
        due += own[k]
        window_s = w.deadline_s - horizon_s
        # A job due later that cannot finish after this deadline at full speed needs GPUs before.
        before = 0.0
        # (Jobs due at the same time count at their own turn, so only one of them is crowded.)
        for later, rate in zip(ordered[k + 1 :], fastest[k + 1 :], strict=True):
            rest = later.left_samples - rate * (later.deadline_s - w.deadline_s)
            if rest > 0 and later.deadline_s > w.deadline_s:
                before += least_gpu_s(later.job, rest, window_s, capacity_gpus)
        if due + before > capacity_gpus * window_s * (1 + 1e-9):
            crowded.append(w.row)
    return crowded


# Most GPU-count combinations (configurations) the exact after-horizon check enumerates; past it
# only the pooled GPU-second check runs (`unschedulable_after_horizon`).
MAX_AFTER_HORIZON_CONFIGS = 2_000


def unschedulable_after_horizon(
    work: Sequence[AfterHorizonWork], capacity_gpus: int, horizon_s: float
) -> list[int]:
    """Rows of `work` that no schedule after the horizon finishes by their deadlines together:
    those the pooled GPU-second check crowds (`overcommitted_after_horizon`), then, among the
    rest, those the configuration check (`_configuration_blame`) finds no room for.

    The pooled check lets a job's work run at its most GPU-efficient mix of counts at any time,
    so a later job "ran" on 4 GPUs beside an earlier one on all 16 (issue 23, cluster04[:20]:
    be631d51 needed 16 GPUs for 6,474 s, c9c620ea had to stop meanwhile, and their promises,
    which every plan's pooled check called kept, could no longer both be kept from t = 76,075 s).
    Here the jobs share the cluster in whole counts at every instant."""
    crowded = overcommitted_after_horizon(work, capacity_gpus, horizon_s)
    rest = [w for w in work if w.row not in set(crowded)]
    if len(rest) < 2:
        return crowded
    blamed = _configuration_blame(tuple(rest), capacity_gpus, horizon_s)
    return crowded + (blamed or [])


def _configuration_blame(
    work: tuple[AfterHorizonWork, ...], capacity_gpus: int, horizon_s: float
) -> list[int] | None:
    """Rows of `work` (earliest deadline first) that a time-sharing of whole-count
    configurations after the horizon cannot finish along with the ones due before them; None
    when the configurations are too many to enumerate (MAX_AFTER_HORIZON_CONFIGS)."""
    ordered = sorted(work, key=lambda w: (w.deadline_s, w.row))
    key = (
        capacity_gpus,
        horizon_s,
        tuple(
            (
                w.row,
                w.deadline_s,
                w.left_samples,
                w.job.allowed_gpus,
                w.job.throughput_samples_per_s,
            )
            for w in ordered
        ),
    )
    hit = _BLAME_CACHE.get(key)
    if hit is not None or key in _BLAME_CACHE:
        return None if hit is None else list(hit)
    fit = _configurations_fit(ordered, capacity_gpus, horizon_s)
    blamed: list[int] | None = None if fit is None else []
    if fit is False:
        blamed = []
        kept: list[AfterHorizonWork] = []
        for w in ordered:
            fits = _configurations_fit([*kept, w], capacity_gpus, horizon_s)
            if fits is None:
                blamed = None
                break
            if fits:
                kept.append(w)
            else:
                blamed.append(w.row)
    if len(_BLAME_CACHE) > 4_096:
        _BLAME_CACHE.clear()
    _BLAME_CACHE[key] = None if blamed is None else tuple(blamed)
    return blamed


_BLAME_CACHE: dict[tuple[object, ...], tuple[int, ...] | None] = {}


def _configurations_fit(
    ordered: Sequence[AfterHorizonWork], capacity_gpus: int, horizon_s: float
) -> bool | None:
    """Whether time-sharing whole-count configurations (each job at one of its counts or off,
    the counts together within `capacity_gpus`) between consecutive deadlines after the horizon
    does every job's work by its deadline (an LP over the configurations' durations, exact for
    preemptive schedules without stalls); None: too many configurations."""
    from scipy.optimize import linprog  # imported where the check bites, not at every import

    bounds = sorted({w.deadline_s for w in ordered})
    starts = [horizon_s, *bounds[:-1]]
    options = [
        [
            (g, r)
            for g, r in zip(w.job.allowed_gpus, w.job.throughput_samples_per_s, strict=True)
            if g <= capacity_gpus
        ]
        for w in ordered
    ]
    columns: list[tuple[int, dict[int, float]]] = []  # (segment, job index -> rate)
    for s, (begin, end) in enumerate(zip(starts, bounds, strict=True)):
        if end <= begin:
            continue
        active = [k for k, w in enumerate(ordered) if w.deadline_s >= end]
        configs = _maximal_configurations([options[k] for k in active], capacity_gpus)
        if configs is None or len(columns) + len(configs) > MAX_AFTER_HORIZON_CONFIGS:
            return None
        columns.extend((s, {active[n]: rate for n, rate in config}) for config in configs)
    if not columns:
        return all(w.left_samples <= 0 for w in ordered)
    lengths = [end - begin for begin, end in zip(starts, bounds, strict=True)]
    scale_s = max(lengths)
    # Durations in units of the longest segment; each job's work as a fraction of what it has left.
    a_ub = np.zeros((len(lengths) + len(ordered), len(columns)))
    b_ub = np.zeros(len(lengths) + len(ordered))
    for c, (s, rates) in enumerate(columns):
        a_ub[s, c] = 1.0
        for k, rate in rates.items():
            a_ub[len(lengths) + k, c] = -rate * scale_s / max(ordered[k].left_samples, 1e-12)
    b_ub[: len(lengths)] = [max(0.0, length) / scale_s for length in lengths]
    b_ub[len(lengths) :] = [-(1 - 1e-9) if w.left_samples > 0 else 0.0 for w in ordered]
    result = linprog(np.zeros(len(columns)), A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
    return bool(result.status == 0)


def _maximal_configurations(
    options: Sequence[Sequence[tuple[int, float]]], capacity_gpus: int
) -> list[list[tuple[int, float]]] | None:
    """Per combination of one count per job (or off) within `capacity_gpus` that no job can
    raise to a faster count of its own without exceeding it: (job index, rate) per job on;
    None past MAX_AFTER_HORIZON_CONFIGS combinations (or 20 times as many partial ones)."""
    if math.prod(len(o) + 1 for o in options) > 20 * MAX_AFTER_HORIZON_CONFIGS:
        return None  # many jobs past the horizon: not worth a search that would give up
    out: list[list[tuple[int, float]]] = []
    budget = [20 * MAX_AFTER_HORIZON_CONFIGS]  # partial combinations the search may still try

    def extend(k: int, free: int, chosen: list[tuple[int, int, float]]) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or len(out) > MAX_AFTER_HORIZON_CONFIGS:
            return False
        if k == len(options):
            # Maximal: no job's next faster count fits in what is left.
            for n, gpus, _ in chosen:
                faster = [g for g, _r in options[n] if g > gpus]
                if faster and min(faster) - gpus <= free:
                    return True
            out.append([(n, rate) for n, _g, rate in chosen if rate > 0])
            return True
        if not extend(k + 1, free, [*chosen, (k, 0, 0.0)]):
            return False
        return all(
            extend(k + 1, free - gpus, [*chosen, (k, gpus, rate)])
            for gpus, rate in options[k]
            if gpus <= free
        )

    return out if extend(0, capacity_gpus, []) else None


def crowded_after_horizon(
    needs: Sequence[tuple[float, float, K]], capacity_gpus: int, horizon_s: float
) -> list[K]:
    """Keys of `needs` ((deadline s, GPU-seconds after the horizon, key)) whose work, with that
    of the ones due before them, exceeds the cluster's GPU-seconds from the horizon to their
    deadline (earliest deadline first)."""
    crowded: list[K] = []
    total = 0.0
    for deadline_s, gpu_s, key in sorted(needs, key=lambda need: need[:2]):
        total += gpu_s
        if total > capacity_gpus * (deadline_s - horizon_s) * (1 + 1e-9):
            crowded.append(key)
    return crowded


def _team_members(problem: AllocationProblem, team: TeamBudget) -> np.ndarray:
    return np.array([job.job_id in team.job_ids for job in problem.jobs], dtype=bool)


def within_team_budgets(problem: AllocationProblem, power_w: np.ndarray) -> bool:
    """Whether the jobs x slots power of a plan keeps every team's hard budget."""
    kg_per_w = problem.slot_emissions_kg_per_w()
    for team in problem.team_budgets:
        team_kg = power_w[_team_members(problem, team)].sum(axis=0) * kg_per_w
        for period, share in problem.period_slots(team.periods):
            if float((team_kg * share).sum()) > period.budget_left_kg * (1 + 1e-6) + 1e-9:
                return False
    return True


def cut_to_team_budgets(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """`gpus` with each team's jobs cut back until the team's hard budgets hold.

    Per team and period over its budget: from the period's last planned slot backwards, the
    team's lowest-priority job steps down one allowed count (or to 0) at a time, so what runs
    soonest is kept and the next plan re-decides the rest. The team's jobs without a promised
    deadline (none, or best-effort) are cut first, over all slots, and its deadline jobs only if
    that is not enough: admission promised those on the budget the team's other deadline jobs
    leave (`allocation.admission.admit_on_spare`). Only that team's jobs lose GPUs; the GPUs
    freed are not handed to other jobs in this plan.
    """
    if not problem.team_budgets:
        return gpus
    kg_per_w = problem.slot_emissions_kg_per_w()
    counts = {job_id: list(row) for job_id, row in gpus.items()}
    jobs = {job.job_id: job for job in problem.jobs}

    def power_w(job: JobSpec, count: int) -> float:
        return 0.0 if count == 0 else job.power_w[job.allowed_gpus.index(count)]

    for team in problem.team_budgets:
        members = sorted(
            (jobs[j] for j in team.job_ids if j in jobs), key=lambda j: (j.priority, j.job_id)
        )
        promised = [j for j in members if j.deadline_s is not None and not j.best_effort]
        groups = ([j for j in members if j not in promised], promised)
        for period, share in problem.period_slots(team.periods):
            spent_kg = sum(
                power_w(job, counts[job.job_id][t]) * kg_per_w[t] * share[t]
                for job in members
                for t in range(problem.num_slots)
            )
            over_kg = spent_kg - period.budget_left_kg
            for group in groups:
                for t in reversed(range(problem.num_slots)):
                    if over_kg <= 1e-12:
                        break
                    if share[t] <= 0:
                        continue
                    for job in group:
                        row = counts[job.job_id]
                        while over_kg > 1e-12 and row[t] > 0:
                            k = job.allowed_gpus.index(row[t])
                            lower = job.allowed_gpus[k - 1] if k > 0 else 0
                            over_kg -= (
                                (power_w(job, row[t]) - power_w(job, lower))
                                * kg_per_w[t]
                                * share[t]
                            )
                            row[t] = lower
    return {job_id: tuple(row) for job_id, row in counts.items()}


def plan_objective(problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]) -> float:
    """The objective all policies are compared on (lower is better); see docs/allocation.md."""
    return evaluate_gpus(problem, gpus).objective


def relative_gap(problem: AllocationProblem, objective: float, bound: float) -> float:
    """The optimality gap of a plan: (objective - bound) / (bound - certain misses' cost).

    The one definition (plans, benchmarks and docs use it). Deadlines no plan can meet cost the
    same in every plan and in the bound (the models fix their miss variables to 1), so their cost
    is left out of the denominator; avoidable misses stay in both sides, so a plan that drops
    deadlines the bound keeps has a large gap, never a small one.
    """
    base = bound - problem.certain_miss_cost_s()
    # The bound counts each miss once; a promise no plan keeps costs every plan more.
    bound += problem.certain_break_cost_s()
    return max(0.0, objective - bound) / max(abs(base), 1e-9)


def missed_reason(problem: AllocationProblem, job: JobSpec) -> str:
    """Why a job's deadline is missed, without a plan: impossible alone, or contention."""
    assert job.deadline_s is not None
    if job.deadline_s <= 0:
        return "deadline already passed"
    if problem.deadline_impossible(job):
        alone_s = job.remaining_samples / problem.usable_max_rate(job)
        return (
            f"needs {alone_s:.0f} s at its fastest allowed count ({max(job.allowed_gpus)} GPUs) "
            f"but only {job.deadline_s:.0f} s are left"
        )
    if problem.budget_mode is BudgetMode.HARD and problem.budget_periods:
        return "capacity or carbon budget is taken by other jobs' deadlines or exhausted"
    return "capacity is taken by other jobs' deadlines"


def _slot_ranges(slots: np.ndarray) -> str:
    """Slot indices as ranges, e.g. "0-3, 7"."""
    out: list[str] = []
    for t in slots.tolist():
        if out and out[-1].split("-")[-1] == str(t - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{t}"
        else:
            out.append(str(t))
    return ", ".join(out)


# Missed deadlines whose holders are counted together (one matrix product per chunk).
_REASONS_CHUNK = 256


def missed_reasons(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]], ev: PlanEvaluation
) -> dict[str, str]:
    """Why each deadline the plan misses is missed: which jobs hold the capacity before it, which
    budget periods are spent, and whether the deadlines due by then overload the cluster.

    Overload is a GPU-hour count: every deadline job due by this deadline at its most
    GPU-efficient count, against the capacity before the deadline. Above it no plan meets them
    all; below it the plan dropped the deadline by choice (whole-slot booking, allowed counts,
    or the heuristic's pick). Vectorised over the missed jobs (numpy, holders by one matrix
    product per chunk of them): thousands of misses take well under a second.
    """
    missed = [
        i
        for i, j in enumerate(problem.jobs)
        if j.deadline_s is not None and not ev.deadline_met[j.job_id]
    ]
    if not missed:
        return {}
    out: dict[str, str] = {}
    rest = []
    for i in missed:
        job = problem.jobs[i]
        assert job.deadline_s is not None
        if job.deadline_s <= 0 or problem.deadline_impossible(job):
            out[job.job_id] = missed_reason(problem, job)
        else:
            rest.append(i)
    if not rest:
        return out
    arrays = plan_arrays(problem)
    options, counts = option_matrix(problem, gpus, arrays)
    used = counts.sum(axis=0)
    capacity = np.asarray(problem.capacity_gpus)
    deadline = np.array([np.inf if j.deadline_s is None else j.deadline_s for j in problem.jobs])
    slot_start = np.arange(problem.num_slots) * problem.slot_s
    idx = np.asarray(rest)
    before = np.clip((deadline[idx, None] - slot_start[None, :]) / problem.slot_s, 0.0, 1.0)
    window = before > 0
    # Slots before the deadline without room for the job's next count up.
    own = counts[idx]
    allowed = arrays.gpus[idx]  # every allowed count; padding is 0
    above = (allowed[:, :, None] > own[:, None, :]) & (allowed[:, :, None] > 0)
    step = np.where(above, allowed[:, :, None], np.iinfo(np.int64).max).min(axis=1)
    full = window & (capacity[None, :] - used[None, :] + own < step)
    # Least GPU-seconds each job's remaining work needs (at its most GPU-efficient count); the
    # GPU-hours due by each deadline by a cumulative sum over deadlines in order.
    gpu_s_per_sample = np.where(
        arrays.valid, arrays.gpus / np.maximum(arrays.throughput, 1e-12), np.inf
    )
    least_gpu_s = arrays.remaining * gpu_s_per_sample.min(axis=1)
    with_deadline = np.flatnonzero((deadline > 0) & np.isfinite(deadline))
    order = with_deadline[np.argsort(deadline[with_deadline], kind="stable")]
    due_count = np.searchsorted(deadline[order], deadline[idx], side="right")
    due_gpu_s = np.concatenate([[0.0], np.cumsum(least_gpu_s[order])])[due_count]
    need_h = due_gpu_s / SECONDS_PER_HOUR
    have_h = (before @ capacity) * problem.slot_s / SECONDS_PER_HOUR
    budget = _budget_reasons(problem, arrays, options, ev, idx, window)
    holders = _holders(problem, counts, full, idx, deadline)
    for r, i in enumerate(rest):
        parts = []
        if holders[r]:
            parts.append(
                f"capacity in slots {_slot_ranges(np.flatnonzero(full[r]))} is held by {holders[r]}"
            )
        budget_binds, room_kg, least_kg = budget[r]
        if budget_binds:
            parts.append(
                f"the carbon budget left before it ({room_kg:.3g} kg after the other jobs) "
                f"cannot pay for its work ({least_kg:.3g} kg at best)"
            )
        if need_h[r] > have_h[r]:
            parts.append(
                f"overload: the {int(due_count[r])} deadlines due by then need "
                f"{need_h[r]:.1f} GPU-h, the cluster has {have_h[r]:.1f} GPU-h before it"
            )
        else:
            why = (
                "the budget binds"
                if budget_binds
                else "dropped by the plan's choice (whole-slot booking, allowed counts, heuristic)"
            )
            parts.append(
                f"no GPU-hour overload ({need_h[r]:.1f} of {have_h[r]:.1f} GPU-h due): {why}"
            )
        out[problem.jobs[i].job_id] = "; ".join(parts)
    # In the problem's job order, as the plan lists its jobs.
    return {problem.jobs[i].job_id: out[problem.jobs[i].job_id] for i in missed}


def _holders(
    problem: AllocationProblem,
    counts: np.ndarray,
    full: np.ndarray,
    idx: np.ndarray,
    deadline: np.ndarray,
) -> list[str]:
    """Per missed job (rows of `full`), the jobs holding most GPUs in its full slots ("" none)."""
    out = [""] * len(idx)
    rows = np.flatnonzero(full.any(axis=1))
    weights = counts.astype(np.float64)
    for begin in range(0, len(rows), _REASONS_CHUNK):
        chunk = rows[begin : begin + _REASONS_CHUNK]
        # GPU-slots each job holds in each missed job's full slots: jobs x chunk.
        held = weights @ full[chunk].T.astype(np.float64)
        held[idx[chunk], np.arange(len(chunk))] = 0.0
        holding = (held > 0).sum(axis=0)
        for c, r in enumerate(chunk):
            column = held[:, c]
            top = _top_three(column)
            names = []
            for k in top:
                name = problem.jobs[k].job_id
                names.append(
                    f"{name} (earlier deadline)" if deadline[k] <= deadline[idx[r]] else name
                )
            more = int(holding[c]) - len(top)
            out[r] = ", ".join(names) + (f" and {more} more" if more > 0 else "")
    return out


def _top_three(column: np.ndarray) -> list[int]:
    """Indices of the three largest positive values, largest first, ties by index."""
    positive = np.flatnonzero(column > 0)
    if len(positive) > 3:
        third = np.partition(column[positive], -3)[-3]
        positive = positive[column[positive] >= third]
    ranked = positive[np.lexsort((positive, -column[positive]))]
    return [int(k) for k in ranked[:3]]


def _budget_reasons(
    problem: AllocationProblem,
    arrays: PlanArrays,
    options: np.ndarray,
    ev: PlanEvaluation,
    idx: np.ndarray,
    window: np.ndarray,
) -> list[tuple[bool, float, float]]:
    """Per missed job: (the budget binds, kg the other jobs leave before it, least kg it needs).

    The budget binds when what the other jobs leave in the periods before the deadline cannot
    pay for this job's work even at its most efficient count in the cleanest slot.
    """
    periods = problem.period_slots() if problem.budget_mode is BudgetMode.HARD else []
    if not periods:
        return [(False, 0.0, 0.0)] * len(idx)
    kg_per_w = problem.slot_emissions_kg_per_w()
    rows = idx[:, None]
    job_kg = (
        np.where(options[idx] >= 0, arrays.power_w[rows, np.maximum(options[idx], 0)], 0.0)
        * kg_per_w
    )
    shares = np.array([share for _, share in periods])  # periods x slots
    left = np.array([period.budget_left_kg for period, _ in periods])
    emissions = np.asarray(ev.emissions_kg_per_slot)
    others = (emissions @ shares.T)[None, :] - job_kg @ shares.T  # missed x periods
    touched = (window.astype(np.float64) @ shares.T) > 0
    room_kg = np.where(touched, np.maximum(0.0, left[None, :] - others), 0.0).sum(axis=1)
    # Least kg each job's remaining work needs: its fewest joules per sample, cleanest slot.
    joules = np.where(arrays.valid, arrays.power_w / np.maximum(arrays.throughput, 1e-12), np.inf)
    least_kwh = (
        arrays.remaining[idx] * joules[idx].min(axis=1) / SECONDS_PER_HOUR / WATTS_PER_KILOWATT
    )
    intensity = np.asarray(problem.intensity_g_per_kwh)
    cleanest = np.where(window, intensity[None, :], np.inf).min(axis=1)
    least_kg = least_kwh * problem.pue * cleanest / GRAMS_PER_KG
    return [
        (bool(need > room), float(room), float(need))
        for need, room in zip(least_kg, room_kg, strict=True)
    ]


def make_plan(
    problem: AllocationProblem,
    gpus: dict[str, tuple[int, ...]],
    *,
    status: str,
    policy: str,
    solve_s: float,
    bound: float | None = None,
    notes: tuple[str, ...] = (),
    evaluation: PlanEvaluation | None = None,
    gpu_price_per_slot: tuple[float, ...] = (),
    step: str = "",
    team_cut: dict[str, str] | None = None,
) -> AllocationPlan:
    """Wrap a GPU matrix into an AllocationPlan with all projected figures filled in.

    `evaluation`: `evaluate_gpus(problem, gpus)` when the caller already has it. Teams' hard
    budgets cut the matrix first (`cut_to_team_budgets`), whichever policy made it.
    """
    team_cut = dict(team_cut or {})
    if problem.team_budgets:
        cut = cut_to_team_budgets(problem, gpus)
        if cut != {k: tuple(v) for k, v in gpus.items()}:
            team_cut.update(
                (job_id, team.team)
                for team in problem.team_budgets
                for job_id in team.job_ids
                if job_id in cut and cut[job_id] != tuple(gpus[job_id])
            )
            gpus, evaluation = cut, None
            notes = (*notes, "cut to the teams' hard budgets")
    ev = evaluate_gpus(problem, gpus) if evaluation is None else evaluation
    gap = None if bound is None else relative_gap(problem, ev.objective, bound)
    reasons = missed_reasons(problem, gpus, ev)
    return AllocationPlan(
        start_at=problem.start_at,
        slot_s=problem.slot_s,
        gpus={j.job_id: tuple(map(int, gpus[j.job_id])) for j in problem.jobs},
        completion_s=ev.completion_s,
        energy_kwh_per_slot=tuple(float(x) for x in ev.energy_kwh_per_slot),
        emissions_kg_per_slot=tuple(float(x) for x in ev.emissions_kg_per_slot),
        deadline_met=ev.deadline_met,
        missed_reasons=reasons,
        gpu_changes=ev.gpu_changes,
        objective=ev.objective,
        status=status,
        gap=gap,
        bound=bound,
        solve_s=solve_s,
        policy=policy,
        notes=notes,
        gpu_price_per_slot=gpu_price_per_slot,
        step=step,
        team_cut=team_cut,
    )


def finish_slot(finish_s: float, slot_s: float) -> int:
    """Index of the slot a job finishing at `finish_s` is busy in last (a finish on a slot
    boundary belongs to the slot before it)."""
    last = int(finish_s // slot_s)
    if finish_s > 0 and finish_s % slot_s == 0:
        last -= 1
    return last


def runs_after_finish(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]], ev: PlanEvaluation
) -> bool:
    """Whether any job keeps GPUs in a slot after the one it finishes in."""
    for job in problem.jobs:
        finish = ev.completion_s[job.job_id]
        if finish is not None and any(gpus[job.job_id][finish_slot(finish, problem.slot_s) + 1 :]):
            return True
    return False


def trim_after_finish(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Release GPUs in slots after each job's projected finish (never worse on the objective)."""
    ev = evaluate_gpus(problem, gpus)
    out = {}
    for job in problem.jobs:
        counts = list(gpus[job.job_id])
        finish = ev.completion_s[job.job_id]
        if finish is not None:
            for t in range(finish_slot(finish, problem.slot_s) + 1, len(counts)):
                counts[t] = 0
        out[job.job_id] = tuple(counts)
    return out


def gpus_from_options(
    problem: AllocationProblem, arrays: PlanArrays, options: np.ndarray
) -> dict[str, tuple[int, ...]]:
    """Option indices per job and slot (-1 = off) to GPU counts per job."""
    rows = np.arange(arrays.num_jobs)[:, None]
    counts = np.where(options >= 0, arrays.gpus[rows, np.maximum(options, 0)], 0)
    return dict(zip((j.job_id for j in problem.jobs), map(tuple, counts.tolist()), strict=True))
