"""SIGTERM, as the kubelet sends it, in the middle of a sync and in the middle of a job."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

from app.adapters.embedded import EmbeddedNats
from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import NAMESPACE, desire, sync_env
from tests.faults.conftest import Rig, start_manager
from tests.support.jobs_world import (
    consumer_bound,
    in_ledger,
    ledger,
    manager_env,
    publish,
    publisher,
    watching_events,
)
from tests.support.polling import eventually
from tests.support.process import ManagerProcess, manager
from tests.support.real_cluster import RealCluster


def _sigterm_mid_sync(rig: Rig, *, hang: float, times: int, grace: float) -> str:
    """Desire api 1.1.0 while its update hangs in the API server for `hang` s, send
    SIGTERM once the sync is under way, and check for a clean exit within `grace` s and an
    untouched cluster. Returns the manager's log."""
    # the first hold on a rule of its own, so that its arrival can be seen: the rule is
    # gone once the held request came in (the other `times - 1` holds are the same)
    rig.cluster.delay_next("PATCH", "/deployments/api", seconds=hang, times=1)
    if times > 1:
        rig.cluster.delay_next("PATCH", "/deployments/api", seconds=hang, times=times - 1)
    waiting = rig.cluster.delays_waiting
    rig.local.clear_records()
    desire(rig.local, ("api", "1.1.0"), ("worker", "1.0.0"))
    rig.local.wait_for(
        lambda: any("version=1.1.0" in r.target for r in rig.local.requests), timeout=15
    )
    # the manifest is in and the update is being written: it hangs in the API server
    rig.local.wait_for(lambda: rig.cluster.delays_waiting < waiting, timeout=15)
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
    assert re.search(r"waiting up to [0-9.]+ s for sync to finish", log), log
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
    assert re.search(r"cancelling \['sync'\]: still running [0-9.]+ s after shutdown", log), log
    _restart_and_converge(rig)


async def test_sigterm_during_a_slow_job_loses_nothing(
    database: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    proc = ManagerProcess(
        env=manager_env(database, nats_server.url, "node-term", "C"), workdir=tmp_path
    ).start()
    async with watching_events(nats_server.url) as events, publisher(nats_server.url) as bus:
        # the worker is up: it pulls from its tier's durable on the stream the job goes to
        await eventually(lambda: consumer_bound(nats_server.url, "MM_WRITE", 1, "wm-C"), within=30)
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


async def test_sigterm_with_everything_hanging_exits_within_the_grace_period(
    cluster: RealCluster,
    backend: tuple[LocalBackend, ThreadedServer],
    database: str,
    nats_server: EmbeddedNats,
    tmp_path: Path,
) -> None:
    """A job that would run for minutes, a backend that answers nothing and a sync stuck
    in the API server, all at once: the process still exits within SHUTDOWN_GRACE_SECONDS
    (plus a little for the interpreter to exit), and the job is handed back, not lost."""
    local, server = backend
    grace = 8.0
    desire(local, ("api", "1.0.0"))
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE)) | {
        **manager_env(database, nats_server.url, "node-sync", "C"),
        "REPORT_ENABLED": "true",
        "REPORT_INTERVAL_SECONDS": "1",
        "SYNC_INTERVAL_SECONDS": "1",
        "BACKEND_TIMEOUT_SECONDS": "30",
        "KUBE_TIMEOUT_SECONDS": "30",
        "SHUTDOWN_GRACE_SECONDS": str(grace),
    }
    proc = ManagerProcess(env=env, workdir=tmp_path).start()
    try:
        local.wait_for(lambda: ("api", "1.0.0") in [(n, b["version"]) for n, b in local.versions])
        async with publisher(nats_server.url) as bus:
            await publish(bus, tier="C", idempotency_key="endless-1",
                          payload={"delay_seconds": 300})  # fmt: skip
            await eventually(lambda: in_ledger(database, "endless-1"), within=20)
        # the backend stops answering reports, and api's update hangs in the API server
        local.fail("health", "timeout", times=None, delay=60)
        cluster.delay_next("PATCH", "/deployments/api", seconds=60, times=100)
        desire(local, ("api", "1.1.0"))
        local.wait_for(lambda: any("version=1.1.0" in r.target for r in local.requests), 15)
        started = time.monotonic()
        code = await asyncio.to_thread(proc.stop, timeout=grace + 20)
        took = time.monotonic() - started
    finally:
        local.clear_failures()
        cluster.clear_faults()
        proc.stop()
    log = proc.log()
    assert code in (0, -signal.SIGTERM), log
    assert took < grace + 1.5, f"exited after {took:.1f} s:\n{log}"
    assert "Traceback" not in log, log
    row = (await ledger(database))["endless-1"]
    assert (row["status"], row["error"]) == ("retrying", "released on shutdown"), log
    # handed back to JetStream: the next manager of the tier gets it again
    env["JOB_TIMEOUT_SECONDS"] = "0.5"
    (tmp_path / "next").mkdir()
    with manager(env=env, workdir=tmp_path / "next"):

        async def claimed_again() -> bool:
            return bool((await ledger(database))["endless-1"]["attempts"] >= 2)

        await eventually(claimed_again, within=30)
