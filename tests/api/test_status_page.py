"""The HTML status page: who may see it, what it shows, and that nothing on it can run."""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from app.api.page import SYNC_ROWS, render
from app.api.schemas import NodeInfo, ReportInfo, Status, SyncInfo, WorkloadInfo
from app.domain.reports import UpdateView
from app.domain.uptime import DAY, HOUR, UptimeRecord
from app.main import create_app
from app.services.features.uptime import UPTIME_RECORD
from app.services.last_good import Origin
from app.services.runtime import Runtime
from tests.conftest import SettingsFactory, running, runtime_of

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, 401),
        ("Bearer wrong", 401),
        (basic("anyone", "wrong"), 401),
        (basic("anyone", ""), 401),
        ("Basic not-base64!", 401),
        ("Bearer page-token-1", 200),
        (basic("anyone", "page-token-1"), 200),
    ],
)
async def test_the_page_takes_the_operator_token_as_bearer_or_basic_password(
    make_settings: SettingsFactory, header: str | None, expected: int
) -> None:
    app = create_app(make_settings(api_token="page-token-1"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as c:
        response = await c.get("/", headers={"authorization": header} if header else {})
    assert response.status_code == expected
    if expected == 401:
        # a browser answers this challenge with a password prompt
        assert response.headers["www-authenticate"].startswith('Basic realm="workload manager"')


async def test_the_json_behind_the_page_link_takes_the_browsers_basic_password(
    make_settings: SettingsFactory,
) -> None:
    app = create_app(make_settings(api_token="page-token-1"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as c:
        ok = await c.get("/v1/status", headers={"authorization": basic("me", "page-token-1")})
        wrong = await c.get("/v1/status", headers={"authorization": basic("me", "nope")})
    assert ok.status_code == 200
    assert (wrong.status_code, wrong.headers["www-authenticate"]) == (401, "Bearer")


async def test_the_page_escapes_what_workloads_send_and_forbids_scripts(
    client: httpx.AsyncClient,
) -> None:
    hostile = '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    await client.post("/v1/workloads/api/health", json={"status": "degraded", "message": hostile})
    response = await client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "script-src" not in response.headers["content-security-policy"]
    assert response.headers["content-security-policy"].startswith("default-src 'none'")
    assert hostile not in response.text
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in response.text
    assert '<span class="badge s-degraded">degraded</span>' in response.text


async def test_recent_alerts_are_in_the_status_newest_first(
    client: httpx.AsyncClient, app: Any
) -> None:
    rt: Runtime = app.state.runtime
    rt.alerts.alert("workload:api:stale", "workload api is stale")
    rt.alerts.alert("sync:failing", "deployment sync failed 3 times in a row")
    alerts = (await client.get("/v1/status")).json()["alerts"]
    assert [a["key"] for a in alerts] == ["sync:failing", "workload:api:stale"]
    assert alerts[1]["text"].endswith("workload api is stale")
    assert alerts[0]["at"].endswith("Z")
    assert "deployment sync failed 3 times in a row" in (await client.get("/")).text


def status_with(last: dict[str, Any] | None, change: dict[str, Any] | None = None) -> Status:
    return Status(
        node=NodeInfo(
            id="n1",
            version="1.0.0",
            env="production",
            started_at=NOW,
            uptime_seconds=200_000,
            managed_namespace="workloads",
        ),
        components={},
        tasks={},
        workloads=[],
        report=ReportInfo(
            interval_seconds=60, next_at=None, last_reported_at=None, last_workload_count=None
        ),
        sync=SyncInfo(interval_seconds=600, next_at=None, last=last, last_change=change),
        alerts=[],
    )


def run(at: datetime, results: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r["action"]] = counts.get(r["action"], 0) + 1
    return {
        "started_at": at,
        "duration_seconds": 0.25,
        "dry_run": False,
        "ok": True,
        "aborted": None,
        "counts": counts,
        "results": results,
    } | over


def result(name: str, action: str, outcome: str = "applied") -> dict[str, Any]:
    return {
        "name": name,
        "action": action,
        "outcome": outcome,
        "version": "2",
        "from_version": "1",
        "reason": "outdated",
        "error": None,
    }


@pytest.mark.parametrize(
    ("last", "change", "shown", "hidden"),
    [
        (None, None, ["no sync yet", "every 600 s"], ["Last sync"]),
        (
            run(NOW, [result("api", "noop", "unchanged")]),
            None,
            ["Last sync at 2026-11-29 12:00:00 UTC", "noop 1", "every managed workload was up"],
            ["Last change"],
        ),
        (
            run(NOW, [result("api", "noop", "unchanged")]),
            run(NOW - timedelta(minutes=10), [result("api", "update")]),
            ["Last change at 2026-11-29 11:50:00 UTC", 'data-result="api"', "1 → 2"],
            ["every managed workload was up"],
        ),
        (
            run(NOW, [], aborted="backend unreachable: timed out", ok=False),
            None,
            ['class="badge s-aborted"', "backend unreachable: timed out"],
            ['class="badge s-ok"'],
        ),
        (
            run(NOW, [result(f"w{i:03}", "create") for i in range(SYNC_ROWS + 7)]),
            None,
            ["and 7 more (see /v1/status)", f"w{SYNC_ROWS - 1:03}"],
            [f"w{SYNC_ROWS:03}"],
        ),
        (
            run(NOW, [result("api", "update", "planned")], dry_run=True),
            None,
            ["Last sync (dry run) at"],
            [],
        ),
    ],
)
def test_the_sync_section_shows_the_last_run_and_the_last_change(
    last: dict[str, Any] | None, change: dict[str, Any] | None, shown: list[str], hidden: list[str]
) -> None:
    page = render(status_with(last, change), refresh_seconds=7, now=NOW)
    assert '<meta http-equiv="refresh" content="7">' in page
    assert "up 2.3 d" in page
    for text in shown:
        assert text in page
    for text in hidden:
        assert text not in page


def test_the_sync_section_says_where_the_desired_state_came_from() -> None:
    stored = NOW - timedelta(hours=3)
    away = Origin("last good", 42, stored, NOW - timedelta(minutes=5), "ConnectError: <refused>")
    status = status_with(run(NOW, [result("api", "noop", "unchanged")]))
    status.sync.desired = away.as_dict(NOW)
    page = render(status, refresh_seconds=7, now=NOW)
    assert (
        '<p id="sync-source"><span class="badge s-offline">offline</span> desired state: '
        "last good, serial 42, stored 3 h ago; backend unreachable since "
        "2026-11-29T11:55:00Z: ConnectError: &lt;refused&gt;</p>"
    ) in page
    status.sync.desired = Origin("backend", 43, NOW).as_dict(NOW)
    page = render(status, refresh_seconds=7, now=NOW)
    assert '<p id="sync-source">desired state: backend, serial 43, stored 0 s ago</p>' in page


def workload(name: str, status: str = "healthy") -> WorkloadInfo:
    return WorkloadInfo(
        name=name, status=status, version="1", message=None, last_ping_at=None,
        ping_age_seconds=1.0, desired_version=None, deployed_version=None, rollout=None,
    )  # fmt: skip


def uptime_cell(page: str, name: str) -> str:
    row = page.split(f'data-workload="{name}"', 1)[1].split("</tr>", 1)[0]
    return row.split("<td>")[6].split("</td>", 1)[0]


def test_uptime_says_how_long_it_covers_and_shows_the_last_24_hours() -> None:
    """A workload healthy since it was first seen, 39 s ago, is "100.0% of 39 s" (not
    0.0 %, not a week's 100 %); a week with one bad hour shows that hour in red, in words
    too; a workload without data shows no share and no strip."""
    now = 1_000 * HOUR + 30 * 60.0  # half past a clock hour
    record = UptimeRecord()
    record.observe({"new": "healthy"}, start=now - 39, end=now)
    bad = 996 * HOUR  # the clock hour 12:00 UTC of that day, bad from start to end
    record.observe({"old": "healthy"}, start=now - 8 * DAY, end=bad)
    record.observe({"old": "crashlooping"}, start=bad, end=bad + HOUR)
    record.observe({"old": "healthy"}, start=bad + HOUR, end=now)
    record.restarted("old", at=bad + 200)
    record.restarted("old", at=bad + 900)
    status = status_with(None).model_copy(
        update={"workloads": [workload("new"), workload("old"), workload("quiet", "unknown")]}
    )
    page = render(
        status, refresh_seconds=7, now=NOW,
        uptime=lambda name: record.history(name, now=now),
    )  # fmt: skip
    new = uptime_cell(page, "new")
    assert new.startswith('100.0% of 39 s / 100.0% of 39 s<span class="strip"')
    assert new.count("<i ") == 24 and new.count('class="u-up"') == 1
    assert "23 without data" in new
    old = uptime_cell(page, "old")
    # 24.5 h observed in the window's hours, one bad; the week is whole: no "of"
    assert old.startswith('95.9% / 99.4%<span class="strip"')
    assert old.count('class="u-down') == 1
    assert (
        '<i class="u-down restarted" title="12:00 UTC: 0.0% of 60 min; restarted 2 times">' in old
    )
    assert "23 up, 0 partly down, 1 mostly down, 0 without data; 2 restarts" in old
    assert uptime_cell(page, "quiet") == "— / —"


async def test_the_page_shows_the_managers_own_uptime_record(
    make_settings: SettingsFactory,
) -> None:
    app = create_app(make_settings(api_token="page-token-1", report_enabled=False))
    async with running(app) as client:
        rt = runtime_of(app)
        recording = rt.get(UPTIME_RECORD)
        assert recording is not None
        auth = {"authorization": "Bearer page-token-1"}
        await client.post("/v1/workloads/api/health", json={"status": "healthy"}, headers=auth)
        now = time.time()
        recording.recorder.record.observe({"api": "healthy"}, start=now - 39, end=now)
        cell = uptime_cell((await client.get("/", headers=auth)).text, "api")
    assert cell.startswith('100.0% of 39 s / 100.0% of 39 s<span class="strip"')


async def test_an_update_in_progress_shows_in_the_status_and_on_the_page(
    client: httpx.AsyncClient, app: Any
) -> None:
    book = runtime_of(app).book
    book.set_desired({"api": "1.3.0", "web": "2.0.0"})
    since = datetime(2026, 1, 1, 3, tzinfo=UTC)
    book.set_updates({
        "api": UpdateView("1.3.0", "rolled-back", since,
                          "1.3.0 failed: unhealthy pings from 1.3.0 for 60 s", 12.5, ("1.3.0",)),
        "web": UpdateView("2.0.0", "waiting-wave", since, "place 37.2 ≥ 20 %", 37.25),
    })  # fmt: skip
    status = (await client.get("/v1/status")).json()
    shown = {w["name"]: w["update"] for w in status["workloads"]}
    assert shown["web"] == {
        "target": "2.0.0", "state": "waiting-wave", "since": "2026-01-01T03:00:00Z",
        "reason": "place 37.2 ≥ 20 %", "place": 37.25, "failed_versions": [],
    }  # fmt: skip
    assert shown["api"]["failed_versions"] == ["1.3.0"]
    page = (await client.get("/")).text
    assert 'data-update="rolled-back"' in page and 'data-update="waiting-wave"' in page
    assert "update 2.0.0: waiting-wave (place 37.2 ≥ 20 %)" in page
