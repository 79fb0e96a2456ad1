"""The JetStream bus against a real nats-server: NATS_URL with several servers."""

from __future__ import annotations

from app.adapters.bus import JetStreamBus, server_info
from app.adapters.embedded import EmbeddedNats, free_port


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
