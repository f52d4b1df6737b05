"""The job lifecycle: every change goes through one function; terminal states are never left."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.db.models import Job
from scheduler_service.jobs.states import (
    TERMINAL_STATES,
    InvalidTransition,
    JobState,
    can_transition,
    transition,
)


def _job() -> Job:
    now = datetime.now(UTC)
    return Job(
        id=1, state=JobState.PENDING.value, started_at=None, finished_at=None, created_at=now
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(JobState)), max_size=12))
def test_random_walks_respect_the_lifecycle(targets: list[JobState]) -> None:
    job = _job()
    seen_terminal = False
    for target in targets:
        before = JobState(job.state)
        if can_transition(before, target):
            event = transition(job, target, reason="walk")
            assert (event.from_state, event.to_state) == (before.value, target.value)
            assert event.reason == "walk"
        else:
            with pytest.raises(InvalidTransition):
                transition(job, target, reason="walk")
            assert job.state == before.value
        if seen_terminal:
            assert JobState(job.state) == before  # nothing moves a terminal job
        seen_terminal = seen_terminal or JobState(job.state) in TERMINAL_STATES


def test_timestamps_follow_the_state() -> None:
    job = _job()
    transition(job, JobState.QUEUED, reason="admitted")
    assert job.started_at is None
    transition(job, JobState.RUNNING, reason="allocated")
    assert job.started_at is not None
    transition(job, JobState.SUCCEEDED, reason="done")
    assert job.finished_at is not None
    for state in JobState:
        assert not can_transition(JobState.SUCCEEDED, state)
