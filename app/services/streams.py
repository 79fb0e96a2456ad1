"""The JetStream topology (streams and the tiers' durable consumers) and job publishing.

`init_streams` creates or updates, idempotently, the three job streams, MM_EVENTS, one
durable pull consumer per job stream and tier (`wm-<tier>`, shared by every node of the
tier) and each tier's ledger bucket (`JOB_LEDGER_<tier>`). `publish_job` is the library
form of `workload-manager publish`.

Replicas: NATS_STREAM_REPLICAS when set; else what the server reports (`derive_replicas`):
1 on a single server, the cluster's size up to 3 on a cluster, and an existing stream
keeps the count it has. A count the server refuses ends in ReplicasRefused.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from app.adapters.bus import ConsumerSpec, JetStreamBus, Published, StreamSpec
from app.adapters.kv_ledger import bucket as ledger_bucket
from app.domain.jobs import (
    EVENTS_STREAM,
    STREAMS,
    Job,
    consumer_filter,
    consumer_name,
    job_subject,
)
from app.domain.requirements import Requirements, Tier
from app.domain.topology import TopologySettings

TIERS = tuple(t.value for t in Tier)
MAX_DERIVED_REPLICAS = 3  # JetStream's usual most; more only when NATS_STREAM_REPLICAS says


def derive_replicas(
    setting: int | None, *, cluster: str | None, advertised: int, existing: int | None
) -> int:
    """A stream's (or bucket's) replica count: `setting` (NATS_STREAM_REPLICAS) when set;
    else an existing stream's own count (derivation never changes a stream, least of all
    lowers it); else 1 on a server that is not clustered (`cluster` None: JetStream refuses
    more there), else the `advertised` client URLs of its cluster, at most 3 (3 when it
    advertises none)."""
    if setting is not None:
        return setting
    if existing is not None:
        return existing
    if cluster is None:
        return 1
    if advertised <= 0:
        return MAX_DERIVED_REPLICAS
    return min(MAX_DERIVED_REPLICAS, advertised)


def stream_specs(
    settings: TopologySettings, replicas: Mapping[str, int] | None = None
) -> list[StreamSpec]:
    """The streams' specs; `replicas` per stream name (what `init_streams` derives), a
    stream without one getting NATS_STREAM_REPLICAS, else 1."""
    chosen = replicas or {}

    def spec(name: str, subject: str, retention: str) -> StreamSpec:
        return StreamSpec(
            name=name,
            subjects=(subject,),
            retention=retention,
            max_age_seconds=settings.nats_stream_max_age_seconds,
            duplicate_window_seconds=settings.nats_duplicate_window_seconds,
            replicas=chosen.get(name, settings.nats_stream_replicas or 1),
        )

    specs = [
        spec(name, f"mm.{kind}.>", settings.job_stream_retention) for kind, name in STREAMS.items()
    ]
    specs.append(spec(EVENTS_STREAM, "mm.events.>", "limits"))
    return specs


UNLIMITED_DELIVERIES = -1


def consumer_specs(
    settings: TopologySettings, tiers: tuple[str, ...] = TIERS
) -> list[ConsumerSpec]:
    return [
        ConsumerSpec(
            stream=stream,
            durable=consumer_name(tier),
            filter_subject=consumer_filter(kind, tier),
            ack_wait_seconds=settings.job_ack_wait_seconds,
            # No limit on the server: JOB_MAX_ATTEMPTS and JOB_MAX_DELIVERIES are the
            # worker's to enforce, because a job past its last delivery must end with a
            # stored job.dead event, and JetStream would drop it silently (and a NAK after
            # a failed event publish would spend a delivery it no longer has).
            max_deliver=UNLIMITED_DELIVERIES,
            # No BackOff: nats-server adds a consumer's backoff step to a NAK's own delay
            # and subtracts the ack wait, so a hand-on NAKed with 2 s on a later delivery
            # came back at once. Every NAK carries its delay (JOB_BACKOFF_SECONDS, the
            # hold and hand-on delays); an unanswered delivery (a crashed worker) comes
            # back after the ack wait.
            backoff_seconds=(),
            max_ack_pending=settings.job_max_ack_pending,
            max_waiting=settings.job_consumer_max_waiting,
        )
        for kind, stream in STREAMS.items()
        for tier in tiers
    ]


async def init_streams(
    bus: JetStreamBus, settings: TopologySettings, *, tiers: tuple[str, ...] = TIERS
) -> list[tuple[str, str]]:
    """Create or update everything; returns (what, created|updated|unchanged) pairs.
    ReplicasRefused when the server refuses the replica count (see `derive_replicas`)."""

    async def replicas(stream: str) -> int:
        existing = None
        if settings.nats_stream_replicas is None:  # the setting needs no look
            existing = await bus.stream_replicas(stream)
        return derive_replicas(
            settings.nats_stream_replicas,
            cluster=bus.cluster_name,
            advertised=bus.advertised_servers,
            existing=existing,
        )

    names = [spec.name for spec in stream_specs(settings)]
    chosen = {name: await replicas(name) for name in names}
    changes = []
    for stream in stream_specs(settings, chosen):
        changes.append((f"stream {stream.name}", await bus.ensure_stream(stream)))
    for consumer in consumer_specs(settings, tiers):
        what = f"consumer {consumer.stream}/{consumer.durable}"
        changes.append((what, await bus.ensure_consumer(consumer)))
    # the idempotency ledger of nodes without PostgreSQL, a bucket per tier
    # (adapters/kv_ledger.py)
    for tier in tiers:
        # only a new bucket takes it; an existing one keeps its own
        made = await bus.ensure_key_value(
            ledger_bucket(tier),
            ttl_seconds=settings.ledger_ttl_seconds,
            replicas=await replicas(f"KV_{ledger_bucket(tier)}"),
        )
        changes.append((f"bucket {ledger_bucket(tier)}", made))
    return changes


def new_job(
    job_type: str,
    *,
    payload: dict[str, Any] | None = None,
    requirements: Requirements | dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    deadline: datetime | None = None,
) -> Job:
    job_id = uuid.uuid4()
    return Job.model_validate(
        {
            "schema": "job/v1",
            "job_id": job_id,
            "idempotency_key": idempotency_key or str(job_id),
            "type": job_type,
            "requirements": requirements or {},
            "payload": payload or {},
            "created_at": datetime.now(UTC),
            "deadline": deadline,
        }
    )


async def publish_job(bus: JetStreamBus, job: Job, *, kind: str, tier: str) -> Published:
    """Publish with `Nats-Msg-Id` = idempotency key: a duplicate within the window is dropped
    (`Published.duplicate`, with the sequence of the message stored before)."""
    body = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    return await bus.publish(job_subject(kind, tier, job.type), body, msg_id=job.idempotency_key)
