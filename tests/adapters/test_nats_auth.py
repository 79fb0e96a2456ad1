"""NATS credentials against a real nats-server with users and per-tier permissions: an
nkey user of tier C cannot touch tier A's consumer (a clear refusal, not a bare timeout)
and needs its node's inbox prefix, which only a node id of one plain subject token has;
unknown credentials are refused by name; user and password (or a token) in the URL are
never shown. What a tier user may and may not do in full is
tests/e2e/test_nats_tier_confinement.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.adapters.bus import JetStreamBus, NatsAuth, NatsRefused, inbox_prefix, server_info
from app.adapters.embedded import EmbeddedNats
from app.domain.nats_servers import NatsServers
from app.domain.redaction import redact_url
from app.main import create_app
from app.services.streams import consumer_specs
from app.settings import Settings
from tests.conftest import SettingsFactory, running
from tests.support import nats_auth
from tests.support.nats_auth import NkeyUser, new_nkey_user, operator_url

users = nats_auth.users
secured = nats_auth.secured
topology = nats_auth.topology


async def tier_c(
    secured: EmbeddedNats, users: dict[str, NkeyUser], *, request_timeout: float
) -> JetStreamBus:
    """A connected bus with tier C's nkey seed file and a node's inbox prefix."""
    auth = NatsAuth(nkey_seed_file=users["C"].seed_file)
    bus = JetStreamBus(
        NatsServers.parse(secured.url), name="tier-c", timeout=request_timeout, auth=auth,
        inbox_prefix=inbox_prefix("C", "node-c"),
    )  # fmt: skip
    await bus.connect()
    return bus


def settings() -> Settings:
    return Settings(_env_file=None)


async def test_without_its_inbox_prefix_a_node_is_refused_its_replies(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None
) -> None:
    """nats-py's default `_INBOX` is every node's: a tier user may not subscribe to it, so
    the manager connects with `_INBOX.wm-<tier>.<node>` (above) and nothing else works."""
    auth = NatsAuth(nkey_seed_file=users["C"].seed_file)
    bus = JetStreamBus(NatsServers.parse(secured.url), name="tier-c", timeout=2, auth=auth)
    await bus.connect()
    try:
        (consumer, *_rest) = consumer_specs(settings(), ("C",))
        with pytest.raises(TimeoutError) as denied:
            await bus.ensure_consumer(consumer)
        explained = bus.explain(denied.value)
        assert isinstance(explained, NatsRefused)
        assert "subscription" in str(explained).lower() and "_inbox." in str(explained).lower()
    finally:
        await bus.drain()


# A node id is one subject token of letters, digits, `-` and `_`: a `.` would make it
# several, and node `node-c1`'s wildcards (`_INBOX.wm-C.node-c1.>`,
# `mm.events.node-c1.>`) would cover node `node-c1.eu`'s inboxes and events.
NODE_IDS = [
    ("node-c1", True),
    ("node_c1", True),
    ("NODE-C1", True),
    ("0", True),
    ("a" * 128, True),
    ("", False),
    ("node-c1.eu", False),
    ("a..b", False),
    ("node.", False),
    (".node", False),
    ("node.>", False),
    ("*", False),
    (">", False),
    ("a b", False),
    ("a\tb", False),
    ("a\nb", False),
    ("node/c1", False),
    ("node:c1", False),
    ("node$c1", False),
    ("nöde", False),
    ("node\u0000", False),
]


@pytest.mark.parametrize(("node", "usable"), NODE_IDS, ids=[repr(n) for n, _ in NODE_IDS])
def test_only_a_single_plain_token_node_id_has_an_inbox(node: str, usable: bool) -> None:
    if usable:
        assert inbox_prefix("C", node) == f"_INBOX.wm-C.{node}"
    else:
        with pytest.raises(ValueError, match="cannot be part of a NATS subject"):
            inbox_prefix("C", node)


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
        NatsServers.parse(secured.url),
        name="stranger",
        timeout=5,
        auth=NatsAuth(nkey_seed_file=stranger.seed_file),
    )
    with pytest.raises(NatsRefused, match=r"refused this node's credentials.*Authorization"):
        await bus.connect()
    with pytest.raises(NatsRefused, match="Authorization Violation"):
        await server_info(
            NatsServers.parse(secured.url), connect_timeout=5
        )  # no credentials at all


async def test_the_error_callback_holds_only_the_connection_attempt() -> None:
    """nats-py awaits the error callback from more than the connection attempt: its
    `close()` does too, when closing the transport fails. After a refusal the callback
    parks the attempt until `connect()` stops it; any other caller must get it back at
    once, or the close of a refused connection hangs (it did, on a busy machine)."""
    bus = JetStreamBus(NatsServers.parse("nats://127.0.0.1:4222"), name="callback", timeout=1)
    bus.refusal = "NATS refused this node's credentials (nats: 'Authorization Violation')"
    await asyncio.wait_for(bus._on_error(ConnectionResetError("reset by peer")), timeout=2)
    assert bus.last_error == "reset by peer"


async def test_user_and_password_in_the_url_work_and_are_never_shown(
    secured: EmbeddedNats,
) -> None:
    url = operator_url(secured)
    info = await server_info(NatsServers.parse(url), connect_timeout=5)
    assert info["jetstream"] is True
    shown = redact_url(url)
    assert "operator-pass" not in shown and shown.endswith(f"@{secured.host}:{secured.port}")
    assert redact_url("nats://s3cr3t-token@nats.example:4222") == "nats://***@nats.example:4222"


@pytest.mark.parametrize("node", ["node c", "node-c1.eu"])
async def test_a_node_id_that_is_no_subject_switches_the_worker_off(
    secured: EmbeddedNats, make_settings: SettingsFactory, node: str
) -> None:
    """Its inbox prefix and events subject could not be written: the worker says so in
    /v1/status instead of running with subjects its user may not use."""
    app = create_app(
        make_settings(nats_url=secured.url, node_id=node, node_tier="C", worker_enabled=True)
    )
    async with running(app) as client:
        worker = (await client.get("/v1/status")).json()["components"]["worker"]
    assert worker["state"] == "off"
    assert "cannot be part of a NATS subject" in worker["reason"]
