"""Worker-only nodes with NATS credentials, as whole processes against a nats-server with
nkey users and per-tier permissions: a tier-C node with its own seed file runs tier-C
jobs; a node configured for tier A with tier C's credentials stays up and says why it
cannot work (in /v1/status and the log), retrying with backoff instead of crash-looping."""

from __future__ import annotations

import functools
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.adapters.bus import JetStreamBus
from app.adapters.embedded import EmbeddedNats
from app.domain.nats_servers import NatsServers
from app.services.streams import init_streams
from app.settings import Settings
from tests.support.jobs_world import consumer_bound, publish, watching_events
from tests.support.nats_auth import NkeyUser, new_nkey_user, operator_url, start_server
from tests.support.polling import eventually
from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[EmbeddedNats, dict[str, NkeyUser]]]:
    keys = tmp_path / "keys"
    keys.mkdir()
    users = {tier: new_nkey_user(keys, f"tier-{tier}") for tier in ("A", "C")}
    server = start_server(tmp_path / "nats", users)
    try:
        yield server, users
    finally:
        server.stop()


async def operator_bus(server: EmbeddedNats) -> JetStreamBus:
    bus = JetStreamBus(NatsServers.parse(operator_url(server)), name="operator", timeout=5)
    await bus.connect()
    await init_streams(bus, Settings(_env_file=None))  # the operator's step
    return bus


def worker_env(server: EmbeddedNats, tier: str, seed: Path) -> dict[str, str]:
    return {
        "APP_ENV": "production", "NODE_ID": f"node-{tier.lower()}", "TIER": tier,
        "NATS_URL": server.url, "NATS_NKEY_SEED_FILE": str(seed),
    }  # fmt: skip


async def test_a_node_with_its_tiers_seed_file_runs_its_jobs(
    secured: tuple[EmbeddedNats, dict[str, NkeyUser]], tmp_path: Path
) -> None:
    server, users = secured
    bus = await operator_bus(server)
    (tmp_path / "node").mkdir()
    node = ManagerProcess(
        env=worker_env(server, "C", users["C"].seed_file), workdir=tmp_path / "node"
    ).start()
    try:
        async with watching_events(operator_url(server)) as events:
            await eventually(
                functools.partial(consumer_bound, operator_url(server), "MM_WRITE", 1, "wm-C"),
                within=30,
            )
            await publish(bus, tier="C", kind="write", idempotency_key="with-creds")
            await events.wait_for(lambda: "job.completed" in events.kinds("with-creds"))
    finally:
        await bus.drain()
        assert node.stop() in (0, -signal.SIGTERM), node.log()
    assert users["C"].seed_file.read_text().strip() not in node.log(), "the seed is secret"


async def test_another_tiers_credentials_are_a_clear_error_not_a_crash_loop(
    secured: tuple[EmbeddedNats, dict[str, NkeyUser]], tmp_path: Path
) -> None:
    server, users = secured
    bus = await operator_bus(server)
    await bus.drain()
    (tmp_path / "node").mkdir()
    env = {**worker_env(server, "A", users["C"].seed_file), "API_TOKEN": "operator-token"}
    node = ManagerProcess(env=env, workdir=tmp_path / "node").start()
    try:
        async with httpx.AsyncClient(
            base_url=node.url, timeout=5, headers={"Authorization": "Bearer operator-token"}
        ) as http:

            async def refused() -> bool:
                worker = (await http.get("/v1/status")).json()["components"]["worker"]
                return "denied this node a subject" in (worker.get("last_error") or "")

            await eventually(refused, within=30, step=0.2)
            status: dict[str, Any] = (await http.get("/v1/status")).json()
            task = status["tasks"]["job-worker"]
            assert task["state"] in ("restarting", "running"), task
            assert "wm-a" in status["components"]["worker"]["last_error"].lower()
        assert node.running, "a refusal is retried with backoff, the process stays up"
    finally:
        assert node.stop() in (0, -signal.SIGTERM), node.log()
    assert node.log().count("NATS denied this node a subject") >= 1
