"""Every event kind docs/asyncapi.yaml lists is one a real worker emits, and every one it
emits is what the document says (`watching_events` checks each body against it): a
worker on a real nats-server, with its JetStream ledger, runs a job to completion, fails
one once then completes it, rejects, expires and dead-letters others, and comes online,
drains and goes offline."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats

from app.adapters.embedded import EmbeddedNats
from app.main import create_app
from tests.conftest import SettingsFactory, running
from tests.support import asyncapi
from tests.support.jobs_world import publish, publisher, watching_events


async def test_a_worker_emits_every_documented_event_and_only_as_documented(
    make_settings: SettingsFactory, tmp_path: Path
) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        settings = make_settings(
            nats_url=server.url, node_id="node-contract", node_tier="A",
            job_backoff_seconds=[0.1], job_max_attempts=2, job_ack_wait_seconds=2.0,
        )  # fmt: skip
        async with watching_events(server.url) as events:
            async with running(create_app(settings)), publisher(server.url) as bus:
                await events.wait_for(lambda: "node.online" in events.kinds())
                done = await publish(bus)
                retried = await publish(bus, payload={"fail": "retryable", "fail_times": 1})
                dead = await publish(bus, payload={"fail": "permanent"})
                late = await publish(bus, deadline=datetime.now(UTC) - timedelta(seconds=1))
                nc = await nats.connect(server.url)
                await nc.jetstream().publish("mm.write.A.noop", b'{"not": "a job"}')
                await nc.close()
                expected: list[tuple[str | None, str]] = [
                    (done.idempotency_key, "job.completed"),
                    (retried.idempotency_key, "job.failed"),
                    (retried.idempotency_key, "job.completed"),
                    (dead.idempotency_key, "job.dead"),
                    (late.idempotency_key, "job.expired"),
                    (None, "job.rejected"),
                ]
                for key, kind in expected:

                    def arrived(key: str | None = key, kind: str = kind) -> bool:
                        return kind in events.kinds(key)

                    await events.wait_for(arrived)
            # the app has stopped: its worker drained and went offline
            await events.wait_for(lambda: "node.offline" in events.kinds())
    finally:
        server.stop()
    seen = {
        (asyncapi.channel_of(subject), subject.rsplit(".", 1)[1]) for subject, _ in events.events
    }
    documented = {
        (name, value)
        for name in ("jobEvents", "nodeEvents")
        for value in asyncapi.document()["channels"][name]["parameters"]["event"]["enum"]
    }
    assert seen == documented
