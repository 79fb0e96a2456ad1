"""NATS credentials against a real nats-server with users and per-tier permissions: an
nkey user of tier C works its own consumer and cannot touch tier A's (a clear refusal,
not a bare timeout); unknown credentials are refused by name; user and password (or a
token) in the URL are never shown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.adapters.bus import JetStreamBus, NatsAuth, NatsRefused, server_info
from app.adapters.embedded import EmbeddedNats
from app.services.streams import consumer_specs, init_streams
from app.settings import Settings, redact_url
from tests.support.nats_auth import NkeyUser, new_nkey_user, operator_url, start_server


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NkeyUser]:
    keys = tmp_path_factory.mktemp("nkeys")
    return {tier: new_nkey_user(keys, f"tier-{tier}") for tier in ("A", "C")}


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, users: dict[str, NkeyUser]
) -> Iterator[EmbeddedNats]:
    server = start_server(tmp_path_factory.mktemp("secured-nats"), users)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def topology(secured: EmbeddedNats) -> None:
    """The operator's step: streams, consumers and the ledger bucket (idempotent)."""
    bus = JetStreamBus(operator_url(secured), name="operator", timeout=5)
    await bus.connect()
    try:
        await init_streams(bus, Settings(_env_file=None))
    finally:
        await bus.drain()


async def tier_c(
    secured: EmbeddedNats, users: dict[str, NkeyUser], *, request_timeout: float
) -> JetStreamBus:
    """A connected bus with tier C's nkey seed file."""
    auth = NatsAuth(nkey_seed_file=users["C"].seed_file)
    bus = JetStreamBus(secured.url, name="tier-c", timeout=request_timeout, auth=auth)
    await bus.connect()
    return bus


def settings() -> Settings:
    return Settings(_env_file=None)


async def test_a_tier_user_works_its_own_consumer(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None
) -> None:
    bus = await tier_c(secured, users, request_timeout=5)
    try:
        for consumer in consumer_specs(settings(), ("C",)):
            assert await bus.ensure_consumer(consumer) == "unchanged"
        await bus.publish("mm.events.node-c.node.online", {"hello": True}, msg_id="auth-1")
        kv = await bus.key_value("JOB_LEDGER")
        await kv.create("a2V5", b"{}")
        assert bus.refusal is None
    finally:
        await bus.drain()


async def test_another_tiers_consumer_is_refused_by_name(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None
) -> None:
    bus = await tier_c(secured, users, request_timeout=2)
    try:
        (tier_a, *_rest) = consumer_specs(settings(), ("A",))
        with pytest.raises(TimeoutError) as denied:
            await bus.ensure_consumer(tier_a)
        explained = bus.explain(denied.value)
        assert isinstance(explained, NatsRefused)
        assert "permissions violation" in str(explained).lower()
        assert "wm-a" in str(explained).lower()
    finally:
        await bus.drain()


async def test_unknown_credentials_are_refused_by_name(
    secured: EmbeddedNats, tmp_path: Path
) -> None:
    stranger = new_nkey_user(tmp_path, "stranger")
    bus = JetStreamBus(
        secured.url, name="stranger", timeout=5, auth=NatsAuth(nkey_seed_file=stranger.seed_file)
    )
    with pytest.raises(NatsRefused, match=r"refused this node's credentials.*Authorization"):
        await bus.connect()
    with pytest.raises(NatsRefused, match="Authorization Violation"):
        await server_info(secured.url, connect_timeout=5)  # no credentials at all


async def test_user_and_password_in_the_url_work_and_are_never_shown(
    secured: EmbeddedNats,
) -> None:
    url = operator_url(secured)
    info = await server_info(url, connect_timeout=5)
    assert info["jetstream"] is True
    shown = redact_url(url)
    assert "operator-pass" not in shown and shown.endswith(f"@{secured.host}:{secured.port}")
    assert redact_url("nats://s3cr3t-token@nats.example:4222") == "nats://***@nats.example:4222"
