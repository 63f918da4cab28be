"""The dashboard's routes under ``/ui``: login, logout, the pages and one JSON feed for live charts.

Who may look: the admin only, by a session cookie (``session.py``) set by the login form, or by
``Authorization: Bearer <admin key>`` (scripts, the browser test). A page request without either
is redirected to the login form; ``/ui/static`` needs nothing. The key is read from a POST body
only: never from a URL, never written into a page.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, quote

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from contract.vocabulary import EpisodeStatus, GroupStatus, TrainStatus
from proxy import export as ex
from proxy.auth import bearer
from proxy.deps import Services, ServicesDep, check_key
from proxy.errors import InvalidRequest, NotFound, TooManyRequests
from proxy.gate import canonical_id
from proxy.store.browse import Cursor
from proxy.ui import views
from proxy.ui.session import COOKIE, SessionTokens

HERE = Path(__file__).parent
PAGE = 50
"""Rows per table page."""
_HEADERS = {
    # No inline script anywhere: data reaches the charts through /ui/api/overview.
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "cache-control": "no-store",
    "referrer-policy": "same-origin",
    "x-content-type-options": "nosniff",
}


class TokenRate:
    """Tokens/s through this proxy process, from its token counters, over the span since the oldest
    reading kept: about the last ``window_s`` while the overview is polled.

    Computed here, not in the page from two of its polls, so the figure is a number from the first
    page load. The counters start at 0 when the app is made (the first reading); readings are taken
    only when the overview is read, so after a long quiet spell the span is longer: it is shown.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.readings: deque[tuple[float, float]] = deque([(clock(), 0.0)])

    def update(self, total: float) -> tuple[float, float]:
        """Read ``total`` (tokens so far): (tokens per second, over how many seconds)."""
        now = self.clock()
        self.readings.append((now, total))
        while len(self.readings) > 2 and self.readings[1][0] <= now - self.window_s:
            self.readings.popleft()
        then, before = self.readings[0]
        span = now - then
        return ((total - before) / span if span > 0 else 0.0), span


class LoginRequired(Exception):
    """A page was asked for without a session: answered with a redirect to the login form."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def _fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return ""
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _fmt_num(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["time"] = _fmt_time
    env.filters["num"] = _fmt_num
    return env


class Pages:
    """The template environment and session signer of one app."""

    def __init__(self, tokens: SessionTokens) -> None:
        self.env = _environment()
        self.tokens = tokens
        self.rate = TokenRate()

    def render(
        self,
        request: Request,
        name: str,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        **context: Any,
    ) -> HTMLResponse:
        body = self.env.get_template(name).render(request=request, **context)
        return HTMLResponse(body, status_code=status_code, headers=_HEADERS | (headers or {}))


def _pages(request: Request) -> Pages:
    pages: Pages = request.app.state.ui_pages
    return pages


def _signed_in(request: Request) -> bool:
    key = bearer(request.headers.get("authorization"))
    if key is not None:
        found = check_key(request, key)
        return found is not None and found.role == "admin"
    return _pages(request).tokens.valid(request.cookies.get(COOKIE))


async def viewer(request: Request) -> Pages:
    """The pages, for a signed-in admin; ``LoginRequired`` otherwise."""
    if not _signed_in(request):
        raise LoginRequired(request.url.path)
    return _pages(request)


async def _login_redirect(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    return RedirectResponse(f"/ui/login?next={quote(exc.path)}", status_code=303, headers=_HEADERS)


router = APIRouter(prefix="/ui", include_in_schema=False)
Blank = Literal[""]
"""A filter form's "any" choice: the select sends ``status=``, which means no filter."""
Viewer = Depends(viewer)


def _local(path: str | None) -> str:
    """Where to go after logging in: a dashboard path only (no open redirect)."""
    if path and path.startswith("/ui/") and not path.startswith("//") and "\\" not in path:
        return path
    return "/ui/"


@router.get("/login")
async def login_form(request: Request, target: str | None = Query(None, alias="next")) -> HTMLResponse:
    return _pages(request).render(request, "login.html", next=_local(target), error=None)


@router.post("/login")
async def login(request: Request, svc: ServicesDep) -> Response:
    """Check the admin key from the form body; on success set the session cookie (the key is not in it)."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"), keep_blank_values=True)
    key = (form.get("key") or [""])[0]
    target = _local((form.get("next") or [""])[0])
    pages = _pages(request)
    try:
        found = check_key(request, key)
    except TooManyRequests as exc:
        return pages.render(
            request, "login.html", status_code=429, next=target, error=exc.message, headers=exc.headers()
        )
    if found is None or found.role != "admin":
        return pages.render(request, "login.html", status_code=401, next=target, error="That is not the admin key.")
    response = RedirectResponse(target, status_code=303, headers=_HEADERS)
    response.set_cookie(
        COOKIE,
        pages.tokens.issue(),
        max_age=int(pages.tokens.ttl_s),
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout() -> Response:
    response = RedirectResponse("/ui/login", status_code=303, headers=_HEADERS)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


@router.get("/")
async def overview(request: Request, svc: ServicesDep, pages: Pages = Viewer) -> HTMLResponse:
    versions = await svc.repo.versions.list(limit=50)
    counts = await svc.repo.browse.counts()
    rate, span = pages.rate.update(_tokens(svc))
    forks = await svc.repo.forks.by_workflow()
    return pages.render(
        request,
        "overview.html",
        versions=versions,
        counts=counts,
        rate=rate,
        rate_span=span,
        forks=forks,
        **await _canaries(svc),
    )


CANARY_DECISIONS = 10
"""Past canary decisions the overview lists, newest first."""


async def _canaries(svc: Services) -> dict[str, Any]:
    """The overview's canary panel, read through the store methods ``GET /policy/canary`` uses, so
    the page and the API show the same evidence (the test replayed over the stored rewards)."""
    canaries = svc.repo.versions.canaries
    running = await canaries.running()
    decided = await canaries.decided(limit=CANARY_DECISIONS)
    return {
        "canary_share": svc.settings.policy.canary.share,
        "canary": views.canary(running[0], running[1].evidence()) if running else None,
        "canary_decisions": [views.canary(d, d.evidence) for d in decided],
    }


def _metric(svc: Services, name: str, **labels: str) -> float | None:
    return svc.metrics.registry.get_sample_value(name, labels)


def _tokens(svc: Services) -> float:
    """Prompt and completion tokens this process relayed (0 before the first call)."""
    kinds = ("prompt", "completion")
    return sum(_metric(svc, "flywheel_tokens_total", kind=kind) or 0.0 for kind in kinds)


@router.get("/api/overview")
async def overview_data(svc: ServicesDep, pages: Pages = Viewer, since_step: int = Query(-1, ge=-1)) -> JSONResponse:
    """The live feed: trainer steps after ``since_step``, counts, and this replica's token counters and rate."""
    steps = await svc.repo.steps.list(since_step=since_step, limit=5000)
    counts = await svc.repo.browse.counts()
    rate, span = pages.rate.update(_tokens(svc))
    body = {
        "steps": [{"step": s.step, "created_at": s.created_at, "metrics": s.metrics} for s in steps],
        "episodes": counts.episodes,
        "groups": counts.groups,
        "calls": counts.calls,
        "policy_version": svc.adapters.version,
        "proxy": {
            "prompt_tokens": _metric(svc, "flywheel_tokens_total", kind="prompt"),
            "completion_tokens": _metric(svc, "flywheel_tokens_total", kind="completion"),
            "calls_recorded": _metric(svc, "flywheel_calls_recorded_total"),
            "queue_depth": svc.recorder.queue_depth,
            "tokens_per_s": round(rate, 3),
            "tokens_per_s_over_s": round(span, 3),
        },
    }
    return JSONResponse(body, headers={"cache-control": "no-store"})


def _cursor(raw: str | None) -> Cursor | None:
    """``<created_at>_<id>`` from a "next page" link; a malformed one starts at the top."""
    if not raw or "_" not in raw:
        return None
    at, _, ident = raw.partition("_")
    try:
        return float(at), ident
    except ValueError:
        return None


def _next(rows: list[Any], at: Any) -> str | None:
    """The cursor of the page after this one (None on the last page)."""
    if len(rows) < PAGE:
        return None
    last = at(rows[-1])
    return f"{last.created_at!r}_{last.id}"


@router.get("/groups")
async def groups(
    request: Request,
    svc: ServicesDep,
    pages: Pages = Viewer,
    status: GroupStatus | Blank | None = None,
    train_status: TrainStatus | Blank | None = None,
    task: str | None = None,
    after: str | None = None,
) -> HTMLResponse:
    rows = await svc.repo.browse.groups(
        status=status or None, train_status=train_status or None, task=task or None, after=_cursor(after), limit=PAGE
    )
    filters = {"status": status or "", "train_status": train_status or "", "task": task or ""}
    return pages.render(
        request, "groups.html", groups=rows, filters=filters, after=after, next=_next(rows, lambda g: g)
    )


@router.get("/groups/{group_id}")
async def compare(request: Request, group_id: str, svc: ServicesDep, pages: Pages = Viewer) -> HTMLResponse:
    """A group's episodes side by side: rewards, advantages, and each one's conversation."""
    try:
        group = await svc.repo.episodes.get_group(canonical_id(group_id, param="group_id"))
    except (NotFound, InvalidRequest):
        return pages.render(request, "missing.html", status_code=404, what="group", ident=group_id)
    members = [await svc.repo.episodes.get_episode(e.id) for e in group.episodes or []]
    return pages.render(
        request,
        "compare.html",
        group=group,
        members=members,
        conversations={e.id: views.conversation(e) for e in members},
        advantages=views.advantages(members),
    )


@router.get("/episodes")
async def episodes(
    request: Request,
    svc: ServicesDep,
    pages: Pages = Viewer,
    status: EpisodeStatus | Blank | None = None,
    task: str | None = None,
    group: str | None = None,
    after: str | None = None,
) -> HTMLResponse:
    try:
        group_id = canonical_id(group, param="group") if group else None
    except InvalidRequest:
        return pages.render(request, "missing.html", status_code=404, what="group", ident=group or "")
    rows = await svc.repo.browse.episodes(
        status=status or None, task=task or None, group_id=group_id, after=_cursor(after), limit=PAGE
    )
    filters = {"status": status or "", "task": task or "", "group": group or ""}
    return pages.render(
        request, "episodes.html", rows=rows, filters=filters, after=after, next=_next(rows, lambda r: r.episode)
    )


@router.get("/episodes/{episode_id}")
async def episode(request: Request, episode_id: str, svc: ServicesDep, pages: Pages = Viewer) -> HTMLResponse:
    try:
        record = await svc.repo.episodes.get_episode(canonical_id(episode_id))
    except (NotFound, InvalidRequest):
        return pages.render(request, "missing.html", status_code=404, what="episode", ident=episode_id)
    advantage = None
    if record.group_id is not None:
        group = await svc.repo.episodes.get_group(record.group_id)
        advantage = views.advantages(group.episodes or []).get(record.id)
    forks: dict[str, list[Any]] = {}
    for child in await svc.repo.forks.children(record.id):
        forks.setdefault(child.group_id or "", []).append(child)
    return pages.render(
        request,
        "episode.html",
        episode=record,
        calls=views.conversation(record),
        advantage=advantage,
        fidelity=ex.fidelity(record),
        forks=forks,
    )


_MEDIA = {"jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}


@router.get("/export")
async def export(
    svc: ServicesDep,
    _: Pages = Viewer,
    fmt: Annotated[ex.Format, Query(alias="format")] = "jsonl",
    status: EpisodeStatus | Blank | None = None,
    task: Annotated[str | None, Query(max_length=256)] = None,
    since: Annotated[str | None, Query(max_length=64)] = None,
) -> StreamingResponse:
    """The groups page's download: ``python -m proxy export`` streamed as the response body."""
    try:
        since_at = ex.parse_since(since) if since else None
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="since") from exc
    filters = ex.Filters(status=status or None, task=task or None, since=since_at)
    name = f"flywheel-episodes{'-' + status if status else ''}.{fmt}"
    return StreamingResponse(
        ex.stream(svc.repo, filters, fmt),
        media_type=_MEDIA[fmt],
        headers={"content-disposition": f'attachment; filename="{name}"', "cache-control": "no-store"},
    )


def install(app: FastAPI, admin_keys: str | Callable[[], Sequence[str]]) -> None:
    """Mount the dashboard on ``app``: its routes, its static files (no key) and its login redirect.
    ``admin_keys``: the key, or the accepted keys now, current first (``KeyRing.admin_keys``)."""
    app.state.ui_pages = Pages(SessionTokens(admin_keys))
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
    app.include_router(router)
    app.add_exception_handler(LoginRequired, _login_redirect)
