"""A nats-server with users and per-tier permissions, as a fleet's NATS would have them:
an operator (user and password) who makes the topology, and one nkey user per tier whose
permissions cover exactly what a worker of that tier needs: its own durable consumers on
the job streams by name and filter, their acks, its tier's ledger bucket, its
node's events subject and its own inboxes (k8s/nats/auth.conf.example carries the same
lists; tests/k8s/test_nats_manifests.py keeps the two equal)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nkeys
import pytest

from app.adapters.bus import JetStreamBus
from app.adapters.embedded import EmbeddedNats
from app.adapters.kv_ledger import bucket
from app.domain.jobs import STREAMS, consumer_filter, consumer_name
from app.services.streams import init_streams
from app.settings import Settings

OPERATOR = ("operator", "operator-pass")
# what stands for "any node of the tier" in a tier user's subjects; a per-node identity
# (a user JWT issued under the tier's signing key) has its own name there instead
ANY_NODE = "*"
NODE_NAME_TEMPLATE = "{{name()}}"


@dataclass(frozen=True)
class NkeyUser:
    seed_file: Path
    public_key: str


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def conf(self) -> str:
        """The nats-server configuration form."""

        def allowed(subjects: tuple[str, ...]) -> str:
            return ", ".join(f'"{subject}"' for subject in subjects)

        return (
            f"{{publish: {{allow: [{allowed(self.publish)}]}}, "
            f"subscribe: {{allow: [{allowed(self.subscribe)}]}}}}"
        )


def new_nkey_user(directory: Path, name: str) -> NkeyUser:
    """A fresh nkey user: its seed in a file only its owner reads, and its public key."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public_key = nkeys.from_seed(seed).public_key.decode()
    path = directory / f"{name}.nk"
    path.write_bytes(seed + b"\n")
    path.chmod(0o600)
    return NkeyUser(path, public_key)


def tier_permissions(tier: str, node: str = ANY_NODE) -> Permissions:
    """What a worker of `tier` on `node` publishes and subscribes, and nothing more."""
    durable = consumer_name(tier)
    ledger = bucket(tier)
    publish = ["$JS.API.INFO", f"$JS.API.STREAM.INFO.KV_{ledger}"]
    for kind, stream in STREAMS.items():
        publish += [
            f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
            # the filter is part of the subject (the server checks it against the body's)
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{consumer_filter(kind, tier)}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>",
        ]
    publish += [
        f"mm.events.{node}.>",
        f"$KV.{ledger}.>",
        f"$JS.API.DIRECT.GET.KV_{ledger}.$KV.{ledger}.>",
    ]
    return Permissions(tuple(publish), (f"_INBOX.wm-{tier}.{node}.>",))


def worker_permissions(tier: str) -> str:
    """A tier user's permissions in the nats-server configuration form."""
    return tier_permissions(tier).conf()


def start_server(directory: Path, tiers: dict[str, NkeyUser]) -> EmbeddedNats:
    """nats-server with JetStream, the operator, and one nkey user per tier."""
    users = [f'{{user: "{OPERATOR[0]}", password: "{OPERATOR[1]}"}}']
    users += [
        f'{{nkey: "{user.public_key}", permissions: {worker_permissions(tier)}}}'
        for tier, user in tiers.items()
    ]
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "nats.conf"
    config.write_text("authorization {\n  users = [\n    " + "\n    ".join(users) + "\n  ]\n}\n")
    return EmbeddedNats(directory / "data", config=config).start()


def operator_url(server: EmbeddedNats) -> str:
    return f"nats://{OPERATOR[0]}:{OPERATOR[1]}@{server.host}:{server.port}"


# The fixtures of the tests that run against such a server; a test module takes them in
# with `users = nats_auth.users` (and the same for `secured`, `topology`).


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NkeyUser]:
    """Tier A's and tier C's nkey users."""
    keys = tmp_path_factory.mktemp("nkeys")
    return {tier: new_nkey_user(keys, f"tier-{tier}") for tier in ("A", "C")}


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, users: dict[str, NkeyUser]
) -> Iterator[EmbeddedNats]:
    """A nats-server with the operator and `users`, for the module's tests."""
    server = start_server(tmp_path_factory.mktemp("secured-nats"), users)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def topology(secured: EmbeddedNats) -> None:
    """The operator's step: streams, consumers and the ledger buckets (idempotent)."""
    bus = JetStreamBus(operator_url(secured), name="operator", timeout=5)
    await bus.connect()
    try:
        await init_streams(bus, Settings(_env_file=None))
    finally:
        await bus.drain()
