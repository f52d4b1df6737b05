"""Workdir bundle endpoints: users upload their job's code, agents fetch it (thin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Path, Request, Response, status
from pydantic import BaseModel

from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.bundles import service
from scheduler_service.deps import SessionDep, UserOrOperator, require_roles
from scheduler_service.exceptions import error_responses
from worker_agent.protocol import SHA256_PATTERN

BUNDLES_PREFIX = "/v1/bundles/"

router = APIRouter(prefix="/v1/bundles", tags=["bundles"], responses=error_responses(401, 403, 429))

Sha256 = Annotated[
    str, Path(pattern=SHA256_PATTERN, description="The bundle's SHA-256 (lower-case hex).")
]
AnyCaller = Annotated[Principal, Depends(require_roles(Role.USER, Role.OPERATOR, Role.AGENT))]


class BundleStored(BaseModel):
    """A stored bundle."""

    sha256: str
    size_bytes: int


@router.put(
    "/{sha256}",
    status_code=status.HTTP_201_CREATED,
    responses={200: {"model": BundleStored, "description": "Already stored."}, 413: {}},
)
def upload_bundle(
    sha256: Sha256,
    data: Annotated[bytes, Body(media_type="application/octet-stream")],
    caller: UserOrOperator,
    session: SessionDep,
    request: Request,
    response: Response,
) -> BundleStored:
    """Store a job's workdir bundle (.tar.gz) under its SHA-256 (idempotent)."""
    result = service.store_bundle(
        session, caller, sha256, data, request.app.state.settings.max_bundle_bytes
    )
    if not result.created:
        response.status_code = status.HTTP_200_OK
    return BundleStored(sha256=result.sha256, size_bytes=result.size_bytes)


@router.get(
    "/{sha256}",
    responses={
        200: {"content": {"application/gzip": {}}, "description": "The bundle's bytes."},
        **error_responses(404),
    },
    response_class=Response,
)
def download_bundle(sha256: Sha256, caller: AnyCaller, session: SessionDep) -> Response:
    """A bundle's bytes: for its uploader and users of it, operators, and the agents of nodes
    running one of its jobs."""
    data = service.read_bundle(session, caller, sha256)
    return Response(content=data, media_type="application/gzip")
