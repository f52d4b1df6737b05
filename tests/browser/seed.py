"""Seed a migrated database with a small, realistic cluster for the console tests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from scheduler_service.auth.service import create_token
from scheduler_service.auth.tokens import Role
from scheduler_service.budget.periods import period_containing
from scheduler_service.db.models import (
    Allocation,
    CarbonForecastRecord,
    CarbonIntensitySample,
    GpuSlot,
    Job,
    JobEvent,
    LedgerEntry,
    Node,
    Plan,
    TelemetrySample,
)
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.plans import index_plan
from scheduler_service.jobs.states import JobState, initial_event, transition

REGION = "local"
PUE = 1.2
SAMPLE_S = 300.0
POWER_PER_GPU_W = 280.0
SAMPLES_PER_S_PER_GPU = 95.0


@dataclass(frozen=True)
class Seeded:
    """Tokens and ids the tests look for."""

    operator_token: str
    alice_token: str
    bob_token: str
    running_job_id: int  # alice's, hot-switched twice
    at_risk_job_id: int  # bob's, running, projected past its deadline
    cancel_job_id: int  # bob's, queued: the one the browser cancels
    alice_queued_job_id: int


def intensity_at(at: datetime) -> float:
    """A synthetic grid: dirty at night, a deep solar dip around 13:00 UTC (g CO₂e/kWh)."""
    hour = at.hour + at.minute / 60
    return 320.0 - 170.0 * math.exp(-(((hour - 13.0) / 3.0) ** 2)) + 25.0 * math.sin(hour / 3.0)


def _job(
    owner: str,
    name: str,
    workload: str,
    now: datetime,
    *,
    created_at: datetime,
    global_batch_size: int = 256,
    min_gpus: int = 1,
    max_gpus: int = 1,
    **fields: Any,
) -> Job:
    return Job(
        owner=owner,
        name=name,
        workload=workload,
        global_batch_size=global_batch_size,
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        state=JobState.PENDING.value,
        state_reason="submitted",
        created_at=created_at,
        updated_at=created_at,
        **fields,
    )


def _submit(session: Session, job: Job) -> None:
    session.add(job)
    session.flush()
    session.add(initial_event(job, reason="submitted", actor=job.owner))
    session.add(
        transition(
            job, JobState.QUEUED, reason="accepted; waiting for the planner", at=job.created_at
        )
    )


def _move(session: Session, job: Job, to: JobState, reason: str, at: datetime) -> None:
    session.add(transition(job, to, reason=reason, at=at))
    job.updated_at = at


def _telemetry(
    session: Session,
    job: Job,
    node: Node,
    *,
    start: datetime,
    end: datetime,
    gpus_at: list[tuple[datetime, int, str]],
) -> list[TelemetrySample]:
    """Samples every SAMPLE_S from start to end; GPU count and layout from the last change before each."""
    samples = []
    at = start + timedelta(seconds=SAMPLE_S)
    done = 0
    step = 0
    while at <= end:
        gpus, layout = next((g, lay) for t, g, lay in reversed(gpus_at) if t < at)
        rate = SAMPLES_PER_S_PER_GPU * gpus * (0.92 if gpus > 2 else 1.0)
        done += int(rate * SAMPLE_S)
        step = done // job.global_batch_size
        power_w = POWER_PER_GPU_W * gpus
        sample = TelemetrySample(
            sample_id=f"seed-{job.id}-{int(at.timestamp())}",
            job_id=job.id,
            node_id=node.id,
            at=at,
            interval_s=SAMPLE_S,
            step=step,
            samples_done=done,
            samples_per_s=rate,
            loss=2.0 / (1 + step / 500),
            gpus=gpus,
            layout=layout,
            power_w=power_w,
            energy_kwh=power_w * SAMPLE_S / 3.6e6,
            power_source="estimated",
        )
        session.add(sample)
        samples.append(sample)
        at += timedelta(seconds=SAMPLE_S)
    job.samples_done = done
    job.step = step
    session.flush()
    return samples


def _charge(session: Session, samples: list[TelemetrySample]) -> None:
    for sample in samples:
        sample.charged = True  # as the ledger's charge marks it
        intensity = intensity_at(sample.at)
        period = period_containing(sample.at, "day")
        session.add(
            LedgerEntry(
                job_id=sample.job_id,
                telemetry_sample_id=sample.id,
                period_start=period.start_at,
                period_end=period.end_at,
                interval_start=sample.at - timedelta(seconds=sample.interval_s),
                interval_end=sample.at,
                energy_kwh=sample.energy_kwh,
                pue=PUE,
                intensity_g_per_kwh=intensity,
                emissions_kg=sample.energy_kwh * PUE * intensity / 1000,
            )
        )


def _hot_switch(
    session: Session, job: Job, at: datetime, before: tuple[int, str], after: tuple[int, str]
) -> None:
    session.add(
        JobEvent(
            job_id=job.id,
            at=at,
            kind="hot_switch",
            reason=f"plan moved the job from {before[0]} to {after[0]} GPUs",
            actor="control-loop",
            details={
                "from_gpus": before[0],
                "to_gpus": after[0],
                "from_layout": before[1],
                "to_layout": after[1],
                "switch_s": 1.8 if after[0] > before[0] else 1.1,
            },
        )
    )


def seed(database_url: str, now: datetime | None = None) -> Seeded:
    """Fill a migrated database with tokens, nodes, jobs, telemetry, carbon data and a ledger."""
    now = now or datetime.now(UTC)
    engine = make_engine(database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            return _seed(session, now.replace(microsecond=0))
    finally:
        engine.dispose()


def _seed(session: Session, now: datetime) -> Seeded:
    operator = create_token(session, name="ops", role=Role.OPERATOR)
    alice = create_token(session, name="alice", role=Role.USER)
    bob = create_token(session, name="bob", role=Role.USER)

    node_a = Node(
        name="node-a",
        agent_url="http://127.0.0.1:9001",
        gpu_kind="A100-40GB",
        simulated=True,
        last_heartbeat_at=now - timedelta(seconds=4),
    )
    node_b = Node(
        name="node-b",
        agent_url="http://127.0.0.1:9002",
        gpu_kind="A100-40GB",
        simulated=True,
        last_heartbeat_at=now - timedelta(hours=1),
    )
    session.add_all([node_a, node_b])
    session.flush()
    for node in (node_a, node_b):
        for index in range(4):
            session.add(
                GpuSlot(
                    node_id=node.id, index=index, uuid=f"GPU-{node.name}-{index}", memory_mb=40960
                )
            )
    session.flush()

    # Alice's BERT job: started on 2 GPUs 3 h ago, switched to 4, then to 3.
    bert = _job(
        "alice",
        "bert-finetune",
        "bert",
        now,
        total_samples=8_000_000,
        min_gpus=1,
        max_gpus=4,
        deadline_at=now + timedelta(hours=10),
        queue="research",
        priority=2,
        created_at=now - timedelta(hours=3, minutes=10),
    )
    _submit(session, bert)
    started = now - timedelta(hours=3)
    switch_1 = now - timedelta(hours=2)
    switch_2 = now - timedelta(minutes=50)
    _move(session, bert, JobState.RUNNING, "plan gave it 2 GPUs", started)
    _hot_switch(session, bert, switch_1, (2, "dp2"), (4, "dp2-tp2"))
    _hot_switch(session, bert, switch_2, (4, "dp2-tp2"), (3, "dp3"))
    bert.current_gpus, bert.current_layout = 3, "dp3"
    for generation, (at, gpus, layout, slots) in enumerate(
        [
            (started, 2, "dp2", [0, 1]),
            (switch_1, 4, "dp2-tp2", [0, 1, 2, 3]),
            (switch_2, 3, "dp3", [0, 1, 2]),
        ],
        start=1,
    ):
        session.add(
            Allocation(
                job_id=bert.id,
                generation=generation,
                node_id=node_a.id,
                gpus=gpus,
                slot_indices=slots,
                layout=layout,
                status="acked",
                attempts=1,
                created_at=at - timedelta(seconds=5),
                sent_at=at - timedelta(seconds=4),
                acked_at=at,
            )
        )
        session.add(
            JobEvent(
                job_id=bert.id,
                at=at - timedelta(seconds=5),
                kind="allocation",
                reason=f"generation {generation}: {gpus} GPUs on node-a",
                actor="control-loop",
                details={"generation": generation, "gpus": gpus, "node": "node-a"},
            )
        )
    bert_samples = _telemetry(
        session,
        bert,
        node_a,
        start=started,
        end=now,
        gpus_at=[(started, 2, "dp2"), (switch_1, 4, "dp2-tp2"), (switch_2, 3, "dp3")],
    )

    # Bob's ResNet job: 2 GPUs, far too slow for its deadline.
    resnet = _job(
        "bob",
        "resnet50-sweep",
        "resnet50",
        now,
        total_samples=20_000_000,
        min_gpus=1,
        max_gpus=2,
        deadline_at=now + timedelta(hours=2),
        created_at=now - timedelta(hours=2, minutes=5),
    )
    _submit(session, resnet)
    resnet_start = now - timedelta(hours=2)
    _move(session, resnet, JobState.RUNNING, "plan gave it 2 GPUs", resnet_start)
    resnet.current_gpus, resnet.current_layout = 2, "dp2"
    resnet_samples = _telemetry(
        session, resnet, node_b, start=resnet_start, end=now, gpus_at=[(resnet_start, 2, "dp2")]
    )

    gpt2 = _job(
        "alice",
        "gpt2-pretrain",
        "gpt2",
        now,
        total_steps=40_000,
        min_gpus=2,
        max_gpus=8,
        deadline_at=now + timedelta(days=1, hours=6),
        queue="research",
        created_at=now - timedelta(minutes=40),
    )
    _submit(session, gpt2)

    vgg = _job(
        "bob",
        "vgg16-baseline",
        "vgg16",
        now,
        total_samples=3_000_000,
        min_gpus=1,
        max_gpus=4,
        deadline_at=now + timedelta(hours=20),
        created_at=now - timedelta(hours=1),
    )
    _submit(session, vgg)
    _move(session, vgg, JobState.DEFERRED, "waiting for the solar dip", now - timedelta(minutes=55))

    speech = _job(
        "ops",
        "deepspeech2-smoke",
        "deepspeech2",
        now,
        total_samples=50_000,
        created_at=now - timedelta(hours=6),
    )
    _submit(session, speech)
    _move(
        session,
        speech,
        JobState.RUNNING,
        "plan gave it 1 GPU",
        now - timedelta(hours=5, minutes=55),
    )
    _move(session, speech, JobState.SUCCEEDED, "all samples done", now - timedelta(hours=5))
    speech.samples_done = 50_000

    cancel_me = _job(
        "bob",
        "cancel-me",
        "resnet50",
        now,
        total_samples=1_000_000,
        queue="batch",
        created_at=now - timedelta(minutes=20),
    )
    _submit(session, cancel_me)
    session.flush()

    for index in range(3):
        session.query(GpuSlot).filter_by(node_id=node_a.id, index=index).update({"job_id": bert.id})
    for index in range(2):
        session.query(GpuSlot).filter_by(node_id=node_b.id, index=index).update(
            {"job_id": resnet.id}
        )

    _charge(session, bert_samples + resnet_samples)
    # Earlier periods, so the period table has history.
    today = period_containing(now, "day").start_at
    for days_ago, kg in ((1, 3.1), (2, 4.6), (3, 2.2)):
        start = today - timedelta(days=days_ago)
        session.add(
            LedgerEntry(
                job_id=speech.id,
                period_start=start,
                period_end=start + timedelta(days=1),
                interval_start=start + timedelta(hours=10),
                interval_end=start + timedelta(hours=11),
                energy_kwh=kg / PUE / 0.3,
                pue=PUE,
                intensity_g_per_kwh=300.0,
                emissions_kg=kg,
            )
        )

    fetched = now - timedelta(minutes=3)
    for quarter in range(24 * 4 + 1):
        at = now.replace(minute=(now.minute // 15) * 15, second=0) - timedelta(minutes=15 * quarter)
        session.add(
            CarbonIntensitySample(
                region=REGION,
                source="synthetic",
                signal="lca",
                at=at,
                intensity_g_per_kwh=intensity_at(at),
                kind="measured",
                fetched_at=fetched,
            )
        )
    hour = now.replace(minute=0, second=0)
    session.add(
        CarbonForecastRecord(
            region=REGION,
            source="synthetic",
            signal="lca",
            fetched_at=fetched,
            degraded=False,
            points=[
                {
                    "at": (hour + timedelta(hours=h)).isoformat(),
                    "intensity_g_per_kwh": round(intensity_at(hour + timedelta(hours=h)) * 1.03, 1),
                    "kind": "forecast",
                }
                for h in range(25)
            ],
        )
    )
    _plan(session, now, bert=bert, resnet=resnet, vgg=vgg, gpt2=gpt2)
    return Seeded(
        operator_token=operator,
        alice_token=alice,
        bob_token=bob,
        running_job_id=bert.id,
        at_risk_job_id=resnet.id,
        cancel_job_id=cancel_me.id,
        alice_queued_job_id=gpt2.id,
    )


def _plan(session: Session, now: datetime, *, bert: Job, resnet: Job, vgg: Job, gpt2: Job) -> None:
    """A current plan: hourly slots, more GPUs in the solar dip, resnet's deadline out of reach."""
    slot_s = 3600.0
    start = now.replace(minute=0, second=0)
    gpus: dict[str, list[int]] = {str(j.id): [] for j in (bert, resnet, vgg, gpt2)}
    slots = []
    for index in range(24):
        intensity = intensity_at(start + timedelta(seconds=index * slot_s))
        dip = intensity < 220
        row = {
            bert.id: (4 if dip else 3) if index < 12 else 0,
            resnet.id: 2,
            vgg.id: 2 if dip else 0,
            gpt2.id: 0 if dip else 2,
        }
        for job_id, count in row.items():
            gpus[str(job_id)].append(count)
        energy_kwh = sum(row.values()) * POWER_PER_GPU_W * slot_s / 3.6e6 * PUE
        slots.append(
            {
                "capacity_gpus": 8,
                "intensity_g_per_kwh": intensity,
                "energy_kwh": energy_kwh,
                "emissions_kg": energy_kwh * intensity / 1000,
            }
        )
    session.add(
        index_plan(
            Plan(
                created_at=now - timedelta(seconds=40),
                start_at=start,
                slot_s=slot_s,
                policy="greenflow",
                status="OPTIMAL",
                gap=0.0,
                solve_s=0.8,
                energy_kwh=sum(s["energy_kwh"] for s in slots),
                emissions_kg=sum(s["emissions_kg"] for s in slots),
                forecast_degraded=False,
                slots=slots,
            ),
            gpus,
            {str(resnet.id): "needs about 22 h on its maximum of 2 GPUs; the deadline is in 2 h"},
        )
    )
