"""A nats-server with users and per-tier permissions, as a fleet's NATS would have them:
an operator (user and password) who makes the topology, and one nkey user per tier whose
permissions cover exactly what a worker of that tier needs (its durable consumers, its
acks, the events stream, the ledger bucket, its inboxes)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import nkeys

from app.adapters.embedded import EmbeddedNats

OPERATOR = ("operator", "operator-pass")


@dataclass(frozen=True)
class NkeyUser:
    seed_file: Path
    public_key: str


def new_nkey_user(directory: Path, name: str) -> NkeyUser:
    """A fresh nkey user: its seed in a file only its owner reads, and its public key."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public_key = nkeys.from_seed(seed).public_key.decode()
    path = directory / f"{name}.nk"
    path.write_bytes(seed + b"\n")
    path.chmod(0o600)
    return NkeyUser(path, public_key)


def worker_permissions(tier: str) -> str:
    durable = f"wm-{tier}"
    publish = [
        "$JS.API.INFO", "$JS.API.STREAM.INFO.*",
        f"$JS.API.CONSUMER.INFO.*.{durable}", f"$JS.API.CONSUMER.CREATE.*.{durable}",
        f"$JS.API.CONSUMER.CREATE.*.{durable}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.*.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.*.{durable}", f"$JS.ACK.*.{durable}.>",
        "mm.events.>", "$KV.JOB_LEDGER.>", "$JS.API.DIRECT.GET.KV_JOB_LEDGER.>",
        "$JS.API.STREAM.MSG.GET.KV_JOB_LEDGER",
    ]  # fmt: skip
    allowed = ", ".join(f'"{subject}"' for subject in publish)
    return f'{{publish: {{allow: [{allowed}]}}, subscribe: {{allow: ["_INBOX.>"]}}}}'


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
