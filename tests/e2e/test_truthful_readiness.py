"""Readiness and status say what is so now: NATS stopped under a running manager, then
started again; and a worker whose NATS never answers at start.

A real nats-server and the manager's real process. While the server is down, within
seconds: `/v1/status` shows `nats` and `worker` failing with a reason that names the
server and the client's error, `/readyz` answers 503 naming them (the settings require
both), and after `COMPONENT_DOWN_GRACE_SECONDS` one alert each; once the server is back,
both are ok, the manager is ready again, and one recovery alert each is raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from app.adapters.embedded import EmbeddedNats, free_port
from tests.support.jobs_world import worker_env
from tests.support.polling import eventually
from tests.support.process import ManagerProcess, manager

pytestmark = pytest.mark.e2e

GRACE = "2"


async def status(m: ManagerProcess) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as client:
        found: dict[str, Any] = (await client.get(f"{m.url}/v1/status")).json()
        return found


async def readiness(m: ManagerProcess) -> tuple[int, list[str]]:
    async with httpx.AsyncClient(timeout=5) as client:
        answer = await client.get(f"{m.url}/readyz")
    return answer.status_code, answer.json()["reasons"]


def alert_keys(found: dict[str, Any]) -> list[str]:
    return [alert["key"] for alert in found["alerts"]]


async def test_nats_stopped_under_a_running_manager_then_started_again(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats", port=free_port()).start()
    env = {**worker_env(server.url, "node-truth"), "COMPONENT_DOWN_GRACE_SECONDS": GRACE}
    try:
        (tmp_path / "node").mkdir()
        with manager(env=env, workdir=tmp_path / "node") as m:

            async def both(state: str) -> bool:
                components = (await status(m))["components"]
                return bool(components["nats"]["state"] == components["worker"]["state"] == state)

            await eventually(lambda: both("ok"), within=30)
            assert (await readiness(m))[0] == 200
            server.stop()
            await eventually(lambda: both("failing"), within=10)
            found = await status(m)
            for name in ("nats", "worker"):
                error = found["components"][name]["last_error"]
                assert f"127.0.0.1:{server.port}" in error, error
            code, reasons = await readiness(m)
            assert code == 503
            assert {reason.split(" ")[0] for reason in reasons} == {"nats", "worker"}

            async def alerted_down() -> bool:
                keys = alert_keys(await status(m))
                return {"nats:down", "worker:down"} <= set(keys)

            await eventually(alerted_down, within=20)
            server.start()
            await eventually(lambda: both("ok"), within=30)
            assert (await readiness(m))[0] == 200

            async def alerted_back() -> bool:
                keys = alert_keys(await status(m))
                return {"nats:recovered", "worker:recovered"} <= set(keys)

            await eventually(alerted_back, within=20)
            keys = alert_keys(await status(m))
            assert keys.count("nats:down") == keys.count("worker:down") == 1, keys
    finally:
        server.stop()


async def test_a_worker_that_cannot_connect_at_start_says_so_and_alerts(tmp_path: Path) -> None:
    nowhere = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    env = {**worker_env(nowhere, "node-alone"), "COMPONENT_DOWN_GRACE_SECONDS": GRACE}
    m = ManagerProcess(env=env, workdir=tmp_path)
    m.start(wait_ready=False)
    try:

        async def failing() -> bool:
            try:
                worker = (await status(m))["components"]["worker"]
            except httpx.HTTPError:
                return False
            return bool(worker["state"] == "failing")

        await eventually(failing, within=30)
        worker = (await status(m))["components"]["worker"]
        assert worker["last_error"].startswith(f"cannot connect to {nowhere}"), worker
        assert (await readiness(m))[0] == 503

        async def alerted() -> bool:
            return "worker:down" in alert_keys(await status(m))

        await eventually(alerted, within=20)
    finally:
        m.stop()
