"""The job worker in the manager's lifespan, against a real nats-server and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import nats
import psutil
import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.adapters.registry import AsyncpgRegistry
from app.domain.requirements import NodeProfile
from app.main import create_app
from app.services.streams import init_streams, new_job
from standins.servers import serve
from tests.conftest import SettingsFactory, running, runtime_of, worker_of
from tests.support.jobs_world import (
    EFFECT_URL,
    EventLog,
    consumer_settled,
    ledger,
    publish,
    publisher,
    stored_events,
    watching_events,
    watching_naks,
)
from tests.support.polling import eventually

NODE = "node-worker-a"


@pytest.fixture
def nats_url(tmp_path: Path) -> Any:
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server.url
    server.stop()


def worker_settings(database: str, nats_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "database_url": database,
        "nats_url": nats_url,
        "node_id": NODE,
        "node_tier": "A",
        "node_region": "eu",
        "node_trust_zone": "z1",
        "node_capabilities": ["embeddings"],
        "heartbeat_interval_seconds": 0.5,
        "worker_concurrency": 4,
        "job_ack_wait_seconds": 2.0,
        "job_max_attempts": 3,
        "job_backoff_seconds": [0.2, 0.4],
        "job_not_here_delay_seconds": 0.2,
        "job_held_delay_seconds": 0.2,
        "shutdown_grace_seconds": 10.0,
        **extra,
    }


@pytest.fixture
async def manager(
    make_settings: SettingsFactory, database: str, nats_url: str
) -> AsyncIterator[FastAPI]:
    app = create_app(make_settings(**worker_settings(database, nats_url)))
    async with running(app):
        await _worker_ready(app)
        yield app


async def test_a_noop_job_completes_once(manager: FastAPI, database: str, nats_url: str) -> None:
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, payload={"x": 1})
        await events.wait_for(lambda: "job.completed" in events.kinds())
    (completed,) = events.of("job.completed")
    assert completed["job_id"] == str(job.job_id)
    assert completed["node_id"] == NODE
    assert completed["result"] == {"noop": True, "delivered": 1}
    row = (await ledger(database))[job.idempotency_key]
    assert (row["status"], row["attempts"], row["node_id"]) == ("completed", 1, NODE)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json", "payload is not JSON"),
        (b'{"schema": "job/v1"}', "job_id: Field required"),
        (b'{"schema": "job/v2", "job_id": "x"}', "schema"),
    ],
)
async def test_an_invalid_job_is_terminated_with_an_event(
    manager: FastAPI, database: str, nats_url: str, raw: bytes, reason: str
) -> None:
    import nats

    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        nc = await nats.connect(nats_url)
        await nc.jetstream().publish("mm.write.A.noop", raw)
        await nc.close()
        await events.wait_for(lambda: "job.rejected" in events.kinds())
        # the consumer is not stuck: the next job still runs
        job = await publish(bus)
        await events.wait_for(lambda: "job.completed" in events.kinds(job.idempotency_key))
    assert reason in events.of("job.rejected")[0]["reason"]
    assert list(await ledger(database)) == [job.idempotency_key]


async def test_a_type_without_a_handler_is_counted_without_a_series_of_its_own(
    manager: FastAPI, nats_url: str
) -> None:
    registry = runtime_of(manager).metrics.registry

    async def counted() -> bool:
        exposition = generate_latest(registry).decode()
        return 'workload_manager_jobs_total{outcome="not-here",type="unknown"} 1.0' in exposition

    async with publisher(nats_url) as bus:
        await publish(bus, "made-up.type-7")
        await eventually(counted, within=10)
    assert "made-up.type-7" not in generate_latest(registry).decode()


async def test_an_expired_job_is_terminated(manager: FastAPI, nats_url: str) -> None:
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, deadline=datetime.now(UTC) - timedelta(seconds=1))
        await events.wait_for(lambda: "job.expired" in events.kinds(job.idempotency_key))
    assert "deadline" in events.of("job.expired")[0]["reason"]


async def test_another_trust_zone_is_no_refusal_but_unroutable_when_no_live_node_is_there(
    manager: FastAPI, nats_url: str
) -> None:
    """A job pinned to another trust zone is not for this node, not a security event:
    another node of the tier may run it. Here the registry has none in z9."""
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, requirements={"trust_zone": "z9"})
        await events.wait_for(lambda: "job.dead" in events.kinds(job.idempotency_key))
    assert events.kinds(job.idempotency_key) == ["job.dead"]
    (dead,) = events.of("job.dead")
    assert dead["code"] == "unroutable" and "trust_zone" in dead["reason"]
    assert "security" not in dead


async def test_unmet_requirements_no_live_node_meets_are_dead_lettered_unroutable(
    manager: FastAPI, database: str, nats_url: str
) -> None:
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, requirements={"capabilities": ["quantum"]})
        await events.wait_for(lambda: "job.dead" in events.kinds(job.idempotency_key))
    assert events.kinds(job.idempotency_key) == ["job.dead"]
    (dead,) = events.of("job.dead")
    assert dead["code"] == "unroutable" and dead["delivered"] == 1
    assert "no live node can run it: requirements not met: capabilities" in dead["reason"]
    texts = [a.text for a in runtime_of(manager).alerts.recent]
    assert any("no live node can run noop jobs" in t for t in texts), texts
    assert await ledger(database) == {}


async def test_a_retryable_failure_is_retried_and_then_succeeds(
    manager: FastAPI, database: str, nats_url: str
) -> None:
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, payload={"fail": "retryable", "fail_times": 1})
        await events.wait_for(lambda: "job.completed" in events.kinds(job.idempotency_key))
    assert events.kinds(job.idempotency_key) == ["job.failed", "job.completed"]
    assert events.of("job.failed")[0]["retry_in_seconds"] == 0.2
    row = (await ledger(database))[job.idempotency_key]
    assert (row["status"], row["attempts"]) == ("completed", 2)


@pytest.mark.parametrize(
    ("payload", "failed_first"),
    [({"fail": "permanent"}, 0), ({"fail": "retryable"}, 2)],
)
async def test_permanent_failures_and_the_last_delivery_are_dead_lettered(
    manager: FastAPI, database: str, nats_url: str, payload: dict[str, Any], failed_first: int
) -> None:
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, payload=payload)
        await events.wait_for(lambda: "job.dead" in events.kinds(job.idempotency_key))
    assert events.kinds(job.idempotency_key) == ["job.failed"] * failed_first + ["job.dead"]
    row = (await ledger(database))[job.idempotency_key]
    assert row["status"] == "dead" and "noop asked to fail" in row["error"]
    assert any("dead-lettered" in a.text for a in runtime_of(manager).alerts.recent)


async def test_the_same_key_runs_once(manager: FastAPI, database: str, nats_url: str) -> None:
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        first = await publish(bus, idempotency_key="order-42")
        await events.wait_for(lambda: "job.completed" in events.kinds("order-42"))
        # the same key again: within the duplicate window NATS drops it...
        await publish(bus, idempotency_key="order-42")
        # ...and past it (a different message id) the ledger acknowledges without running
        import nats

        nc = await nats.connect(nats_url)
        again = first.model_dump(mode="json", by_alias=True, exclude_none=True)
        again["job_id"] = "00000000-0000-4000-8000-000000000042"
        import json

        await nc.jetstream().publish("mm.write.A.noop", json.dumps(again).encode())
        await nc.close()
        duplicates = runtime_of(manager).metrics.jobs.labels("noop", "duplicate")

        async def answered_as_duplicate() -> bool:
            return bool(duplicates._value.get() == 1)

        await eventually(answered_as_duplicate)
        await eventually(lambda: consumer_settled(nats_url, "MM_WRITE"))
    # the duplicate is answered with the completion again (a run whose event was lost
    # gets it out this way); the stream keeps one, by its message id
    assert events.kinds("order-42") == ["job.completed", "job.completed"]
    assert events.of("job.completed")[1]["duplicate"] is True
    stored = [e for s, e in await stored_events(nats_url) if s.endswith("job.completed")]
    assert [e["idempotency_key"] for e in stored] == ["order-42"]
    row = (await ledger(database))["order-42"]
    assert (row["status"], row["attempts"]) == ("completed", 1)


async def test_a_key_held_by_a_live_lease_elsewhere_waits_then_is_taken_over(
    manager: FastAPI, database: str, nats_url: str
) -> None:
    conn = await asyncpg.connect(database)
    await conn.execute(
        """INSERT INTO job_ledger (idempotency_key, job_id, job_type, node_id, status, lease_until)
           VALUES ('held-1', gen_random_uuid(), 'noop', 'other-node', 'running',
                   now() + interval '1.5 seconds')"""
    )
    await conn.close()
    held = runtime_of(manager).metrics.jobs.labels("noop", "held")
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        await publish(bus, idempotency_key="held-1")

        async def waited() -> bool:
            return bool(held._value.get() >= 1)

        await eventually(waited)
        await events.wait_for(lambda: "job.completed" in events.kinds("held-1"))
    # it waited for the other node's lease (held at least once), never ran alongside it
    assert events.kinds("held-1") == ["job.completed"]
    row = (await ledger(database))["held-1"]
    assert (row["node_id"], row["attempts"]) == (NODE, 2)


async def test_a_slow_job_is_kept_alive_past_ack_wait(
    manager: FastAPI, database: str, nats_url: str
) -> None:
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, payload={"delay_seconds": 3.0})  # ack_wait is 2 s
        await events.wait_for(lambda: "job.completed" in events.kinds(job.idempotency_key))
    assert events.of("job.completed")[0]["result"]["delivered"] == 1
    assert (await ledger(database))[job.idempotency_key]["attempts"] == 1


async def test_shutdown_lets_a_running_job_finish(
    make_settings: SettingsFactory, database: str, nats_url: str
) -> None:
    app = create_app(make_settings(**worker_settings(database, nats_url)))
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        async with running(app):
            await _worker_ready(app)
            job = await publish(bus, payload={"delay_seconds": 1.0})
            await _until_running(app)
        # the lifespan has ended: the job finished within the grace period
        assert "job.completed" in events.kinds(job.idempotency_key)
        await events.wait_for(lambda: "node.offline" in events.kinds())
    assert [k for k in events.kinds() if k.startswith("node.")] == [
        "node.online",
        "node.draining",
        "node.offline",
    ]
    assert (await ledger(database))[job.idempotency_key]["status"] == "completed"


async def test_shutdown_hands_back_what_cannot_finish_and_it_runs_later(
    make_settings: SettingsFactory, database: str, nats_url: str
) -> None:
    settings = worker_settings(database, nats_url, shutdown_grace_seconds=6.0)
    app = create_app(make_settings(**settings))
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        async with running(app):
            await _worker_ready(app)
            job = await publish(bus, payload={"delay_seconds": 30.0, "fail_times": 0})
            await _until_running(app)
        row = (await ledger(database))[job.idempotency_key]
        assert (row["status"], row["error"]) == ("retrying", "released on shutdown")
        assert "job.completed" not in events.kinds(job.idempotency_key)
    # a later run (think: the next pod) picks it up from the stream; here it succeeds fast
    async with asyncpg.create_pool(database) as pool:
        await pool.execute("UPDATE job_ledger SET status = 'retrying'")
    app2 = create_app(make_settings(**settings, job_timeout_seconds=0.5))
    async with watching_events(nats_url) as events, running(app2):
        await _worker_ready(app2)
        await events.wait_for(lambda: bool(events.kinds(job.idempotency_key)), within=20)
    assert events.kinds(job.idempotency_key)[0] in ("job.failed", "job.dead")
    # claimed again, not lost; the hand-back gave its attempt back
    (first, *_) = [
        body for _, body in events.events if body["idempotency_key"] == job.idempotency_key
    ]
    assert first["attempt"] == 1


async def _worker_ready(app: FastAPI) -> None:
    component = runtime_of(app).components["worker"]
    for _ in range(200):
        if component.state == "ok":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(component.as_dict())


async def _until_running(app: FastAPI) -> None:
    worker = worker_of(app)
    assert worker is not None
    for _ in range(200):
        if worker.in_flight:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no job started")


def test_event_log_filters() -> None:
    log = EventLog()
    log.events.append(("mm.events.n.job.completed", {"idempotency_key": "k"}))
    log.events.append(("mm.events.n.node.online", {"idempotency_key": None}))
    assert log.kinds("k") == ["job.completed"]
    assert log.kinds() == ["job.completed", "node.online"]


async def test_two_deliveries_of_one_key_in_one_batch_run_once(
    make_settings: SettingsFactory, database: str, nats_url: str
) -> None:
    """Both copies are fetched in one batch (published before the worker starts): the
    second must wait for the first and then be acknowledged as a duplicate, not run."""
    import json

    import nats

    first = new_job("noop", payload={"delay_seconds": 0.5}, idempotency_key="twice-1")
    second = first.model_copy(update={"job_id": uuid.uuid4()})
    app = create_app(make_settings(**worker_settings(database, nats_url)))
    async with publisher(nats_url) as bus:
        await init_streams(bus, runtime_of(app).settings)
        nc = await nats.connect(nats_url)
        for job in (first, second):
            body = job.model_dump(mode="json", by_alias=True, exclude_none=True)
            await nc.jetstream().publish("mm.write.A.noop", json.dumps(body).encode())
        await nc.close()
    async with watching_events(nats_url) as events, running(app):
        await _worker_ready(app)
        await events.wait_for(lambda: "job.completed" in events.kinds("twice-1"))
        metrics = runtime_of(app).metrics
        await eventually(lambda: consumer_settled(nats_url, "MM_WRITE"), within=20)
        assert metrics.jobs.labels("noop", "completed")._value.get() == 1
    row = (await ledger(database))["twice-1"]
    assert (row["status"], row["attempts"]) == ("completed", 1)


@pytest.mark.parametrize(
    ("payload", "kind"),
    [({"fail": "permanent"}, "job.dead"), ({"not": "a job"}, "job.rejected")],
)
async def test_a_terminal_event_that_cannot_be_stored_holds_the_message_back(
    manager: FastAPI, nats_url: str, payload: dict[str, Any], kind: str
) -> None:
    """`term` only after the dead letter or rejection is stored: while MM_EVENTS is gone the
    message is handed back with a delay; once the stream is back the event is stored and
    the message terminated."""
    import json

    import nats

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.delete_stream("MM_EVENTS")
        async with watching_events(nats_url) as attempts:
            if "not" in payload:
                await js.publish("mm.write.A.noop", json.dumps(payload).encode())
            else:
                async with publisher(nats_url) as bus:
                    await publish(bus, payload=payload, idempotency_key="lost-letter")
            # core subscribers see each attempt even though no stream stores it: a second
            # attempt means the message came back instead of being terminated
            await attempts.wait_for(lambda: attempts.kinds().count(kind) >= 2, within=20)
        async with publisher(nats_url) as bus:
            await init_streams(bus, runtime_of(manager).settings)

        async def stored_kinds() -> list[str]:
            return [subject.split(".", 3)[3] for subject, _ in await stored_events(nats_url)]

        async def event_stored() -> bool:
            return kind in await stored_kinds()

        await eventually(event_stored, within=20)
        await eventually(lambda: consumer_settled(nats_url, "MM_WRITE"), within=20)
    finally:
        await nc.close()
    assert (await stored_kinds()).count(kind) == 1


async def test_after_shutdown_begins_no_new_job_starts_and_nothing_is_left_unanswered(
    make_settings: SettingsFactory,
    database: str,
    nats_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Jobs run when shutdown begins and more wait in the stream. Those running finish,
    none of the waiting ones starts on this node, and every fetched message is answered
    by the time the lifespan has ended (acknowledged, or handed back for another node).

    The ack wait is long (60 s): a message left unanswered would not come back within
    the test, one handed back comes back at once to the next fetch."""
    caplog.set_level(logging.INFO, logger="app.services.working")
    app = create_app(
        make_settings(**worker_settings(database, nats_url, job_ack_wait_seconds=60.0))
    )
    keys = [f"drain-{i}" for i in range(8)]
    async with publisher(nats_url) as bus:
        async with running(app):
            await _worker_ready(app)
            for key in keys:
                await publish(bus, idempotency_key=key, payload={"delay_seconds": 1.0})
            worker = worker_of(app)
            assert worker is not None

            async def busy() -> bool:
                return worker.in_flight >= 1

            await eventually(busy)
        left = await _fetch_all(nats_url, expected=len(keys) - len(await ledger(database)))
    assert left == len(keys) - len(await ledger(database)), "a message was left unanswered"
    (stopping,) = [r.getMessage() for r in caplog.records if "worker stopping" in r.getMessage()]
    in_flight = int(re.search(r"(\d+) job\(s\) in flight", stopping).group(1))  # type: ignore[union-attr]
    rows = (await ledger(database)).values()
    assert len(rows) == in_flight, "only the jobs in flight when the stop began ran"
    assert {r["status"] for r in rows} == {"completed"}
    assert in_flight < len(keys), "the waiting jobs stay in the stream for another node"


async def _fetch_all(nats_url: str, *, expected: int) -> int:
    """How many messages the tier's consumer delivers now, fetching until `expected`
    came or none comes for 10 s (far less than the ack wait)."""
    import nats
    import nats.errors

    nc = await nats.connect(nats_url)
    try:
        sub = await nc.jetstream().pull_subscribe_bind(durable="wm-A", stream="MM_WRITE")
        got = 0
        while got < expected:
            try:
                got += len(await sub.fetch(batch=expected - got, timeout=10))
            except nats.errors.TimeoutError:
                break
        return got
    finally:
        await nc.close()


async def test_an_event_bigger_than_the_servers_max_payload_is_sent_truncated(
    make_settings: SettingsFactory,
    database: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server with a 64 KiB max_payload and a workload answering 64 KiB of control
    characters (each six bytes in JSON): the job.completed event is cut to fit, marked
    truncated, and the job is acked, not handed back until its deliveries are spent."""
    config = tmp_path / "nats.conf"
    config.write_text("max_payload: 65536\n")
    server = EmbeddedNats(tmp_path / "nats", config=config).start()

    async def answer(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"\x01" * 65536})

    try:
        with serve(answer) as workload:
            monkeypatch.setenv("HTTP_PROXY", workload.url)
            monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
            app = create_app(make_settings(**worker_settings(database, server.url)))
            async with running(app), watching_events(server.url) as events:
                await _worker_ready(app)
                async with publisher(server.url) as bus:
                    job = await publish(bus, "http", payload={"url": EFFECT_URL, "body": {}})
                await events.wait_for(
                    lambda: "job.completed" in events.kinds(job.idempotency_key), within=30
                )
    finally:
        server.stop()
    (completed,) = events.of("job.completed")
    assert completed["truncated"] is True
    assert completed["result"]["truncated"] is True
    assert completed["job_id"] == str(job.job_id)
    row = (await ledger(database))[job.idempotency_key]
    assert row["status"] == "completed"


@pytest.mark.parametrize(
    ("requirements", "reason"),
    [
        # only tier B may run it, and it came on tier A's subject
        ({"tier": ["B"]}, "tier"),
        # only a node of tier B has the capability
        ({"capabilities": ["b-only"]}, "capabilities"),
    ],
)
async def test_a_job_only_another_tiers_node_can_run_is_unroutable_on_this_tier(
    manager: FastAPI, database: str, nats_url: str, requirements: dict[str, Any], reason: str
) -> None:
    """The registry's live tier-B node does not read tier A's consumer: it is no reason to
    hand the job on (it would be, until JOB_MAX_DELIVERIES)."""
    registry = AsyncpgRegistry(database, timeout=5)
    await registry.open()
    try:
        other = NodeProfile(node_id="node-tier-b", tier="B", capabilities=["b-only"])
        await registry.upsert(other, status="online", interval_seconds=30)
    finally:
        await registry.close()
    async with watching_events(nats_url) as events, publisher(nats_url) as bus:
        job = await publish(bus, requirements=requirements)
        await events.wait_for(lambda: "job.dead" in events.kinds(job.idempotency_key))
    (dead,) = events.of("job.dead")
    assert dead["code"] == "unroutable" and dead["delivered"] == 1
    assert reason in dead["reason"]


async def test_shutdown_hands_back_the_jobs_waiting_in_the_queue_too(
    make_settings: SettingsFactory, database: str, nats_url: str
) -> None:
    """One runner busy past the grace, one job queued behind it: the stop NAKs both, so
    neither waits out the ack wait (30 s here) before another node can take it."""
    settings = worker_settings(
        database, nats_url, worker_concurrency=1, job_ack_wait_seconds=30.0,
        shutdown_grace_seconds=3.0,
    )  # fmt: skip
    app = create_app(make_settings(**settings))
    async with watching_naks(nats_url) as naks, publisher(nats_url) as bus:
        async with running(app):
            await _worker_ready(app)
            await publish(bus, payload={"delay_seconds": 60.0})
            await publish(bus, payload={"delay_seconds": 60.0})
            worker = worker_of(app)
            assert worker is not None

            async def both_held() -> bool:
                return worker.in_flight == 2

            await eventually(both_held, within=10)

        async def both_nakked() -> bool:
            return len(naks.deliveries) == 2

        await eventually(both_nakked, within=10)


async def test_a_stalled_ledger_does_not_hold_back_the_in_progress_of_a_running_job(
    make_settings: SettingsFactory, nats_url: str, tmp_path: Path
) -> None:
    """PostgreSQL stops answering for longer than the ack wait while a job runs: the lease
    renewal waits, but `in_progress` still goes out on time, so JetStream does not hand
    the running job out again."""
    pg = EmbeddedPostgres(tmp_path / "pg").start()
    try:
        settings = worker_settings(pg.url, nats_url, job_ack_wait_seconds=3.0)
        app = create_app(make_settings(**settings))
        async with running(app), watching_events(nats_url) as events:
            await _worker_ready(app)
            async with publisher(nats_url) as bus:
                job = await publish(bus, payload={"delay_seconds": 9.0})

            async def claimed() -> bool:
                row = (await ledger(pg.url)).get(job.idempotency_key)
                return row is not None and row["status"] == "running"

            await eventually(claimed, within=10)
            with _stopped(pg):
                # the fault's length, not a wait for a condition: longer than the ack wait
                await asyncio.sleep(5.0)
            await events.wait_for(
                lambda: "job.completed" in events.kinds(job.idempotency_key), within=30
            )
            info = await _consumer(nats_url)
    finally:
        pg.stop()
    # the consumer's sequence counts every delivery, redeliveries included
    assert info.delivered.consumer_seq == 1, "the running job was delivered again"


@contextmanager
def _stopped(pg: EmbeddedPostgres) -> Iterator[None]:
    """Every process of the server stopped (SIGSTOP): connections open, nothing answers."""
    assert pg.pid is not None
    main = psutil.Process(pg.pid)
    processes = [main, *main.children(recursive=True)]
    for process in processes:
        with suppress(psutil.NoSuchProcess):  # a child that had just ended
            process.suspend()
    try:
        yield
    finally:
        # children first; a child that had ended (a zombie) is reaped once the server runs
        for process in reversed(processes):
            with suppress(psutil.NoSuchProcess):
                process.resume()


async def _consumer(url: str) -> Any:
    nc = await nats.connect(url)
    try:
        return await nc.jetstream().consumer_info("MM_WRITE", "wm-A")
    finally:
        await nc.close()
