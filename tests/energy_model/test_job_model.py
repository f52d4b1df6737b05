"""JobModel priors and the online fitter."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from energy_model.fit import PowerParams, ThroughputParams
from energy_model.job_model import (
    JobModel,
    JobModelFitter,
    TelemetryPoint,
    known_presets,
    prior_job_model,
    resolve_workload,
)

T0 = datetime(2024, 5, 1, tzinfo=UTC)
COUNTS = (1, 2, 4, 8, 16, 32)
PRESETS = ("gpt2", "bert", "resnet50", "vgg16", "inception3", "deepspeech2")


def synthetic_points(
    truth: ThroughputParams,
    power: PowerParams,
    batch: int,
    counts: tuple[int, ...],
    n: int,
    noise: float = 0.02,
    seed: int = 0,
    start: datetime = T0,
) -> list[TelemetryPoint]:
    rng = random.Random(seed)
    single = truth.samples_per_s(1, batch)
    out = []
    for i in range(n):
        g = counts[i % len(counts)]
        sps = truth.samples_per_s(g, batch)
        watts = g * power.per_gpu_w(sps / (g * single))
        out.append(
            TelemetryPoint(
                gpus=g,
                samples_per_s=sps * math.exp(rng.gauss(0, noise)),
                power_w=watts * math.exp(rng.gauss(0, noise)),
                at=start + timedelta(seconds=30 * i),
            )
        )
    return out


@pytest.mark.parametrize("workload", PRESETS)
def test_priors_exist_and_diminish(workload: str) -> None:
    model = prior_job_model(workload, 128, COUNTS)
    assert model.workload == workload and model.source == "prior"
    tput = [model.throughput_samples_per_s[g] for g in COUNTS]
    assert tput[1] > tput[0]
    # Diminishing returns: speed-up per doubling shrinks.
    ratios = [b / a for a, b in itertools.pairwise(tput)]
    assert ratios[-1] < ratios[0]
    # Energy per sample grows with GPU count (idle + communication overhead).
    assert model.energy_per_sample_j(32) > model.energy_per_sample_j(1)
    assert all(0 < model.throughput_rel_std[g] < 0.2 for g in COUNTS)


def test_generic_fallback_for_entrypoints() -> None:
    model = prior_job_model("mypkg.train:main", 64, [1, 2, 4])
    assert model.workload == "generic"
    assert model.throughput_rel_std[1] >= 0.4  # a guess, and it says so
    assert resolve_workload("ResNet-50") == "resnet50"
    assert set(PRESETS) <= set(known_presets())


def test_jobmodel_validates_tables() -> None:
    with pytest.raises(ValueError, match="lacks GPU counts"):
        JobModel((1, 2), {1: 1.0}, {1: 1.0, 2: 2.0}, {1: 0.1, 2: 0.1}, {1: 0.1, 2: 0.1})


def test_fitter_recovers_known_model() -> None:
    truth = ThroughputParams(3e-3, 2e-2, 4e-2, 5e-3)
    power = PowerParams(60.0, 250.0, 0.8)
    batch = 256
    prior = prior_job_model("resnet50", batch, COUNTS)
    fitter = JobModelFitter(prior)
    model = fitter.update(synthetic_points(truth, power, batch, (1, 2, 4, 8, 16), 100))
    for g in COUNTS:
        assert model.throughput_samples_per_s[g] == pytest.approx(
            truth.samples_per_s(g, batch), rel=0.04
        )
    assert model.params is not None
    assert model.params.power.idle_w == pytest.approx(60.0, rel=0.15)
    assert model.params.power.dynamic_w == pytest.approx(250.0, rel=0.1)
    assert model.params.power.exponent == pytest.approx(0.8, rel=0.15)
    single = truth.samples_per_s(1, batch)
    for g in COUNTS:
        expected_w = g * power.per_gpu_w(truth.samples_per_s(g, batch) / (g * single))
        assert model.power_w[g] == pytest.approx(expected_w, rel=0.05)
    assert model.source == "fitted" and model.samples_used == 100


def test_prior_yields_to_data() -> None:
    batch = 128
    prior = prior_job_model("gpt2", batch, COUNTS)
    # The real job is 3x slower than the preset says and scales worse.
    truth = ThroughputParams(3e-3, 5e-2, 0.1, 2e-2)
    power = PowerParams(54.0, 200.0, 0.9)
    errors = []
    fitter = JobModelFitter(prior)
    for n in (0, 2, 8, 40):
        model = (
            prior if n == 0 else fitter.update(synthetic_points(truth, power, batch, (2, 4, 8), n))
        )
        err = abs(model.throughput_samples_per_s[4] / truth.samples_per_s(4, batch) - 1)
        errors.append(err)
        fitter = JobModelFitter(prior)
    assert errors[0] > 0.5
    assert errors[-1] < 0.05
    assert errors == sorted(errors, reverse=True)


def test_uncertainty_shrinks_where_measured() -> None:
    batch = 128
    prior = prior_job_model("mystery:main", batch, COUNTS)
    truth = ThroughputParams(2e-3, 1e-2, 2e-2, 3e-3)
    model = JobModelFitter(prior).update(
        synthetic_points(truth, PowerParams(54, 250, 0.9), batch, (4, 8), 30)
    )
    assert model.throughput_rel_std[4] < prior.throughput_rel_std[4]
    # Far from the measured counts the model is less sure than at them.
    assert model.throughput_rel_std[32] > model.throughput_rel_std[8]


def test_recent_samples_weigh_more() -> None:
    batch = 128
    prior = prior_job_model("bert", batch, COUNTS)
    power = PowerParams(54, 250, 0.9)
    old = ThroughputParams(2e-3, 1e-2, 2e-2, 3e-3)
    new = ThroughputParams(4e-3, 2e-2, 4e-2, 6e-3)  # the job became 2x slower
    fitter = JobModelFitter(prior, half_life_s=600)
    fitter.update(synthetic_points(old, power, batch, (2, 4), 40, noise=0.0))
    later = T0 + timedelta(hours=2)
    model = fitter.update(synthetic_points(new, power, batch, (2, 4), 10, noise=0.0, start=later))
    assert model.throughput_samples_per_s[4] == pytest.approx(new.samples_per_s(4, batch), rel=0.05)


def test_telemetry_without_power_keeps_power_prior() -> None:
    prior = prior_job_model("resnet50", 128, COUNTS)
    point = TelemetryPoint(gpus=4, samples_per_s=1500.0, power_w=None, at=T0)
    model = JobModelFitter(prior).update([point])
    assert model.params is not None and prior.params is not None
    assert model.params.power == prior.params.power
    assert model.power_rel_std == prior.power_rel_std


def test_estimated_power_never_trains_the_power_model() -> None:
    """Power the scheduler estimated from the model itself is not evidence: only measured
    samples fit the power model, and the fit says how many it used."""
    prior = prior_job_model("resnet50", 128, COUNTS)
    assert prior.params is not None
    truth = prior.params.throughput
    measured = synthetic_points(truth, PowerParams(60.0, 250.0, 0.8), 128, (2, 4), 6, noise=0.0)
    # Estimated readings far off the truth: were they used, the fitted idle power would move.
    estimated = [
        TelemetryPoint(p.gpus, p.samples_per_s, 10.0 * p.gpus, p.at, power_source="estimated")
        for p in synthetic_points(
            truth,
            PowerParams(60.0, 250.0, 0.8),
            128,
            (8,),
            30,
            noise=0.0,
            start=T0 - timedelta(hours=1),
        )
    ]
    only_measured = JobModelFitter(prior).update(measured)
    both = JobModelFitter(prior).update([*measured, *estimated])
    assert only_measured.power_samples_used == len(measured)
    assert both.power_samples_used == len(measured)
    assert both.samples_used == len(measured) + len(estimated)
    assert both.params is not None and only_measured.params is not None
    assert both.params.power.idle_w == pytest.approx(only_measured.params.power.idle_w, rel=0.02)
    assert both.power_w[8] == pytest.approx(only_measured.power_w[8], rel=0.02)
    # The same readings labelled as measured would drag the model far down (the check has teeth).
    trusted = [replace(p, power_source="nvml") for p in estimated]
    dragged = JobModelFitter(prior).update([*measured, *trusted])
    assert dragged.power_w[8] < 0.7 * only_measured.power_w[8]
    # Estimated samples alone leave the power prior untouched and report zero measured samples.
    alone = JobModelFitter(prior).update(estimated)
    assert alone.power_samples_used == 0
    assert alone.params is not None and alone.params.power == prior.params.power


def test_rejects_bad_telemetry() -> None:
    fitter = JobModelFitter(prior_job_model("bert", 64, COUNTS))
    with pytest.raises(ValueError, match="timezone-aware"):
        fitter.update([TelemetryPoint(2, 10.0, 100.0, datetime(2024, 1, 1))])
    with pytest.raises(ValueError, match="gpus > 0"):
        fitter.update([TelemetryPoint(0, 10.0, 100.0, T0)])
    # A stalled interval is skipped, not fitted (and not an error).
    model = fitter.update([TelemetryPoint(2, 0.0, 100.0, T0)])
    assert fitter.skipped == 1 and model.source == "prior"


def test_committed_priors_match_the_data(shared_data: Path) -> None:
    from energy_model import priors_build

    committed = (Path(priors_build.__file__).parent / "priors_data.py").read_text()
    assert priors_build.build(shared_data) == committed


def test_prior_reproduces_measured_profile(shared_data: Path) -> None:
    from energy_model.profiles import load_scaling_profiles

    profiles = load_scaling_profiles(shared_data / "elasticflow" / "throughputs_A100")
    for name in PRESETS:
        profile = profiles[name]
        batch = profile.batch_sizes()[0]
        measured = profile.samples_per_s(batch)
        model = prior_job_model(name, batch, sorted(measured))
        for g, sps in measured.items():
            assert model.throughput_samples_per_s[g] == pytest.approx(sps, rel=0.15)


def test_layouts_get_their_own_speed_factor() -> None:
    batch = 128
    prior = prior_job_model("gpt2", batch, COUNTS)
    truth = ThroughputParams(2e-3, 1e-2, 2e-2, 3e-3)
    power = PowerParams(54, 250, 0.9)
    data = synthetic_points(truth, power, batch, (1, 2, 4, 8), 40, noise=0.01)
    data = [replace(p, layout=f"dp{p.gpus}") for p in data]
    # The same 4 GPUs as dp2-tp2 run 20 % slower than dp4; the latest samples use it.
    slow_start = T0 + timedelta(hours=1)
    slow = [
        TelemetryPoint(
            4,
            0.8 * truth.samples_per_s(4, batch),
            None,
            slow_start + timedelta(seconds=30 * i),
            layout="dp2-tp2",
        )
        for i in range(6)
    ]
    model = JobModelFitter(prior).update(data + slow)
    assert model.layout_at[4] == "dp2-tp2" and model.layout_at[8] == "dp8"
    assert model.layout_speed_factor["dp2-tp2"] / model.layout_speed_factor["dp4"] == (
        pytest.approx(0.8, rel=0.05)
    )
    assert model.throughput_samples_per_s[4] == pytest.approx(
        0.8 * truth.samples_per_s(4, batch), rel=0.05
    )
    assert model.throughput_samples_per_s[8] == pytest.approx(
        truth.samples_per_s(8, batch), rel=0.05
    )


def test_a_refit_started_from_the_last_fit_finds_the_fit_of_all_its_samples() -> None:
    # Each refit starts its search where the last one ended (fewer steps); it must land where a
    # fit of the same samples from the prior does, layouts switching included.
    batch = 128
    prior = prior_job_model("gpt2", batch, COUNTS)
    truth = ThroughputParams(2e-3, 1e-2, 2e-2, 3e-3)
    data = synthetic_points(truth, PowerParams(54, 250, 0.9), batch, (1, 2, 4, 8), 60)
    data = [
        replace(p, layout="dp2-tp2" if i % 5 == 0 else f"dp{p.gpus}") for i, p in enumerate(data)
    ]
    online = JobModelFitter(prior)
    for i in range(0, len(data), 6):
        online.update(data[i : i + 6])
    once = JobModelFitter(prior).update(data)
    model = online.model
    for g in COUNTS:
        assert model.throughput_samples_per_s[g] == pytest.approx(
            once.throughput_samples_per_s[g], rel=1e-5
        )
        assert model.power_w[g] == pytest.approx(once.power_w[g], rel=1e-5)
    assert model.layout_speed_factor == pytest.approx(once.layout_speed_factor, rel=1e-5)
