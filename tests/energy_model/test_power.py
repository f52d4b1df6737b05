"""GPU power specs and job_power_w."""

from __future__ import annotations

import pytest

from energy_model.power import A100_POWER, V100_POWER, GpuPowerSpec, job_power_w, utilisation


def test_one_gpu_fully_busy_draws_busy_power() -> None:
    assert job_power_w(1, 500.0, 500.0) == pytest.approx(A100_POWER.busy_w)
    assert job_power_w(1, 500.0, 500.0, V100_POWER) == pytest.approx(V100_POWER.busy_w)


def test_idle_gpus_draw_idle_power() -> None:
    assert job_power_w(8, 0.0, 500.0) == pytest.approx(8 * A100_POWER.idle_w)


def test_badly_scaling_counts_cost_energy_for_nothing() -> None:
    # Same total throughput on more GPUs: more power, so more energy per sample.
    powers = [job_power_w(g, 1000.0, 600.0) for g in (2, 4, 8, 16)]
    assert powers == sorted(powers)
    assert powers[-1] > 2 * powers[0]


def test_perfect_scaling_costs_no_extra_energy_per_sample() -> None:
    single = 400.0
    per_sample = [job_power_w(g, g * single, single) / (g * single) for g in (1, 2, 4)]
    assert per_sample == pytest.approx([per_sample[0]] * 3)


def test_busy_override_is_capped_by_board_limit() -> None:
    assert job_power_w(1, 1.0, 1.0, busy_w=10_000.0) == pytest.approx(A100_POWER.max_w)


def test_validation() -> None:
    with pytest.raises(ValueError, match="gpus"):
        utilisation(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="single_gpu"):
        utilisation(1, 1.0, 0.0)
    with pytest.raises(ValueError, match="idle_w"):
        GpuPowerSpec("bad", idle_w=300.0, max_w=250.0, busy_w=200.0, exponent=1.0)
