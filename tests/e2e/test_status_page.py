"""The status page as a person sees it: the real manager process, rendered by headless Chromium."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.domain.tokens import ping_token
from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import desire, sync_env
from tests.support.browser import browser, chromium_path
from tests.support.polling import eventually
from tests.support.process import manager
from tests.support.real_cluster import RealCluster

SPAN = r"\d+(\.\d)? (s|min|h)"  # how long an uptime share covers, as the page says it

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="chromium is not installed (`make test` installs it; apt-get install chromium)",
    ),
]

TOKEN = "page-operator-token"
GREEN, RED = "rgb(26, 127, 55)", "rgb(207, 34, 46)"
HOSTILE = "<script>document.title='owned'</script> disk full"

# Everything the test reads from the page, in one evaluation: the page reloads itself every
# second, so separate reads could come from two documents (or none, mid-reload: null).
SNAPSHOT = """(document.readyState !== 'complete' || !document.body) ? null : ({
  text: document.body.innerText,
  title: document.title,
  rows: [...document.querySelectorAll('#workloads tr[data-workload]')].map(r => ({
    name: r.dataset.workload,
    cells: [...r.cells].map(c => c.innerText),
    colour: getComputedStyle(r.querySelector('.badge')).backgroundColor,
  })),
  components: Object.fromEntries([...document.querySelectorAll('tr[data-component]')]
    .map(r => [r.dataset.component, r.cells[1].innerText])),
  results: [...document.querySelectorAll('#sync-results tr[data-result]')]
    .map(r => [...r.cells].map(c => c.innerText)),
})"""


async def ping(client: httpx.AsyncClient, name: str, body: dict[str, Any]) -> None:
    headers = {"authorization": f"Bearer {ping_token('sync-ping-secret', name)}"}
    response = await client.post(f"/v1/workloads/{name}/health", json=body, headers=headers)
    response.raise_for_status()


async def test_a_person_sees_workloads_sync_and_alerts(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> None:
    local, server = backend
    desire(local, ("api", "1.0.0"), ("worker", "1.0.0"))
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", "workloads"))
    env |= {
        "API_TOKEN": TOKEN,
        "SYNC_INTERVAL_SECONDS": "1",
        "REPORT_INTERVAL_SECONDS": "0.5",
        "STATUS_PAGE_REFRESH_SECONDS": "1",
    }
    with manager(env=env, workdir=tmp_path) as m:
        async with httpx.AsyncClient(base_url=m.url, timeout=5) as client:
            await ping(client, "api", {"status": "healthy", "version": "1.0.0"})
            await ping(
                client, "worker", {"status": "unhealthy", "version": "1.0.0", "message": HOSTILE}
            )

            async def settled() -> bool:
                auth = {"authorization": f"Bearer {TOKEN}"}
                status = (await client.get("/v1/status", headers=auth)).json()
                deployed = {
                    w["name"]: (w["status"], w["deployed_version"]) for w in status["workloads"]
                }
                rolled_out = deployed.get("api") == ("healthy", "1.0.0")
                sync_ok = status["components"]["sync"]["state"] == "ok"
                return rolled_out and sync_ok and bool(status["alerts"])

            await eventually(settled, within=20)
            assert (await client.get("/")).status_code == 401  # no token, no page

            async with browser() as page:
                basic = base64.b64encode(f"operator:{TOKEN}".encode()).decode()
                await page.call("Network.enable")
                await page.call(
                    "Network.setExtraHTTPHeaders", headers={"Authorization": f"Basic {basic}"}
                )
                await page.goto(m.url + "/")
                (tmp_path / "status-page.png").write_bytes(await page.screenshot())
                shown: dict[str, Any] = {}

                async def loaded() -> bool:
                    shown.update(await page.evaluate(SNAPSHOT) or {})
                    return bool(shown)

                await eventually(loaded, within=15, step=0.1)
                text = shown["text"]
                assert "Node node-sync" in text
                assert shown["title"] == "node-sync · workload manager"
                rows = {r["name"]: r for r in shown["rows"]}
                assert rows["api"]["cells"][1] == "healthy"
                assert rows["api"]["colour"] == GREEN
                assert rows["api"]["cells"][2].endswith("s ago")
                assert rows["worker"]["cells"][1] == "unhealthy"
                assert rows["worker"]["colour"] == RED
                assert rows["worker"]["cells"][6] == HOSTILE  # shown as text, never run
                # uptime, over the seconds observed so far (none yet right after start)
                assert re.fullmatch(
                    f"— / —|0\\.0% of {SPAN} / 0\\.0% of {SPAN}", rows["worker"]["cells"][5]
                )
                assert re.fullmatch(
                    f"— / —|100\\.0% of {SPAN} / 100\\.0% of {SPAN}", rows["api"]["cells"][5]
                )
                components = shown["components"]
                assert components["sync"] == "ok"
                assert components["report"] == "ok"
                assert "Last sync at" in text
                assert "Last change at" in text  # syncs every second: the last one changed nothing
                assert sorted(shown["results"]) == [
                    ["api", "create", "applied", "→ 1.0.0", "missing"],
                    ["worker", "create", "applied", "→ 1.0.0", "missing"],
                ]
                assert "worker is unhealthy" in text  # the alert the report loop raised

                # the page reloads by itself: a new workload appears without navigating
                await ping(client, "cache", {"status": "degraded", "message": "warming up"})

                async def reloaded() -> bool:
                    text = await page.text()  # one read: one document
                    return "warming up" in text and "Workloads (3)" in text

                await eventually(reloaded, within=15, step=0.2)
