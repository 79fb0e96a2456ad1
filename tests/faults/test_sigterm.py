"""SIGTERM, as the kubelet sends it, in the middle of a sync and in the middle of a job."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from app.adapters.embedded import EmbeddedNats
from tests.faults.conftest import Rig, start_manager
from tests.support.jobs_world import (
    in_ledger,
    ledger,
    manager_env,
    publish,
    publisher,
    watching_events,
)
from tests.support.polling import eventually
from tests.support.process import ManagerProcess
from tests.support.sync_world import desire


def _sigterm_mid_sync(rig: Rig, *, hang: float, times: int, grace: float) -> str:
    """Desire api 1.1.0 while its update hangs in the API server for `hang` s, send
    SIGTERM once the sync is under way, and check for a clean exit within `grace` s and an
    untouched cluster. Returns the manager's log."""
    rig.cluster.delay_next("PATCH", "/deployments/api", seconds=hang, times=times)
    rig.local.clear_records()
    desire(rig.local, ("api", "1.1.0"), ("worker", "1.0.0"))
    rig.local.wait_for(
        lambda: any("version=1.1.0" in r.target for r in rig.local.requests), timeout=15
    )
    time.sleep(0.3)  # the manifest is in: the update is being written
    started = time.monotonic()
    code = rig.process.stop()
    log = rig.process.log()
    assert code in (0, -signal.SIGTERM), log
    assert time.monotonic() - started < grace + 2, "exits within SHUTDOWN_GRACE_SECONDS"
    assert "Traceback" not in log and " ERROR " not in log, log
    rig.untouched()
    return log


def _restart_and_converge(rig: Rig) -> None:
    """The next start finishes the work: api at 1.1.0 and the backend told so."""
    rig.cluster.clear_faults()
    rig.process = start_manager(rig.workdir / "second", rig.backend_url, rig.cluster)
    rig.converged("1.1.0")


def test_sigterm_in_the_middle_of_a_sync_lets_it_finish_and_the_next_start_confirms(
    rig: Rig,
) -> None:
    # the first try of the update hangs for 4 s (the client gives up after 1 s and tries
    # again): the sync is mid-write, and finishes within its budget of 5 s
    log = _sigterm_mid_sync(rig, hang=4, times=1, grace=10)
    assert "waiting up to 5.0 s for sync to finish" in log, log
    assert "cancelling" not in log, log
    assert rig.image("api") == "registry.example/api:1.1.0"
    _restart_and_converge(rig)


def test_a_sync_that_outlasts_its_shutdown_budget_is_cancelled_cleanly(rig: Rig) -> None:
    rig.process.stop()
    # the Kubernetes API hangs for 30 s and the client would wait 30 s: only the
    # shutdown budget (half of SHUTDOWN_GRACE_SECONDS=4) ends the sync
    rig.process = start_manager(
        rig.workdir / "patient", rig.backend_url, rig.cluster, KUBE_TIMEOUT_SECONDS="30",
        SHUTDOWN_GRACE_SECONDS="4",
    )  # fmt: skip
    log = _sigterm_mid_sync(rig, hang=30, times=100, grace=4)
    assert "cancelling ['sync']: still running 2.0 s after shutdown began" in log, log
    _restart_and_converge(rig)


async def test_sigterm_during_a_slow_job_loses_nothing(
    database: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    proc = ManagerProcess(
        env=manager_env(database, nats_server.url, "node-term", "C"), workdir=tmp_path
    ).start()
    async with watching_events(nats_server.url) as events, publisher(nats_server.url) as bus:
        await asyncio.sleep(1.5)
        job = await publish(bus, tier="C", idempotency_key="slow-1", payload={"delay_seconds": 2})
        await eventually(lambda: in_ledger(database, "slow-1"), within=20)
        code = await asyncio.to_thread(proc.stop)
        assert code in (0, -signal.SIGTERM), proc.log()
        await events.wait_for(lambda: "node.offline" in events.kinds(), within=5)
    row = (await ledger(database))["slow-1"]
    assert (row["status"], row["attempts"]) == ("completed", 1), proc.log()
    assert "job.completed" in events.kinds("slow-1")
    kinds = events.kinds()
    assert kinds.index("node.draining") < kinds.index("job.completed") < kinds.index("node.offline")
    assert str(job.job_id) == events.of("job.completed")[0]["job_id"]
