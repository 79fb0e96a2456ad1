"""The JetStream topology's slice of the settings (app/services/streams.py makes the
streams, consumers and ledger buckets from it). Plain data: deciding the worker's config
(app/services/components.py) imports no NATS client through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.settings import Settings


class TopologySettings(Protocol):
    """What the topology is made from: `Settings`, or the worker's `Topology`."""

    @property
    def nats_stream_max_age_seconds(self) -> float: ...
    @property
    def nats_duplicate_window_seconds(self) -> float: ...
    @property
    def nats_stream_replicas(self) -> int | None: ...
    @property
    def job_stream_retention(self) -> str: ...
    @property
    def job_ack_wait_seconds(self) -> float: ...
    @property
    def job_max_ack_pending(self) -> int: ...
    @property
    def ledger_ttl_seconds(self) -> float: ...


@dataclass(frozen=True)
class Topology:
    """The topology's slice of the settings, as the worker's config carries it."""

    nats_stream_max_age_seconds: float
    nats_duplicate_window_seconds: float
    nats_stream_replicas: int | None
    job_stream_retention: str
    job_ack_wait_seconds: float
    job_max_ack_pending: int
    ledger_ttl_seconds: float

    @classmethod
    def of(cls, settings: Settings) -> Topology:
        return cls(
            nats_stream_max_age_seconds=settings.nats_stream_max_age_seconds,
            nats_duplicate_window_seconds=settings.nats_duplicate_window_seconds,
            nats_stream_replicas=settings.nats_stream_replicas,
            job_stream_retention=settings.job_stream_retention,
            job_ack_wait_seconds=settings.job_ack_wait_seconds,
            job_max_ack_pending=settings.job_max_ack_pending,
            ledger_ttl_seconds=settings.ledger_ttl_seconds,
        )
