"""A second manager for a node that one already serves, as a newcomer starts one: on the
port the first holds (`make run` twice), or on another port with the same node id. The
second must neither start its components nor mark the first's node offline."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.polling import eventually
from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e

NODE = "node-held"


async def _row(url: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        return await conn.fetchrow(
            "SELECT status, last_heartbeat FROM worker_capabilities WHERE node_id = $1", NODE
        )
    except asyncpg.UndefinedTableError:
        return None
    finally:
        await conn.close()


def _workdir(base: Path, name: str) -> Path:
    (base / name).mkdir()
    return base / name


def _env(database: str) -> dict[str, str]:
    return {
        "DATABASE_URL": database,
        "NODE_ID": NODE,
        "NODE_TIER": "B",
        "HEARTBEAT_INTERVAL_SECONDS": "1",
        "WORKER_ENABLED": "false",
        "SYNC_ENABLED": "false",
    }


async def _online_and_beating(url: str, after: object = None) -> bool:
    row = await _row(url)
    return row is not None and row["status"] == "online" and row["last_heartbeat"] != after


async def test_a_second_manager_on_a_busy_port_exits_before_anything_registers(
    tmp_path: Path, database: str
) -> None:
    first = ManagerProcess(env=_env(database), workdir=_workdir(tmp_path, "first")).start()
    try:
        await eventually(lambda: _online_and_beating(database))
        second = ManagerProcess(
            env={**_env(database), "PORT": str(first.port)}, workdir=_workdir(tmp_path, "second")
        ).start(wait_ready=False)
        try:
            code = second.wait(timeout=30)
        except subprocess.TimeoutExpired:
            second.stop()
            raise
        log = second.log()
        assert code != 0, log
        assert f"127.0.0.1:{first.port}" in log and "in use" in log, log
        assert "registered node" not in log and "components on" not in log, log
        assert "Traceback" not in log, log
        row = await _row(database)
        assert row is not None and row["status"] == "online"
        # the first goes on heartbeating as `online`
        await eventually(lambda: _online_and_beating(database, row["last_heartbeat"]))
    finally:
        first.stop()


async def test_a_second_live_instance_of_a_node_never_marks_it_offline(
    tmp_path: Path, database: str
) -> None:
    first = ManagerProcess(env=_env(database), workdir=_workdir(tmp_path, "first")).start()
    try:
        await eventually(lambda: _online_and_beating(database))
        second = ManagerProcess(env=_env(database), workdir=_workdir(tmp_path, "second")).start()

        async def registry() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=5) as client:
                found: dict[str, Any] = (await client.get(f"{second.url}/v1/status")).json()
            return found["components"]["registry"]  # type: ignore[no-any-return]

        async def on_standby() -> bool:
            return "held by another live instance" in (await registry())["detail"].get(
                "standby", ""
            )

        try:
            await eventually(on_standby, within=20)
            # standing by is not failing: it is ready (a self-update's new pod waits so for
            # the old one to go, which it does only once the new one is ready)
            assert (await registry())["state"] != "failing"
            async with httpx.AsyncClient(timeout=5) as client:
                assert (await client.get(f"{second.url}/readyz")).status_code == 200
        finally:
            second.stop()
        log = second.log()
        assert "held by another live instance" in log, log
        row = await _row(database)
        assert row is not None and row["status"] == "online", second.log()
        await eventually(lambda: _online_and_beating(database, row["last_heartbeat"]))
    finally:
        first.stop()
