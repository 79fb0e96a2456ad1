"""A nats-server with the fleet's accounts and users, as k8s/nats/auth.conf.example ships
them (or the file `NATS_AUTH_FILE` names, to try a candidate): the streams and buckets in
the account JOBS, where the operator (user and password) makes the topology; one account
per tier, whose nkey user imports and may use exactly what a worker of that tier needs
(its own durable consumers on the job streams by name and filter, their acks, its tier's
ledger bucket, the events subjects and its own inboxes: `tier_permissions`, which
tests/k8s/test_nats_manifests.py keeps equal to the example); and the producers' account,
which may publish jobs. The tests fill the example's placeholders with fresh keys."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nkeys
import pytest

from app.adapters.bus import JetStreamBus, NatsAuth
from app.adapters.embedded import EmbeddedNats
from app.adapters.kv_ledger import bucket
from app.domain.jobs import STREAMS, consumer_filter, consumer_name
from app.domain.nats_servers import NatsServers
from app.services.streams import init_streams
from app.settings import Settings

OPERATOR = ("operator", "operator-pass")
ROOT = Path(__file__).resolve().parents[2]
AUTH_EXAMPLE = ROOT / "k8s" / "nats" / "auth.conf.example"
PRODUCERS = "producers"
PLACEHOLDER_NKEY = "REPLACE_WITH_{name}_PUBLIC_NKEY"
PLACEHOLDER_HASH = "$2a$11$REPLACE_WITH_A_BCRYPT_HASH_OF_THE_OPERATOR_PASSWORD"
ALL_TIERS = ("A", "B", "C")
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


def producer_subjects() -> tuple[str, ...]:
    """What the producers publish: jobs of every kind, for every tier."""
    return tuple(f"mm.{kind}.>" for kind in STREAMS)


def auth_file() -> Path:
    """The accounts file the tests run against: `NATS_AUTH_FILE`, else the shipped example."""
    named = os.environ.get("NATS_AUTH_FILE")
    return Path(named) if named else AUTH_EXAMPLE


def placeholder(name: str) -> str:
    """The example's stand-in for the public nkey of a tier ("A") or of the producers."""
    return PLACEHOLDER_NKEY.format(name=f"TIER_{name}" if name in ALL_TIERS else name.upper())


def filled(text: str, users: dict[str, NkeyUser]) -> str:
    """The accounts file with `users`' public keys (a tier's, or `PRODUCERS`) and the
    operator's password in place of the placeholders; a key nobody holds for the rest."""
    for name in (*ALL_TIERS, PRODUCERS):
        key = users[name].public_key if name in users else _unheld_key()
        text = text.replace(placeholder(name), key)
    return text.replace(PLACEHOLDER_HASH, OPERATOR[1])


def _unheld_key() -> str:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return str(nkeys.from_seed(seed).public_key.decode())


def start_server(directory: Path, users: dict[str, NkeyUser]) -> EmbeddedNats:
    """nats-server with JetStream and the accounts file (`auth_file()`), its placeholders
    filled with `users`' keys."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "nats.conf"
    config.write_text(filled(auth_file().read_text(), users))
    return EmbeddedNats(directory / "data", config=config).start()


def operator_url(server: EmbeddedNats) -> str:
    return f"nats://{OPERATOR[0]}:{OPERATOR[1]}@{server.host}:{server.port}"


# The fixtures of the tests that run against such a server; a test module takes them in
# with `users = nats_auth.users` (and the same for `secured`, `topology`).


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NkeyUser]:
    """Every tier's nkey user, and the producers'."""
    keys = tmp_path_factory.mktemp("nkeys")
    made = {tier: new_nkey_user(keys, f"tier-{tier}") for tier in ALL_TIERS}
    return {**made, PRODUCERS: new_nkey_user(keys, PRODUCERS)}


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


async def operators_step(url: str, auth: NatsAuth | None = None) -> None:
    """The operator's step: streams, consumers and the ledger buckets (idempotent)."""
    bus = JetStreamBus(NatsServers.parse(url), name="operator", timeout=5, auth=auth)
    await bus.connect()
    try:
        await init_streams(bus, Settings(_env_file=None))
    finally:
        await bus.drain()


@pytest.fixture
async def topology(secured: EmbeddedNats) -> None:
    await operators_step(operator_url(secured))
