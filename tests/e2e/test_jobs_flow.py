"""The job worker as whole processes: tiers, the stream CLI. Its faults: tests/faults/."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from app.adapters.embedded import EmbeddedNats
from app.adapters.kv_ledger import bucket, key_name
from app.domain.jobs import job_subject
from app.services.streams import new_job, publish_job
from standins.servers import serve
from tests.support.jobs_world import (
    EFFECT_URL,
    EffectCounter,
    at_least_completed,
    consumer_bound,
    consumer_settled,
    ledger,
    manager_env,
    publish,
    publisher,
    through_proxy,
    watching_events,
)
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
            # both workers are up once each pulls from its tier's durable on every stream
            for durable in ("wm-A", "wm-B"):
                for stream in ("MM_ONLINE", "MM_OFFLINE", "MM_WRITE"):
                    await eventually(
                        functools.partial(consumer_bound, nats_server.url, stream, 1, durable),
                        within=30,
                    )
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
        changed = cli(["init-streams"], env | {"JOB_ACK_WAIT_SECONDS": "45"}, tmp_path)
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


async def test_two_processes_on_one_tier_run_each_key_once(
    database: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """Two manager processes of one tier share the tier's durable consumer; every job is
    published twice under one key. Each key's effect happens exactly once. (Two processes
    with one NODE_ID do not share it: the second stays out of the way, see
    tests/e2e/test_second_instance.py.)"""
    counter = EffectCounter(hold=1.0)
    keys = [f"same-tier-{i}" for i in range(12)]
    extra = {
        "JOB_ACK_WAIT_SECONDS": "2",
        "JOB_HELD_DELAY_SECONDS": "0.2",
        "WORKER_CONCURRENCY": "8",
    }
    managers = []
    with serve(counter.app()) as workload:
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            env = manager_env(database, nats_server.url, f"node-twin-{name}", "A") | extra
            managers.append(
                ManagerProcess(env=env | through_proxy(workload.url), workdir=tmp_path / name)
            )
        try:
            for proc in managers:
                proc.start()
            async with publisher(nats_server.url) as bus:
                await eventually(lambda: consumer_bound(nats_server.url, "MM_WRITE", 2))
                for key in keys:
                    effect = {"url": EFFECT_URL, "body": {}}
                    job = new_job("http", idempotency_key=key, payload=effect)
                    await publish_job(bus, job, kind="write", tier="A")
                    await eventually(functools.partial(counter.started, key))
                    # the twin arrives while the first copy runs; whichever process
                    # fetches it must not run it
                    # (past NATS's duplicate window: a message id of its own)
                    twin = job.model_copy(update={"job_id": uuid.uuid4()})
                    body = twin.model_dump(mode="json", by_alias=True, exclude_none=True)
                    await bus.publish(job_subject("write", "A", "http"), body, msg_id=f"{key}/2")
                await eventually(
                    lambda: consumer_settled(nats_server.url, "MM_WRITE"), within=60, step=0.2
                )
        finally:
            logs = "".join(proc.log() for proc in managers)
            for proc in managers:
                proc.stop()
    assert counter.calls == dict.fromkeys(keys, 1), logs
    rows = await ledger(database)
    assert {k: (rows[k]["status"], rows[k]["attempts"]) for k in keys} == dict.fromkeys(
        keys, ("completed", 1)
    )


async def test_a_worker_only_node_runs_on_three_variables(tmp_path: Path) -> None:
    """The fleet's worker specification, `docker run -e NODE_ID -e TIER -e NATS_URL`, in
    production mode: no database (the ledger is the JetStream bucket), no API token (the
    status routes are closed), no backend. A job runs once; the same key again does not."""
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        # the operator's step in production: the topology, the ledger's bucket included
        made = cli(["init-streams"], {"NATS_URL": server.url}, tmp_path)
        assert made.returncode == 0, made.stderr
        assert "bucket JOB_LEDGER_C" in made.stdout
        (tmp_path / "node").mkdir()
        env = {"APP_ENV": "production", "NODE_ID": "node-2", "TIER": "C", "NATS_URL": server.url}
        node = ManagerProcess(env=env, workdir=tmp_path / "node").start()
        try:
            async with httpx.AsyncClient(base_url=node.url, timeout=5) as http:
                closed = await http.get("/v1/status")
                assert closed.status_code == 401 and "API_TOKEN" in closed.json()["detail"]
                assert (await http.get("/healthz")).status_code == 200
            async with watching_events(server.url) as events, publisher(server.url) as bus:
                await eventually(
                    lambda: consumer_bound(server.url, "MM_WRITE", 1, "wm-C"), within=30
                )
                await publish(bus, tier="C", kind="write", idempotency_key="only-once")
                await events.wait_for(lambda: "job.completed" in events.kinds("only-once"))
                await publish(bus, tier="C", kind="write", idempotency_key="only-once")
                await eventually(lambda: consumer_settled(server.url, "MM_WRITE", "wm-C"))
            assert events.kinds("only-once").count("job.completed") == 1, events.events
            record = await kv_record(server.url, "only-once")
            assert (record["status"], record["node_id"]) == ("completed", "node-2")
        finally:
            assert node.stop() in (0, -signal.SIGTERM), node.log()
        assert "worker-only node" in node.log()
        assert "closed (401: no API_TOKEN is set)" in node.log()
    finally:
        server.stop()


async def kv_record(url: str, key: str, tier: str = "C") -> dict[str, Any]:
    """The JetStream ledger's record of `key` in `tier`'s bucket, as another client reads
    it."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(bucket(tier))
        entry = await kv.get(key_name(key))
        record: dict[str, Any] = json.loads(entry.value or b"{}")
        return record
    finally:
        await nc.close()
