"""The console's pages and form actions under /console (server-rendered; htmx refreshes live panels)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Form, Query, Request, status
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from scheduler_service.auth.throttle import retry_after
from scheduler_service.budget.report import GroupBy, build_report, report_csv
from scheduler_service.console import service as pages
from scheduler_service.console.formatting import FILTERS
from scheduler_service.console.repository import SORTABLE_COLUMNS, ConsoleRepository
from scheduler_service.console.session import (
    BadFormToken,
    ConsoleUser,
    CurrentUser,
    NeedsSignIn,
    check_form_token,
    check_same_origin,
    clear_session_cookie,
    end_session,
    set_session_cookie,
    sign_in_principal,
    start_session,
)
from scheduler_service.db.base import utcnow
from scheduler_service.deps import ConfigDep, SessionDep, client_address
from scheduler_service.exceptions import NotAllowed
from scheduler_service.jobs import logs as job_logs
from scheduler_service.jobs import service as jobs_service
from scheduler_service.jobs.schemas import MAX_GPUS_PER_JOB
from scheduler_service.jobs.service import JobNotFound
from scheduler_service.jobs.states import TERMINAL_STATES, InvalidTransition, JobState

CONSOLE_DIR = Path(__file__).resolve().parent
STATIC_DIR = CONSOLE_DIR / "static"
# Files scripts/install_console_assets.sh copies from npm; without them charts and live updates are off.
VENDOR_FILES = ("htmx.min.js", "uPlot.iife.min.js", "uPlot.min.css")
PAGE_SIZE = 50
# Our own pages load only our own files: no CDN, no inline script.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
DONE_MESSAGES = {
    "cancel": "Job cancelled.",
    "hold": "Job held: the planner keeps it off the GPUs until it is released.",
    "release": "Job released: the planner may schedule it again.",
    "priority": "Priority changed.",
    "gpus": "GPU range changed: the next plan keeps the job within it.",
}

router = APIRouter(prefix="/console", include_in_schema=False)
templates = Jinja2Templates(directory=str(CONSOLE_DIR / "templates"))
templates.env.filters.update(FILTERS)

JobId = Annotated[int, PathParam(ge=1, le=2**62)]


@dataclass(frozen=True)
class AssetStatus:
    """Whether the npm-installed front-end libraries are in the static folder."""

    missing: list[str]
    versions: dict[str, str]

    @property
    def ok(self) -> bool:
        """True when every vendor file is present."""
        return not self.missing


def asset_status(static_dir: Path) -> AssetStatus:
    """Which vendor files are missing, and the installed versions (from versions.json)."""
    vendor = static_dir / "vendor"
    missing = [name for name in VENDOR_FILES if not (vendor / name).is_file()]
    try:
        versions = json.loads((vendor / "versions.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        versions = {}
    return AssetStatus(missing=missing, versions=versions if isinstance(versions, dict) else {})


def _static_dir(request: Request) -> Path:
    static_dir: Path = getattr(request.app.state, "console_static_dir", STATIC_DIR)
    return static_dir


def render(
    request: Request,
    name: str,
    context: dict[str, Any],
    *,
    user: ConsoleUser | None,
    status_code: int = 200,
) -> HTMLResponse:
    """Render a console template with the shared context and security headers."""
    root = request.scope.get("root_path", "")
    full = {
        "user": user,
        "assets": asset_status(_static_dir(request)),
        "static_prefix": f"{root}/console/static",
        "base": f"{root}/console",
        "now": utcnow(),
        "refresh_url": request.url.path + (f"?{request.url.query}" if request.url.query else ""),
        **context,
    }
    response = templates.TemplateResponse(request, name, full, status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    return response


def _safe_next(target: str | None) -> str:
    # Only paths inside the console: never an open redirect to another site.
    if target and target.startswith("/console") and not target.startswith("//"):
        return target
    return "/console"


# Sign-in ---------------------------------------------------------------------------------------


@router.get("/login")
def login_form(
    request: Request, next: Annotated[str | None, Query(max_length=500)] = None
) -> HTMLResponse:
    """The sign-in form."""
    return render(request, "login.html", {"next": _safe_next(next), "error": None}, user=None)


@router.post("/login", response_model=None)
def login(
    request: Request,
    session: SessionDep,
    token: Annotated[str, Form(max_length=500)],
    next: Annotated[str, Form(max_length=500)] = "/console",
) -> Response:
    """Check the token, start a console session and set its cookie."""
    check_same_origin(request)
    throttle = request.app.state.auth_throttle
    address = client_address(request)
    wait_s = throttle.wait_s(address)
    if wait_s > 0:
        refusal = render(
            request,
            "login.html",
            {
                "next": _safe_next(next),
                "error": f"Too many failed sign-ins from your address: wait {retry_after(wait_s)} s.",
            },
            user=None,
            status_code=status.HTTP_429_TOO_MANY_REQUESTS,
        )
        refusal.headers["Retry-After"] = retry_after(wait_s)
        return refusal
    principal = sign_in_principal(session, token)
    if principal is None:
        throttle.failed(address)
        return render(
            request,
            "login.html",
            {
                "next": _safe_next(next),
                "error": "That token is unknown, revoked or not a user/operator token.",
            },
            user=None,
            status_code=status.HTTP_401_UNAUTHORIZED,
        )
    throttle.succeeded(address)
    response = RedirectResponse(_safe_next(next), status_code=status.HTTP_303_SEE_OTHER)
    set_session_cookie(response, request, start_session(session, principal))
    return response


@router.post("/logout")
def logout(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    form_token: Annotated[str, Form(max_length=200)],
) -> RedirectResponse:
    """Sign out: end the session and clear the cookie."""
    check_form_token(request, user, form_token)
    end_session(session, user)
    response = RedirectResponse("/console/login", status_code=status.HTTP_303_SEE_OTHER)
    clear_session_cookie(response, request)
    return response


# Pages -----------------------------------------------------------------------------------------


@router.get("")
def overview(
    request: Request, session: SessionDep, user: CurrentUser, config: ConfigDep
) -> HTMLResponse:
    """GPUs, jobs by state, carbon intensity, budget burn-down, recent events."""
    view = pages.overview(session, user.principal, config, utcnow())
    return render(request, "overview.html", {"view": view, "page": "overview"}, user=user)


@router.get("/carbon")
def carbon(
    request: Request, session: SessionDep, user: CurrentUser, config: ConfigDep
) -> HTMLResponse:
    """Intensity history and forecast with GPUs in use, and the budget periods."""
    view = pages.carbon_page(session, user.principal, config, utcnow())
    return render(request, "carbon.html", {"view": view, "page": "carbon"}, user=user)


@router.get("/report")
def report_download(
    session: SessionDep,
    user: CurrentUser,
    config: ConfigDep,
    period: Annotated[str, Query(max_length=10)],
    by: Annotated[GroupBy, Query()] = "job",
    format: Annotated[Literal["csv", "json"], Query()] = "csv",
) -> Response:
    """The period's carbon report as a download (the same rows as `greenflow report`)."""
    principal = user.principal
    result = build_report(
        session, config, period, by, owner=None if principal.is_operator else principal.name
    )
    name = f"greenflow-report-{period}-by-{by}.{format}"
    body = report_csv(result) if format == "csv" else json.dumps(result.as_json(), indent=2)
    return Response(
        body,
        media_type="text/csv" if format == "csv" else "application/json",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


def _blank(value: str | None) -> str | None:
    return value.strip() or None if value is not None else None


@router.get("/jobs")
def jobs(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    state: Annotated[str | None, Query(max_length=24)] = None,
    owner: Annotated[str | None, Query(max_length=100)] = None,
    queue: Annotated[str | None, Query(max_length=64)] = None,
    q: Annotated[str | None, Query(max_length=200)] = None,
    sort: Annotated[str, Query(max_length=16)] = "id",
    dir: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    page: Annotated[int, Query(ge=1, le=100_000)] = 1,
) -> HTMLResponse:
    """A filterable, sortable list of the jobs the caller may see."""
    state, owner, queue, q = _blank(state), _blank(owner), _blank(queue), _blank(q)
    problems = []
    if state is not None and state not in {s.value for s in JobState}:
        problems.append(f"unknown state {state!r}")
        state = None
    if sort not in SORTABLE_COLUMNS:
        problems.append(f"cannot sort by {sort!r}")
        sort = "id"
    if not user.is_operator:
        owner = user.principal.name  # users see only their own jobs
    repo = ConsoleRepository(session)
    rows, total = repo.jobs_page(
        owner=owner,
        states=[state] if state else [],
        queue=queue,
        search=q,
        sort=sort,
        descending=dir == "desc",
        limit=PAGE_SIZE,
        offset=(page - 1) * PAGE_SIZE,
    )
    filters = {"state": state, "owner": owner if user.is_operator else None, "queue": queue, "q": q}

    def link(**changes: Any) -> str:
        params = {**filters, "sort": sort, "dir": dir, "page": page, **changes}
        query = "&".join(f"{k}={quote(str(v))}" for k, v in params.items() if v not in (None, ""))
        return f"/console/jobs?{query}"

    context = {
        "page": "jobs",
        "jobs": rows,
        "total": total,
        "filters": filters,
        "sort": sort,
        "dir": dir,
        "page_no": page,
        "pages": max(1, -(-total // PAGE_SIZE)),
        "link": link,
        "problems": problems,
        "states": [s.value for s in JobState],
        "owners": repo.owners() if user.is_operator else [],
        "queues": repo.queues(owner=None if user.is_operator else user.principal.name),
        "total_samples": pages.job_total_samples,
    }
    return render(request, "jobs.html", context, user=user)


def _job_context(session: SessionDep, user: ConsoleUser, job_id: int) -> dict[str, Any]:
    job = jobs_service.get_visible_job(session, user.principal, job_id)
    view = pages.job_page(session, job, utcnow())
    mine = job.owner == user.principal.name
    finished = JobState(job.state) in TERMINAL_STATES
    return {
        "page": "jobs",
        "view": view,
        "can_cancel": (user.is_operator or mine) and not finished,
        "can_steer": user.is_operator and not finished,
        "gpu_chart": view.gpu_chart.as_json(),
        "rate_chart": view.rate_chart.as_json(),
    }


def _not_found(request: Request, user: ConsoleUser, job_id: int) -> HTMLResponse:
    return render(
        request,
        "error.html",
        {"title": "Job not found", "message": f"Job {job_id} does not exist or is not yours."},
        user=user,
        status_code=status.HTTP_404_NOT_FOUND,
    )


@router.get("/jobs/{job_id}")
def job_detail(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    job_id: JobId,
    done: Annotated[str | None, Query(max_length=16)] = None,
) -> HTMLResponse:
    """A job's spec, state timeline, GPU/layout history, throughput, energy and projection."""
    try:
        context = _job_context(session, user, job_id)
    except JobNotFound:
        return _not_found(request, user, job_id)
    context["notice"] = DONE_MESSAGES.get(done or "")
    return render(request, "job.html", context, user=user)


# Rank 0's newest output shown on a job's page, and the most steps its scalars chart plots.
OUTPUT_TAIL_BYTES = 16 << 10
CURVE_POINTS = 1000


@router.get("/jobs/{job_id}/output")
def job_output(
    request: Request, session: SessionDep, user: CurrentUser, job_id: JobId
) -> HTMLResponse:
    """A job's output panel: rank 0's log tail and its logged scalars per step with the hot
    switches marked, from the agent that holds them (htmx swaps it into the job page every few
    seconds; without htmx it is a page of its own)."""
    try:
        source = job_logs.log_source(
            session, user.principal, job_id, request.app.state.node_secrets
        )
    except JobNotFound:
        return _not_found(request, user, job_id)
    job = jobs_service.get_visible_job(session, user.principal, job_id)
    finished = JobState(job.state) in TERMINAL_STATES
    marks = pages.step_marks(ConsoleRepository(session).job_events(job_id))
    session.commit()  # no transaction is held while the agent answers
    view = pages.job_output(
        job_id, finished, marks, source, tail_bytes=OUTPUT_TAIL_BYTES, max_points=CURVE_POINTS
    )
    context = {"page": "jobs", "out": view, "curve_chart": view.curve.as_json()}
    if request.headers.get("HX-Request"):
        return render(request, "_job_output.html", context, user=user)
    return render(request, "job_output.html", context, user=user)


def _act(
    request: Request,
    session: SessionDep,
    user: ConsoleUser,
    job_id: int,
    form_token: str,
    action: str,
    **kwargs: Any,
) -> Response:
    """Run one operator action through the jobs service, then show the job (or why it failed)."""
    check_form_token(request, user, form_token)
    try:
        if action == "cancel":
            jobs_service.cancel_job(session, user.principal, job_id, reason=kwargs["reason"])
        elif action in ("hold", "release"):
            jobs_service.set_hold(session, user.principal, job_id, held=action == "hold")
        elif action == "gpus":
            jobs_service.set_gpu_range(
                session,
                user.principal,
                job_id,
                min_gpus=kwargs["min_gpus"],
                max_gpus=kwargs["max_gpus"],
            )
        else:
            jobs_service.set_priority(session, user.principal, job_id, priority=kwargs["priority"])
    except JobNotFound:
        return _not_found(request, user, job_id)
    except (InvalidTransition, NotAllowed) as exc:
        code = (
            status.HTTP_403_FORBIDDEN if isinstance(exc, NotAllowed) else status.HTTP_409_CONFLICT
        )
        context = _job_context(session, user, job_id)
        context["error"] = str(exc)
        return render(request, "job.html", context, user=user, status_code=code)
    return RedirectResponse(
        f"/console/jobs/{job_id}?done={action}", status_code=status.HTTP_303_SEE_OTHER
    )


FormToken = Annotated[str, Form(max_length=200)]


@router.post("/jobs/{job_id}/cancel", response_model=None)
def cancel(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    job_id: JobId,
    form_token: FormToken,
    reason: Annotated[str, Form(max_length=500)] = "",
) -> Response:
    """Cancel a job (its owner or an operator)."""
    why = reason.strip() or f"cancelled from the console by {user.principal.name}"
    return _act(request, session, user, job_id, form_token, "cancel", reason=why)


@router.post("/jobs/{job_id}/hold", response_model=None)
def hold(
    request: Request, session: SessionDep, user: CurrentUser, job_id: JobId, form_token: FormToken
) -> Response:
    """Hold a job off the GPUs (operators)."""
    return _act(request, session, user, job_id, form_token, "hold")


@router.post("/jobs/{job_id}/release", response_model=None)
def release(
    request: Request, session: SessionDep, user: CurrentUser, job_id: JobId, form_token: FormToken
) -> Response:
    """Release a held job (operators)."""
    return _act(request, session, user, job_id, form_token, "release")


@router.post("/jobs/{job_id}/priority", response_model=None)
def priority(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    job_id: JobId,
    form_token: FormToken,
    priority: Annotated[int, Form(ge=0, le=100)],
) -> Response:
    """Change a job's priority (operators)."""
    return _act(request, session, user, job_id, form_token, "priority", priority=priority)


@router.post("/jobs/{job_id}/gpus", response_model=None)
def gpu_range(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    job_id: JobId,
    form_token: FormToken,
    min_gpus: Annotated[int, Form(ge=1, le=MAX_GPUS_PER_JOB)],
    max_gpus: Annotated[int, Form(ge=1, le=MAX_GPUS_PER_JOB)],
) -> Response:
    """Change the GPUs a job may run on (operators)."""
    if min_gpus > max_gpus:
        check_form_token(request, user, form_token)
        try:
            context = _job_context(session, user, job_id)
        except JobNotFound:
            return _not_found(request, user, job_id)
        context["error"] = f"min_gpus ({min_gpus}) must not exceed max_gpus ({max_gpus})."
        return render(request, "job.html", context, user=user, status_code=422)
    return _act(
        request,
        session,
        user,
        job_id,
        form_token,
        "gpus",
        min_gpus=min_gpus,
        max_gpus=max_gpus,
    )


@router.get("/nodes")
def nodes(
    request: Request, session: SessionDep, user: CurrentUser, config: ConfigDep
) -> HTMLResponse:
    """Each node's GPU slots, what runs on them, heartbeat age and health."""
    views = pages.nodes_page(session, user.principal, config, utcnow())
    context = {"page": "nodes", "nodes": views, "timeout_s": config.cluster.heartbeat_timeout_s}
    return render(request, "nodes.html", context, user=user)


# Mounting --------------------------------------------------------------------------------------


def mount_console(app: FastAPI, *, static_dir: Path = STATIC_DIR) -> None:
    """Add the console's pages at /console and its static files at /console/static."""
    app.state.console_static_dir = static_dir
    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=static_dir), name="console_static")

    async def _sign_in(request: Request, _exc: Exception) -> Response:
        target = "/console/login?next=" + quote(request.url.path, safe="/")
        if request.headers.get("HX-Request"):
            # htmx swaps the body of a 200; HX-Redirect makes it load the sign-in page instead.
            return Response(status_code=200, headers={"HX-Redirect": target})
        return RedirectResponse(target, status_code=status.HTTP_303_SEE_OTHER)

    async def _bad_form(request: Request, _exc: Exception) -> Response:
        return render(
            request,
            "error.html",
            {
                "title": "Form expired",
                "message": "This form did not carry your session's form token. Reload the page "
                "and try again.",
            },
            user=None,
            status_code=status.HTTP_403_FORBIDDEN,
        )

    app.add_exception_handler(NeedsSignIn, _sign_in)
    app.add_exception_handler(BadFormToken, _bad_form)
