"""The status page at `/`: one server-rendered HTML document, no scripts, no build.

It renders the same `Status` snapshot as `GET /v1/status`, reloads itself with a meta
refresh, and says every status in words as well as in colour. Everything that came from
outside (workload names, ping messages, errors, alert texts) is escaped; the Content
Security Policy forbids scripts and every outside resource on top of that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from html import escape
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from app.api.auth import UNAUTHORIZED, require_page_token
from app.api.deps import SettingsDep, runtime
from app.api.schemas import AlertInfo, ComponentInfo, Status, SyncInfo, WorkloadInfo
from app.api.status import StatusDep
from app.domain.uptime import DAY, HOUR, WEEK, HourShare, UptimeHistory
from app.services.features.uptime import UPTIME_RECORD

router = APIRouter(
    tags=["page"], dependencies=[Depends(require_page_token)], responses=UNAUTHORIZED
)

# results of the last sync listed on the page; the rest are counted
SYNC_ROWS = 50
# an hour of the uptime strip is "up" from this share healthy, "partly down" from the next
UP_HOUR, PART_HOUR = 0.999, 0.5

HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#1f2328;background:#fff}
h1{font-size:1.3rem;margin:0 0 .2rem}h2{font-size:1.05rem;margin:1.6rem 0 .4rem}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.3rem .6rem;border-bottom:1px solid #d0d7de;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
.meta{color:#59636e}.empty{color:#59636e;font-style:italic}
.badge{display:inline-block;padding:.05rem .5rem;border-radius:1rem;font-weight:600;color:#fff}
.s-healthy,.s-ok,.s-applied{background:#1a7f37}
.s-degraded,.s-starting,.s-rolling-out,.s-held,.s-planned{background:#9a6700}
.s-unhealthy,.s-failed,.s-failing,.s-aborted,.s-crashlooping{background:#cf222e}
.s-stale{background:#bc4c00}
.s-unknown,.s-missing,.s-off,.s-unchanged{background:#6e7781}
code{font-size:.9em}
.strip{display:flex;gap:1px;margin-top:.25rem}
.strip i{display:inline-block;width:6px;height:14px;background:#d0d7de}
.strip i.u-up{background:#1a7f37}.strip i.u-part{background:#9a6700}
.strip i.u-down{background:#cf222e}.strip i.restarted{box-shadow:inset 0 4px #1f2328}
"""


def _text(value: object) -> str:
    return escape("" if value is None else str(value))


def _badge(state: str) -> str:
    slug = "".join(c if c.isalnum() or c == "-" else "-" for c in state.lower())
    return f'<span class="badge s-{slug}">{_text(state)}</span>'


def _when(at: datetime | str | None) -> str:
    if at is None:
        return "—"
    if isinstance(at, str):
        return _text(at)
    return _text(at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7_200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3_600:.1f} h"
    return f"{seconds / 86_400:.1f} d"


def _age(seconds: float | None) -> str:
    return "never" if seconds is None else f"{_duration(seconds)} ago"


def _table(headers: Iterable[str], rows: list[str], empty: str, table_id: str) -> str:
    if not rows:
        return f'<p class="empty" id="{table_id}">{_text(empty)}</p>'
    head = "".join(f"<th>{_text(h)}</th>" for h in headers)
    return f'<table id="{table_id}"><tr>{head}</tr>{"".join(rows)}</table>'


def _components(components: Mapping[str, ComponentInfo]) -> str:
    rows = []
    for name, c in components.items():
        problem = ""
        if c.last_error:
            problem = f"{_text(c.last_error)} ({c.consecutive_failures} in a row)"
        rows.append(
            f'<tr data-component="{_text(name)}"><td>{_text(name)}</td>'
            f"<td>{_badge(c.state)}</td><td>{_text(c.reason)}</td>"
            f"<td>{_when(c.last_success_at)}</td><td>{problem}</td></tr>"
        )
    headers = ("component", "state", "why", "last success", "last error")
    return _table(headers, rows, "no components", "components")


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _covered(share: float | None, observed: float, window: float) -> str:
    """A share with the time it covers when that is less than the window: a workload
    seen for 39 s is "100.0% of 39 s", not a week's 100 %."""
    if share is None:
        return "—"
    return _share(share) if observed >= window else f"{_share(share)} of {_duration(observed)}"


def _strip(hours: tuple[HourShare, ...]) -> str:
    """The last 24 clock hours as a row of cells, each in words too (its title, and the
    row's label for screen readers); an hour with a restart has a dark bar on top."""
    cells, counts, restarts = [], {"up": 0, "part": 0, "down": 0, "none": 0}, 0
    for h in hours:
        at = datetime.fromtimestamp(h.hour * HOUR, UTC).strftime("%H:00 UTC")
        if h.observed <= 0:
            kind, says = "none", "no data"
        else:
            share = h.healthy / h.observed
            kind = "up" if share >= UP_HOUR else "part" if share >= PART_HOUR else "down"
            says = f"{_share(share)} of {_duration(h.observed)}"
        counts[kind] += 1
        marks = f"u-{kind}"
        if h.restarts:
            restarts += h.restarts
            marks += " restarted"
            says += f"; restarted {h.restarts} times" if h.restarts > 1 else "; restarted once"
        cells.append(f'<i class="{marks}" title="{at}: {says}"></i>')
    label = (
        f"last 24 h, hour by hour: {counts['up']} up, {counts['part']} partly down, "
        f"{counts['down']} mostly down, {counts['none']} without data; "
        f"{restarts} restarts"
    )
    return f'<span class="strip" role="img" aria-label="{label}">{"".join(cells)}</span>'


def _uptime(w: WorkloadInfo, history: UptimeHistory | None) -> str:
    if history is None:
        return f"{_share(w.uptime_24h)} / {_share(w.uptime_7d)}"
    day = _covered(history.day, history.day_observed, DAY)
    week = _covered(history.week, history.week_observed, WEEK)
    seen = any(h.observed > 0 for h in history.hours)
    return f"{day} / {week}{_strip(history.hours) if seen else ''}"


def _workloads(workloads: list[WorkloadInfo], uptime: Callable[[str], UptimeHistory | None]) -> str:
    rows = []
    for w in workloads:
        rollout = _text(w.rollout or "")
        versions = _text(w.version or "—")
        if w.desired_version and w.desired_version != w.version:
            versions += f" <span class='meta'>(desired {_text(w.desired_version)})</span>"
        if w.update is not None and w.update.state not in ("current", "healthy"):
            update = w.update
            failed = (
                f"; failed here: {', '.join(update.failed_versions)}"
                if update.failed_versions
                else ""
            )
            rollout += (
                f' <span class="meta" data-update="{_text(update.state)}" '
                f'title="{_text(update.reason + failed)}">update {_text(update.target)}: '
                f"{_text(update.state)} ({_text(update.reason)})</span>"
            )
        rows.append(
            f'<tr data-workload="{_text(w.name)}"><td>{_text(w.name)}</td>'
            f"<td>{_badge(w.status)}</td><td>{_age(w.ping_age_seconds)}</td>"
            f"<td>{versions}</td><td>{rollout}</td>"
            f"<td>{_uptime(w, uptime(w.name))}</td>"
            f"<td>{_text(w.message)}</td></tr>"
        )
    headers = (
        "workload",
        "status",
        "last ping",
        "version",
        "rollout",
        "uptime 24 h / 7 d",
        "message",
    )
    return _table(headers, rows, "no workload has pinged or is desired yet", "workloads")


def _run(label: str, run: dict[str, Any], element_id: str) -> str:
    if run["aborted"]:
        outcome = f"{_badge('aborted')} {_text(run['aborted'])}"
    else:
        outcome = _badge("ok" if run["ok"] else "failed")
    counts = ", ".join(f"{_text(k)} {v}" for k, v in sorted(run["counts"].items())) or "nothing"
    kind = " (dry run)" if run["dry_run"] else ""
    return (
        f'<p id="{element_id}">{label}{kind} at {_when(run["started_at"])}, took '
        f"{run['duration_seconds']:.2f} s: {outcome} — {counts}.</p>"
    )


def _sync(sync: SyncInfo) -> str:
    schedule = (
        f'<p class="meta">every {sync.interval_seconds:g} s; next at {_when(sync.next_at)}</p>'
    )
    source = ""
    if sync.desired is not None:
        offline = sync.desired.get("offline_since") is not None
        mark = _badge("offline") + " " if offline else ""
        source = f'<p id="sync-source">{mark}desired state: {_text(sync.desired["text"])}</p>'
    last: dict[str, Any] | None = sync.last
    if last is None:
        return f'{schedule}{source}<p class="empty" id="sync">no sync yet</p>'
    parts = [schedule, source, _run("Last sync", last, "sync")]
    change: dict[str, Any] = sync.last_change or last
    if change["started_at"] != last["started_at"]:
        parts.append(_run("Last change", change, "sync-change"))
    changes = [r for r in change["results"] if r["action"] != "noop" or r["outcome"] == "failed"]
    rows = [
        f'<tr data-result="{_text(r["name"])}"><td>{_text(r["name"])}</td>'
        f"<td>{_text(r['action'])}</td><td>{_badge(r['outcome'])}</td>"
        f"<td>{_text(r['from_version'] or '')} → {_text(r['version'] or '')}</td>"
        f"<td>{_text(r['error'] or r['reason'])}</td></tr>"
        for r in changes[:SYNC_ROWS]
    ]
    parts.append(
        _table(
            ("workload", "action", "outcome", "version", "why"),
            rows,
            "every managed workload was up to date",
            "sync-results",
        )
    )
    if len(changes) > SYNC_ROWS:
        parts.append(f'<p class="meta">and {len(changes) - SYNC_ROWS} more (see /v1/status)</p>')
    return "".join(parts)


def _alerts(alerts: list[AlertInfo]) -> str:
    rows = [f"<tr><td>{_when(a.at)}</td><td>{_text(a.text)}</td></tr>" for a in alerts]
    return _table(("raised", "alert"), rows, "no alerts since start", "alerts")


def render(
    status: Status,
    *,
    refresh_seconds: int,
    now: datetime,
    uptime: Callable[[str], UptimeHistory | None] = lambda _name: None,
) -> str:
    node = status.node
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{refresh_seconds}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_text(node.id)} · workload manager</title><style>{STYLE}</style></head>
<body>
<h1>Node <span id="node-id">{_text(node.id)}</span></h1>
<p class="meta">workload manager {_text(node.version)} · {_text(node.env)} ·
namespace {_text(node.managed_namespace)} · up {_duration(node.uptime_seconds)} ·
page at {_when(now)}, reloads every {refresh_seconds} s ·
<a href="/v1/status">JSON</a> · <a href="/metrics">metrics</a></p>
<h2>Workloads ({len(status.workloads)})</h2>{_workloads(status.workloads, uptime)}
<h2>Components</h2>{_components(status.components)}
<h2>Deployment sync</h2>{_sync(status.sync)}
<h2>Recent alerts</h2>{_alerts(status.alerts)}
</body></html>
"""


def _uptime_history(request: Request) -> Callable[[str], UptimeHistory | None]:
    record = runtime(request).get(UPTIME_RECORD)
    return record.recorder.history if record is not None else lambda _name: None


@router.get("/", response_class=HTMLResponse, summary="Status page for people")
async def status_page(
    status: StatusDep,
    settings: SettingsDep,
    uptime: Annotated[Callable[[str], UptimeHistory | None], Depends(_uptime_history)],
) -> HTMLResponse:
    body = render(
        status,
        refresh_seconds=settings.status_page_refresh_seconds,
        now=datetime.now(UTC),
        uptime=uptime,
    )
    return HTMLResponse(body, headers=HEADERS)
