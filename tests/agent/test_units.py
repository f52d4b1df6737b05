"""Pure parts of the agent: workload -> JobSpec mapping, power estimate, telemetry outbox."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_agent.protocol import WORKLOAD_PRESETS, TelemetrySample, WorkloadSpec
from worker_agent.runtime.layout import valid_layouts
from worker_agent.runtime.presets import build_job, model_shape
from worker_agent.telemetry import (
    DEFAULT_SLOT_POWER_W,
    IDLE_SHARE,
    NvmlUnavailable,
    Outbox,
    energy_kwh,
    estimated_power_w,
    model_power_w,
    nvml_indices,
    visible_devices,
)
from worker_agent.workloads import (
    WorkloadError,
    job_spec_for,
    micro_batch_size,
    total_steps,
)


@settings(max_examples=200, deadline=None)
@given(gbs=st.integers(1, 4096), max_gpus=st.integers(1, 16))
def test_micro_batch_divides_every_replica_batch(gbs: int, max_gpus: int) -> None:
    mbs = micro_batch_size(gbs, max_gpus)
    assert 1 <= mbs <= 16
    for dp in range(1, max_gpus + 1):
        if gbs % dp == 0:
            assert (gbs // dp) % mbs == 0


def test_micro_batch_examples() -> None:
    assert micro_batch_size(32, 3) == 16  # dp 1 and 2 divide 32; dp 3 does not
    assert micro_batch_size(24, 4) == 2  # per-replica batches 24, 12, 8, 6 -> gcd 2
    assert micro_batch_size(7, 8) == 1


TINY = {"gpt-tiny": "gpt", "bert-tiny": "bert", "mlp": "mlp"}
STAND_INS = {"vgg16": "mlp", "inception3": "mlp", "deepspeech2": "mlp"}


@pytest.mark.parametrize("workload", [*TINY, *STAND_INS])
def test_tiny_presets_keep_batch_and_have_a_layout_for_every_gpu_count(workload: str) -> None:
    spec = WorkloadSpec(workload=workload, global_batch_size=48, total_samples=480, seed=3)
    job_spec = job_spec_for(spec, max_gpus=8)
    assert job_spec.global_batch_size == 48
    assert job_spec.seed == 3
    assert job_spec.preset == {**TINY, **STAND_INS}[workload] and job_spec.model is None
    shape = model_shape(build_job(job_spec), job_spec)
    assert shape.n_params < 1_000_000  # small enough for CPU worker processes
    for gpus in range(1, 9):
        assert valid_layouts(shape, gpus), f"{workload}: no layout for {gpus} GPUs"


def test_real_workloads_are_the_real_architectures() -> None:
    expect = {"gpt2": "gpt2-124m", "bert": "bert-base", "resnet50": "resnet50"}
    assert set(expect) | set(TINY) | set(STAND_INS) == set(WORKLOAD_PRESETS)
    for workload, model in expect.items():
        spec = WorkloadSpec(workload=workload, global_batch_size=48, total_samples=480, seed=3)
        job_spec = job_spec_for(spec, max_gpus=8)
        assert (job_spec.model, job_spec.global_batch_size, job_spec.seed) == (model, 48, 3)


def test_entrypoint_and_unknown_workloads() -> None:
    spec = job_spec_for(
        WorkloadSpec(workload="my_pkg.jobs:build", global_batch_size=8, total_samples=8), 2
    )
    assert spec.entrypoint == "my_pkg.jobs:build" and spec.preset is None
    with pytest.raises(WorkloadError, match="unknown workload"):
        job_spec_for(WorkloadSpec(workload="not a model", global_batch_size=8, total_samples=8), 2)


def test_total_steps_rounds_up() -> None:
    assert total_steps(WorkloadSpec(workload="mlp", global_batch_size=8, total_samples=80)) == 10
    assert total_steps(WorkloadSpec(workload="mlp", global_batch_size=8, total_samples=81)) == 11


def test_power_estimate_scales_with_busy_time() -> None:
    model = {1: 200.0, 2: 380.0}
    assert estimated_power_w(model, 2, 1.0) == pytest.approx(380.0)
    assert estimated_power_w(model, 2, 0.0) == pytest.approx(380.0 * IDLE_SHARE)
    assert estimated_power_w(model, 1, 0.5) == pytest.approx(
        200.0 * (IDLE_SHARE + 0.5 * (1 - IDLE_SHARE))
    )
    assert estimated_power_w(model, 1, 7.0) == pytest.approx(200.0)  # clamped
    # Missing count: the nearest known count's per-GPU power.
    assert model_power_w(model, 4) == pytest.approx(380.0 / 2 * 4)
    assert model_power_w({}, 3) == pytest.approx(DEFAULT_SLOT_POWER_W * 3)
    assert model_power_w(model, 0) == 0.0
    assert energy_kwh(360.0, 10_000.0) == pytest.approx(1.0)


def _sample(i: int) -> TelemetrySample:
    return TelemetrySample(
        sample_id=f"s{i}",
        job_id=1,
        generation=1,
        at=datetime.now(UTC),
        interval_s=1.0,
        step=i,
        samples_done=i,
        samples_per_s=1.0,
        gpus=1,
        power_w=1.0,
        energy_kwh=0.0,
        power_source="estimated",
    )


def test_outbox_is_bounded_and_keeps_unacked_samples() -> None:
    box = Outbox(max_samples=3)
    for i in range(5):
        box.put(_sample(i))
    assert box.dropped == 2
    assert [s.sample_id for s in box.peek(10)] == ["s2", "s3", "s4"]
    box.ack(box.peek(2))
    assert [s.sample_id for s in box.peek(10)] == ["s4"]
    assert len(box) == 1


def test_nvml_index_follows_cuda_visible_devices() -> None:
    """CUDA device i is NVML device CUDA_VISIBLE_DEVICES[i] (by index or UUID), not i."""
    uuids = {"GPU-aaaa-1111": 0, "GPU-bbbb-2222": 1, "GPU-cccc-3333": 2, "GPU-dddd-4444": 3}
    assert nvml_indices(visible_devices(None), 4, uuids) == [0, 1, 2, 3]
    assert nvml_indices(visible_devices("2,0"), 2, uuids) == [2, 0]
    assert nvml_indices(visible_devices("GPU-dddd,GPU-bbbb-2222"), 2, uuids) == [3, 1]
    # CUDA ignores everything from the first invalid entry on.
    assert visible_devices("1,-1,2") == ["1"] and visible_devices("") == []
    with pytest.raises(NvmlUnavailable, match="names no single GPU"):
        nvml_indices(["GPU-"], 1, uuids)
