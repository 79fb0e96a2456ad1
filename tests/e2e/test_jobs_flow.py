"""The job worker as whole processes: tiers, the stream CLI. Its faults: tests/faults/."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.adapters.embedded import EmbeddedNats
from tests.support.jobs_world import at_least_completed, ledger, manager_env, publish, publisher
from tests.support.polling import eventually
from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e


async def test_two_managers_of_different_tiers_each_run_only_their_jobs(
    database: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = ManagerProcess(
        env=manager_env(database, nats_server.url, "node-a", "A"), workdir=tmp_path / "a"
    )
    b = ManagerProcess(
        env=manager_env(database, nats_server.url, "node-b", "B"), workdir=tmp_path / "b"
    )
    a.start()
    b.start()
    try:
        async with publisher(nats_server.url) as bus:
            # both consumers exist once both workers are up; wait for them via the ledger
            await asyncio.sleep(2.0)
            for i in range(10):
                await publish(bus, tier="A", kind="online", idempotency_key=f"tier-a-{i}")
                await publish(bus, tier="B", kind="offline", idempotency_key=f"tier-b-{i}")
            await eventually(lambda: at_least_completed(database, 20), within=30, step=0.1)
    finally:
        a.stop()
        b.stop()
    rows = await ledger(database)
    assert {k: r["node_id"] for k, r in rows.items()} == {
        **{f"tier-a-{i}": "node-a" for i in range(10)},
        **{f"tier-b-{i}": "node-b" for i in range(10)},
    }, a.log() + b.log()


def cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(cwd), **env},
        cwd=cwd, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_init_streams_is_idempotent_and_publish_reaches_the_stream(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        env = {"NATS_URL": server.url}
        first = cli(["init-streams"], env, tmp_path)
        assert first.returncode == 0, first.stderr
        assert "created    stream MM_WRITE" in first.stdout
        assert "created    consumer MM_WRITE/wm-A" in first.stdout
        again = cli(["init-streams"], env, tmp_path)
        assert again.returncode == 0
        assert {line.split()[0] for line in again.stdout.splitlines()} == {"unchanged"}
        changed = cli(["init-streams"], env | {"JOB_MAX_DELIVER": "7"}, tmp_path)
        assert "updated    consumer MM_ONLINE/wm-B" in changed.stdout
        sent = cli(["publish", "--kind", "write", "--tier", "B", "--type", "memory.write",
                    "--payload", '{"text": "hi"}', "--key", "k-1"], env, tmp_path)  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        assert "(key k-1) as stream sequence 1" in sent.stdout
        bad = cli(
            ["publish", "--kind", "write", "--tier", "B", "--type", "Bad Type"], env, tmp_path
        )
        assert bad.returncode == 2 and "invalid job" in bad.stderr
    finally:
        server.stop()
