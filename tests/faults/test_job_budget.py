"""The retry budget (JOB_MAX_ATTEMPTS) counts attempts, not deliveries: a ledger outage
hands jobs back many times over, and none of those hand-backs is an attempt.

PostgreSQL here is the test's own, so it can be stopped while the manager keeps running.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.services.streams import new_job
from tests.support.jobs_world import (
    consumer_bound,
    consumer_settled,
    ledger,
    logs,
    manager_env,
    own_nats,
    publish_raw,
    running_managers,
    stored_events,
    watching_naks,
)
from tests.support.polling import eventually

ATTEMPTS = 3
JOBS = 4


async def test_deliveries_handed_back_while_the_ledger_is_down_spend_no_attempt(
    tmp_path: Path,
) -> None:
    postgres = EmbeddedPostgres(tmp_path / "pg").start()
    node = f"budget-{uuid.uuid4().hex[:8]}"
    try:
        with own_nats(tmp_path / "nats") as server:
            env = manager_env(postgres.url, server.url, node, "A") | {
                # the budget under its new name and its old one (still read as an alias)
                "JOB_MAX_ATTEMPTS": str(ATTEMPTS),
                "JOB_MAX_DELIVER": str(ATTEMPTS),
                "JOB_BACKOFF_SECONDS": "0.2,0.2",
                # a job handed back for the outage comes again soon: many deliveries
                "JOB_HELD_DELAY_SECONDS": "0.2",
            }
            with running_managers(tmp_path, {"m": env}) as procs:
                try:
                    await _run(postgres, server)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}{logs(procs)}") from None
            rows = await ledger(postgres.url)
            events = await stored_events(server.url)
    finally:
        postgres.stop()
    keys = sorted(k for k in rows if k.startswith("budget-"))
    assert len(keys) == JOBS, rows
    # exactly the budget: three real attempts each, the third one dead-lettered
    assert {k: (rows[k]["status"], rows[k]["attempts"]) for k in keys} == dict.fromkeys(
        keys, ("dead", ATTEMPTS)
    ), {k: rows[k]["error"] for k in keys}
    for key in keys:
        mine = [
            (subject.split(".", 3)[3], body)
            for subject, body in events
            if body.get("idempotency_key") == key
        ]
        failed = [body.get("code") for kind, body in mine if kind == "job.failed"]
        dead = [body.get("code") for kind, body in mine if kind == "job.dead"]
        assert (failed, dead) == (["retrying"] * (ATTEMPTS - 1), ["attempts-spent"]), mine


async def _run(postgres: EmbeddedPostgres, server: EmbeddedNats) -> None:
    async with watching_naks(server.url) as naks:
        await eventually(lambda: consumer_bound(server.url, "MM_WRITE", 1), within=60, step=0.1)
        await asyncio.to_thread(postgres.stop)
        # jobs that always fail retryably, published while the ledger cannot be reached
        seqs = []
        for i in range(JOBS):
            job = new_job(
                "noop", idempotency_key=f"budget-{i}-{uuid.uuid4().hex[:6]}",
                payload={"fail": "retryable"},
            )  # fmt: skip
            seqs.append(await publish_raw(server.url, job))

        async def outage_outlasted_the_budget() -> bool:
            # as JetStream counts them: every job delivered (and handed back) more often
            # than it may be attempted
            return all(naks.delivered("MM_WRITE", seq) > ATTEMPTS for seq in seqs)

        await eventually(outage_outlasted_the_budget, within=60, step=0.1)
        await asyncio.to_thread(postgres.start)
        # the jobs now run out their budget (three attempts, 0.2 s apart) and are answered
        await eventually(lambda: consumer_settled(server.url, "MM_WRITE"), within=60, step=0.2)
