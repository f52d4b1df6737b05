"""Request and response bodies of the jobs API."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from scheduler_service.jobs.states import JobState
from worker_agent.protocol import (
    MODULE_PRESETS,
    SHA256_PATTERN,
    WORKLOAD_PATTERN,
    WORKLOAD_PRESETS,
    WireDatetime,
)

MAX_GPUS_PER_JOB = 4096
MAX_OPTIONS_BYTES = 16_384


# ISO 8601 text with a time zone, years 2000-9000 (a later date overflows once moved to UTC).
IsoDatetime = WireDatetime


INIT_FROM_JOB = re.compile(r"^job:([1-9][0-9]{0,17})$")


def check_init_from(value: str, workload: str) -> None:
    """Raise ValueError (naming init_from) unless `value` is `job:<id>` or a clean absolute
    path, on an entrypoint workload."""
    if workload in WORKLOAD_PRESETS and workload not in MODULE_PRESETS:
        raise ValueError(
            f"init_from goes with an entrypoint workload (module:function) or a model preset "
            f"({', '.join(sorted(MODULE_PRESETS))}), not {workload!r}"
        )
    if INIT_FROM_JOB.match(value):
        return
    if not value.startswith("/"):
        raise ValueError(
            f"init_from {value!r}: use job:<id> (an earlier job's export) or an absolute path "
            "on the nodes"
        )
    if any(ord(ch) < 32 for ch in value) or ".." in value.split("/"):
        raise ValueError("init_from: a path without control characters or '..' components")


class JobSpec(BaseModel):
    """What a user submits: the work, its size, its GPU range and its timing."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [{"required": ["total_samples"]}, {"required": ["total_steps"]}]
        },
    )

    name: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^\S(.*\S)?$")]
    workload: Annotated[
        str,
        Field(
            min_length=1,
            max_length=200,
            description=(
                "A preset model name (" + ", ".join(WORKLOAD_PRESETS) + ") or an entrypoint "
                "module:function."
            ),
            # In the schema for clients; checked below with a message that lists the presets.
            json_schema_extra={"pattern": WORKLOAD_PATTERN},
        ),
    ]
    global_batch_size: Annotated[int, Strict(), Field(ge=1, le=1_048_576)]
    # Exactly one of the two (the schema says so with oneOf below).
    total_samples: Annotated[int, Strict(), Field(ge=1, le=10**15)] | SkipJsonSchema[None] = None
    total_steps: Annotated[int, Strict(), Field(ge=1, le=10**12)] | SkipJsonSchema[None] = None
    min_gpus: Annotated[int, Strict(), Field(ge=1, le=MAX_GPUS_PER_JOB)] = 1
    max_gpus: Annotated[int, Strict(), Field(ge=1, le=MAX_GPUS_PER_JOB)] = 1
    deadline: IsoDatetime | None = Field(
        default=None, description="Absolute time, with a time zone."
    )
    begin_after: IsoDatetime | None = None
    priority: Annotated[int, Strict(), Field(ge=0, le=100)] = 1
    queue: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")] = (
        "default"
    )
    submission_id: Annotated[
        str | None, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    ] = None
    best_effort: StrictBool = Field(
        default=False,
        description="Queue without a deadline guarantee if the deadline cannot be met.",
    )
    run_past_deadline: StrictBool = Field(
        default=False, description="Keep running after a missed deadline."
    )
    bundle: Annotated[
        str | None,
        Field(
            pattern=SHA256_PATTERN,
            description="SHA-256 of the job's workdir bundle (PUT /v1/bundles/{sha256} first; "
            "`greenflow submit --workdir DIR` does both): the directory the entrypoint is "
            "imported from on the agents.",
        ),
    ] = None
    options: dict[str, Any] | None = Field(
        default=None,
        description="Keyword arguments of the entrypoint's job function (JSON, at most "
        f"{MAX_OPTIONS_BYTES} bytes).",
    )
    init_from: Annotated[
        str | None,
        Field(
            max_length=1000,
            description="Entrypoint jobs: start from these weights (step 0, a fresh optimizer) "
            "instead of the model's initialisation. `job:<id>`: the export of an earlier "
            "SUCCEEDED job of yours (kept by the agent of the node that ran it); or an absolute "
            "path on the nodes: an exported or Hugging Face directory with model.safetensors, "
            "or a .safetensors state dict file.",
        ),
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _no_explicit_null_totals(cls, data: Any) -> Any:
        # Omit the total you do not give; an explicit null is a schema violation.
        if isinstance(data, dict):
            for key in ("total_samples", "total_steps"):
                if key in data and data[key] is None:
                    raise ValueError(f"{key} must be an integer; omit it instead of sending null")
        return data

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, workload: str) -> str:
        if not re.fullmatch(WORKLOAD_PATTERN, workload):
            raise ValueError(
                f"unknown workload {workload!r}: use a preset ({', '.join(WORKLOAD_PRESETS)}) "
                "or an entrypoint module:function"
            )
        return workload

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.total_samples is None) == (self.total_steps is None):
            raise ValueError("give exactly one of total_samples and total_steps")
        if self.min_gpus > self.max_gpus:
            raise ValueError(
                f"min_gpus ({self.min_gpus}) must not exceed max_gpus ({self.max_gpus})"
            )
        if (
            self.deadline is not None
            and self.begin_after is not None
            and self.deadline <= self.begin_after
        ):
            raise ValueError("deadline must be after begin_after")
        if self.workload in WORKLOAD_PRESETS and (self.bundle or self.options):
            raise ValueError("bundle and options go with an entrypoint workload (module:function)")
        if self.init_from is not None:
            check_init_from(self.init_from, self.workload)
        if self.options is not None and len(json.dumps(self.options)) > MAX_OPTIONS_BYTES:
            raise ValueError(f"options: more than {MAX_OPTIONS_BYTES} bytes of JSON")
        return self

    def total_samples_resolved(self) -> int:
        """The job's work in samples, whichever way the user gave it."""
        if self.total_samples is not None:
            return self.total_samples
        assert self.total_steps is not None
        return self.total_steps * self.global_batch_size


class JobOut(BaseModel):
    """A job as the API shows it."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    owner: str
    name: str
    workload: str
    global_batch_size: int
    total_samples: int | None
    total_steps: int | None
    min_gpus: int
    max_gpus: int
    deadline: datetime | None = Field(validation_alias="deadline_at")
    begin_after: datetime | None
    priority: int
    queue: str
    submission_id: str | None
    best_effort: bool
    run_past_deadline: bool
    bundle: str | None = Field(validation_alias="bundle_sha256")
    options: dict[str, Any] | None
    init_from: str | None = None
    held: bool
    state: JobState
    state_reason: str
    samples_done: int
    step: int
    current_gpus: int
    current_layout: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobPage(BaseModel):
    """One page of a job listing."""

    items: list[JobOut]
    total: int
    limit: int
    offset: int


class JobEventOut(BaseModel):
    """One recorded event of a job."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    kind: str
    from_state: str | None
    to_state: str | None
    reason: str
    actor: str
    details: dict[str, Any] | None


class CancelRequest(BaseModel):
    """Why a job is being cancelled (optional)."""

    model_config = ConfigDict(extra="forbid")

    reason: Annotated[str, Field(max_length=500)] = "cancelled by request"


class GpuRange(BaseModel):
    """The GPUs a job may run on (between min and max, or none while it waits)."""

    model_config = ConfigDict(extra="forbid")

    min_gpus: Annotated[int, Strict(), Field(ge=1, le=MAX_GPUS_PER_JOB)]
    max_gpus: Annotated[int, Strict(), Field(ge=1, le=MAX_GPUS_PER_JOB)]

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min_gpus > self.max_gpus:
            raise ValueError(
                f"min_gpus ({self.min_gpus}) must not exceed max_gpus ({self.max_gpus})"
            )
        return self


class PriorityChange(BaseModel):
    """A job's new priority."""

    model_config = ConfigDict(extra="forbid")

    priority: Annotated[int, Strict(), Field(ge=0, le=100)]
