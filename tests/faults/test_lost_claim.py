"""A manager frozen while it runs a job loses the job's claim to another; when it wakes,
its run is no longer the job's. Frozen with SIGSTOP: a VM paused, a process starved, a
long GC pause — the process does not know it was gone.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

from app.adapters.embedded import EmbeddedPostgres
from app.services.streams import new_job, publish_job
from standins.databases import fresh_database
from tests.support.jobs_world import (
    consumer_bound,
    consumer_settled,
    job_outcomes,
    jobs_in_flight,
    ledger_row,
    logs,
    manager_env,
    own_nats,
    publisher,
    running_managers,
    stored_events,
    stream_messages,
)
from tests.support.polling import eventually

# the lease is 2 x ack wait: a frozen holder loses it within seconds
ACK_WAIT = 2
# the job outlasts the lease, so M1 is still running it when it is frozen and the lease
# runs out under it
JOB_SECONDS = 8


async def test_a_manager_that_lost_its_claim_neither_completes_nor_acks_the_job(
    postgres_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    first, second = f"claim-m1-{suffix}", f"claim-m2-{suffix}"
    key = f"lost-claim-{suffix}"
    settings = {
        "JOB_ACK_WAIT_SECONDS": str(ACK_WAIT),
        "JOB_HELD_DELAY_SECONDS": "0.2",
        "JOB_BACKOFF_SECONDS": "0.5",
        "JOB_MAX_ATTEMPTS": "5",
        "JOB_MAX_DELIVER": "5",
    }
    async with fresh_database(postgres_server.url) as database:
        with own_nats(tmp_path / "nats") as server:

            def env(node: str) -> dict[str, str]:
                return manager_env(database, server.url, node, "A") | settings

            # M1 alone: only it can take the job first
            with running_managers(tmp_path, {"m1": env(first)}) as m1:
                async with publisher(server.url) as bus:
                    await eventually(
                        lambda: consumer_bound(server.url, "MM_WRITE", 1), within=60, step=0.1
                    )
                    job = new_job(
                        "noop", idempotency_key=key, payload={"delay_seconds": JOB_SECONDS}
                    )
                    await publish_job(bus, job, kind="write", tier="A")
                    await eventually(lambda: _held_by(database, key, first), within=30)
                m1["m1"].send(signal.SIGSTOP)
                row = await ledger_row(database, key)
                assert row is not None and (row["status"], row["node_id"]) == (
                    "running", first), f"M1 finished before it was frozen: {row}"  # fmt: skip
                # M2 gets the redelivery once M1 misses its ack wait, and the claim once
                # M1's lease has run out
                with running_managers(tmp_path, {"m2": env(second)}) as m2:
                    everyone = m1 | m2
                    try:
                        await eventually(lambda: _held_by(database, key, second), within=60)
                        m1["m1"].send(signal.SIGCONT)
                        # M1 wakes with its handler done or nearly (its sleep ran on while
                        # it was frozen) and is through with the job long before M2 is
                        await eventually(lambda: _idle(m1["m1"].url), within=30)
                        # a work-queue stream drops a message once it is acked: still
                        # there while M2 runs it (the ledger read after the stream's
                        # says so), so M1 did not ack it
                        held = await stream_messages(server.url, "MM_WRITE")
                        assert await _held_by(database, key, second), (
                            "M2 finished before M1 was seen through: too slow a machine "
                            "to tell whether M1 acked the job"
                        )
                        assert held == 1, "M1 acked the job whose claim it had lost"
                        await eventually(lambda: _completed(database, key), within=60)
                        await eventually(
                            lambda: consumer_settled(server.url, "MM_WRITE"), within=60
                        )
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}{logs(everyone)}") from None
                    m1_outcomes = await job_outcomes(m1["m1"].url)
                    m2_outcomes = await job_outcomes(m2["m2"].url)
            row = await ledger_row(database, key)
            events = await stored_events(server.url)
    assert row is not None and (row["status"], row["node_id"]) == ("completed", second), row
    completed = [
        body["node_id"]
        for subject, body in events
        if subject.endswith(".job.completed") and body.get("idempotency_key") == key
    ]
    # the first stored job.completed is the one the stream keeps (later ones carry the
    # same message id and are dropped): it must name the node whose run the ledger has
    assert completed[:1] == [second], (completed, events)
    assert m1_outcomes.get("completed", 0) == 0, ("M1 counts the job it lost", m1_outcomes)
    assert m2_outcomes.get("completed", 0) == 1, m2_outcomes


async def _held_by(database: str, key: str, node: str) -> bool:
    row = await ledger_row(database, key)
    return row is not None and row["status"] == "running" and row["node_id"] == node


async def _completed(database: str, key: str) -> bool:
    row = await ledger_row(database, key)
    return row is not None and row["status"] == "completed"


async def _idle(url: str) -> bool:
    """True once the manager has finished with its job, whatever it made of it."""
    return await jobs_in_flight(url) == 0
