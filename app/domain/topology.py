"""The JetStream topology's slice of the settings (app/services/streams.py makes the
streams, consumers and ledger buckets from it). Plain data: deciding the worker's config
(app/services/components.py) imports no NATS client through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    def job_consumer_max_waiting(self) -> int: ...
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
    job_consumer_max_waiting: int
    ledger_ttl_seconds: float
