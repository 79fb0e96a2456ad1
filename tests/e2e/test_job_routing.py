"""Where a job runs, as whole processes: requirements (trust zone, capabilities) hand a job
on to a node that meets them instead of spending its retry budget; a job no live node can
run is dead-lettered at once; a key reused for another job is refused; a JetStream-ledger
worker does not wait for PostgreSQL. Events carry a machine-readable `code`."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from app.services.streams import new_job, publish_job
from standins.databases import fresh_database_sync
from tests.support.jobs_world import (
    consumer_bound,
    consumer_settled,
    final_events,
    ledger,
    ledger_row,
    logs,
    manager_env,
    own_nats,
    publish,
    publish_as,
    publisher,
    running_managers,
    stored_events,
    stream_exists,
    wait_final,
    watching_events,
    worker_env,
)
from tests.support.polling import eventually
from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e

JOBS = 30
# a node that cannot run a job hands it on quickly: the tests wait for the right node
NOT_HERE = {"JOB_NOT_HERE_DELAY_SECONDS": "0.2"}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def outcome(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Any, Any]]:
    """A key's final events as (kind, node, code), for comparing and for messages."""
    return [(kind, body.get("node_id"), body.get("code")) for kind, body in events]


async def test_a_job_pinned_to_a_trust_zone_is_handed_on_to_the_node_in_it(
    tmp_path: Path,
) -> None:
    """A job for trust zone z1 fetched by a node of the tier outside it is no attack: that
    node cannot run it, the tier's node in z1 can. Worker-only nodes (no registry to ask)
    hand it on until the node in the zone takes it. The consumers keep their default
    backoff, so the hand-ons run at the delays JetStream really applies to a NAK."""
    in_zone, no_zone = unique("zone-z1"), unique("zone-none")
    with own_nats(tmp_path / "nats") as server:
        envs = {
            "in-zone": worker_env(server.url, in_zone) | NOT_HERE | {"NODE_TRUST_ZONE": "z1"},
            "no-zone": worker_env(server.url, no_zone) | NOT_HERE,
        }
        with running_managers(tmp_path, envs) as procs:
            async with watching_events(server.url) as events, publisher(server.url) as bus:
                # both pull from the tier's durable: either may be delivered any job
                await eventually(
                    lambda: consumer_bound(server.url, "MM_WRITE", 2), within=60, step=0.1
                )
                keys = [unique(f"zone-{i:02d}") for i in range(JOBS)]
                for key in keys:
                    await publish(bus, idempotency_key=key, requirements={"trust_zone": "z1"})
                await wait_final(events, keys, url=server.url, within=90)
            found = {key: outcome(final_events(events, key)) for key in keys}
            wrong = {key: seen for key, seen in found.items() if seen[0][:2] != (
                "job.completed", in_zone)}  # fmt: skip
            assert wrong == {}, f"{len(wrong)} of {JOBS} not completed in zone z1: {wrong}"
            refused = [kind for kind in events.kinds() if kind in ("job.rejected", "job.dead")]
            assert refused == [], logs(procs)


@dataclass
class Fleet:
    """Three managers of tier A on one database and one nats-server; one of them has the
    capability `x`."""

    nats: EmbeddedNats
    database: str
    procs: dict[str, ManagerProcess]
    capable: str

    def logs(self) -> str:
        return logs(self.procs)

    async def ready(self) -> None:
        await eventually(
            lambda: consumer_bound(self.nats.url, "MM_WRITE", len(self.procs)),
            within=60, step=0.1,
        )  # fmt: skip


@pytest.fixture(scope="module")
def fleet(
    postgres_server: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    capable = unique("capable")
    nodes = {capable: {"NODE_CAPABILITIES": '["x"]'}, unique("plain"): {}, unique("plain"): {}}
    with own_nats(root / "nats") as server, fresh_database_sync(postgres_server.url) as database:
        settings = NOT_HERE | {
            # the retry budget, under its new name and the old one (read as its alias)
            "JOB_MAX_ATTEMPTS": "2",
            "JOB_MAX_DELIVER": "2",
            "JOB_BACKOFF_SECONDS": "0.2",
            "JOB_HELD_DELAY_SECONDS": "0.2",
            # a node stays 'online' in the registry through a few seconds of a busy
            # machine (suspect after two missed heartbeats)
            "HEARTBEAT_INTERVAL_SECONDS": "3",
        }
        envs = {
            node: manager_env(database, server.url, node, "A") | settings | extra
            for node, extra in nodes.items()
        }
        with running_managers(root, envs) as procs:
            yield Fleet(server, database, procs, capable)


async def test_a_job_needing_a_capability_runs_on_the_capable_node_within_its_budget(
    fleet: Fleet,
) -> None:
    """Two of three nodes lack the capability: a delivery to one of them is not an
    attempt. With a budget of 2 attempts every job still runs, once, on the capable node."""
    await fleet.ready()
    keys = [unique(f"cap-{i:02d}") for i in range(JOBS)]
    async with watching_events(fleet.nats.url) as events, publisher(fleet.nats.url) as bus:
        for key in keys:
            await publish(bus, idempotency_key=key, requirements={"capabilities": ["x"]})
        await wait_final(events, keys, url=fleet.nats.url, within=90)
    found = {key: outcome(final_events(events, key)) for key in keys}
    wrong = {key: seen for key, seen in found.items() if seen[0][:2] != (
        "job.completed", fleet.capable)}  # fmt: skip
    assert wrong == {}, f"{len(wrong)} of {JOBS} not completed on the capable node: {wrong}"
    rows = await ledger(fleet.database)
    assert {key: (rows[key]["status"], rows[key]["node_id"], rows[key]["attempts"])
            for key in keys} == dict.fromkeys(keys, ("completed", fleet.capable, 1))  # fmt: skip


async def test_a_job_no_live_node_can_run_is_dead_lettered_promptly(fleet: Fleet) -> None:
    """The registry shows no live node with the capability: waiting for deliveries to run
    out tells nobody anything more. The dead letter says which requirement is unmet."""
    await fleet.ready()
    key = unique("nowhere")
    async with watching_events(fleet.nats.url) as events, publisher(fleet.nats.url) as bus:
        published = time.monotonic()
        await publish(bus, idempotency_key=key, requirements={"capabilities": ["nobody-has"]})
        await wait_final(events, [key], url=fleet.nats.url, within=30)
        took = time.monotonic() - published
    [(kind, body)] = final_events(events, key)
    assert (kind, body.get("code")) == ("job.dead", "unroutable"), (body, fleet.logs())
    assert "capabilities" in body["reason"], body
    assert took < 30, took


async def test_a_key_reused_for_another_job_is_rejected_and_the_same_job_is_a_duplicate(
    fleet: Fleet,
) -> None:
    """Once a key has done its job, the same job again (a producer's retry past the
    duplicate window) is acked without running; a different job under the key (another
    payload, or another type) is refused as a conflict, not silently dropped as done."""
    await fleet.ready()
    by_payload, by_type = unique("conflict-payload"), unique("conflict-type")
    firsts = {key: new_job("noop", idempotency_key=key, payload={"n": 1})
              for key in (by_payload, by_type)}  # fmt: skip
    async with watching_events(fleet.nats.url) as events, publisher(fleet.nats.url) as bus:
        for job in firsts.values():
            await publish_job(bus, job, kind="write", tier="A")
        await wait_final(events, list(firsts), url=fleet.nats.url, within=30)
        # each gets its own message id, or JetStream's duplicate window would drop it
        # before any node saw it
        await publish_as(bus, firsts[by_payload], msg_id=f"{by_payload}/again")
        other_payload = new_job("noop", idempotency_key=by_payload, payload={"n": 2})
        await publish_as(bus, other_payload, msg_id=f"{by_payload}/other")
        other_type = new_job("http", idempotency_key=by_type, payload={"n": 1})
        await publish_as(bus, other_type, msg_id=f"{by_type}/other")
        await eventually(
            functools.partial(consumer_settled, fleet.nats.url, "MM_WRITE"), within=30, step=0.1
        )
    # the stream's own record: a final event is stored before its message is answered
    stored = [(subject.split(".", 3)[3], body) for subject, body in
              await stored_events(fleet.nats.url)]  # fmt: skip
    for key, conflicting in ((by_payload, other_payload), (by_type, other_type)):
        mine = [(kind, body) for kind, body in stored if body.get("idempotency_key") == key]
        rejected = [
            (body.get("code"), body.get("job_id")) for kind, body in mine
            if kind == "job.rejected"
        ]  # fmt: skip
        assert rejected == [("key-conflict", str(conflicting.job_id))], (key, mine)
        completed = [body["job_id"] for kind, body in mine if kind == "job.completed"]
        assert completed == [str(firsts[key].job_id)], (key, mine)
        row = await ledger_row(fleet.database, key)
        assert row is not None
        assert (row["status"], str(row["job_id"]), row["attempts"]) == (
            "completed", str(firsts[key].job_id), 1)  # fmt: skip


async def test_a_jetstream_ledger_worker_runs_jobs_while_postgres_is_unreachable(
    tmp_path: Path,
) -> None:
    """JOB_LEDGER=jetstream keeps the ledger in JetStream: the job path needs no
    PostgreSQL, even where DATABASE_URL names one (the registry) that does not answer."""
    node = unique("kv-only")
    closed = free_port()  # nothing listens there
    with own_nats(tmp_path / "nats") as server:
        env = worker_env(server.url, node) | {
            "DATABASE_URL": f"postgresql://wm:wm@127.0.0.1:{closed}/wm",
            "JOB_LEDGER": "jetstream",
        }
        (tmp_path / "m").mkdir()
        proc = ManagerProcess(env=env, workdir=tmp_path / "m").start(wait_ready=False)
        try:
            # the worker makes the topology; a job published before would go nowhere
            await eventually(lambda: stream_exists(server.url, "MM_WRITE"), within=60, step=0.1)
            keys = [unique(f"kv-{i}") for i in range(3)]
            async with watching_events(server.url) as events, publisher(server.url) as bus:
                for key in keys:
                    await publish(bus, idempotency_key=key)
                try:
                    await wait_final(events, keys, url=server.url, within=30)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}\n{proc.log()}") from None
            found = [[seen[:2] for seen in outcome(final_events(events, key))] for key in keys]
            assert found == [[("job.completed", node)]] * len(keys), proc.log()
        finally:
            proc.stop()
