"""The JetStream bus against a real nats-server: NATS_URL with several servers, and the
consumer statistics read through it."""

from __future__ import annotations

import logging

import pytest

from app.adapters.bus import JetStreamBus, server_info
from app.adapters.embedded import EmbeddedNats, free_port
from app.metrics import Metrics
from app.services.wiring import consumer_stats


async def test_a_url_with_several_servers_reaches_one_that_is_up(
    nats_server: EmbeddedNats,
) -> None:
    down = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    url = f"{down},{nats_server.url}"
    bus = JetStreamBus(url, name="test-several", timeout=5)
    await bus.connect()
    try:
        assert bus.connected
    finally:
        await bus.drain()
    info = await server_info(url, connect_timeout=5)
    assert info["version"] and info["jetstream"] is True


async def test_consumer_stats_that_cannot_be_read_are_a_warning_not_a_failed_loop(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer the server does not know (or a leader election's timeout) is logged
    and left to the next tick; the loop itself does not fail with a traceback."""
    bus = JetStreamBus(nats_server.url, name="test-stats", timeout=5)
    await bus.connect()
    try:
        collect = consumer_stats(bus, Metrics(), "no-such-tier")
        with caplog.at_level(logging.WARNING):
            await collect()
    finally:
        await bus.drain()
    assert any("consumer state of" in r.getMessage() for r in caplog.records)
