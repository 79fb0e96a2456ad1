"""NATS decentralised authentication (operator mode) for tests: an operator, a system
account, the account JOBS that holds the streams and exports each JetStream service a tier
needs, one account per tier that imports exactly its tier's services and whose scoped
signing key carries the permission template every node of that tier gets, and user JWTs
named after their node: the same accounts as k8s/nats/auth.conf.example, as JWTs.

What `nsc` makes for an operator (k8s/nats/README.md, "Per-node identities"), minted here
with the `nkeys` package: a JWT is base64url(header).base64url(claims).base64url(Ed25519
signature of the first two parts by the issuer's nkey), header
`{"typ":"JWT","alg":"ed25519-nkey"}`, claims as github.com/nats-io/jwt v2 writes them.
nats-server expands `{{name()}}` in a scoped key's template to the user JWT's name when the
user connects (server/auth.go, processUserPermissionsTemplate), and a user issued by a
scoped key may carry no permissions of its own, so whoever holds a tier's key can issue
that tier's nodes and nothing wider."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys

from app.adapters.embedded import EmbeddedNats
from tests.support.nats_auth import NODE_NAME_TEMPLATE, producer_subjects, tier_permissions

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
NO_LIMIT = -1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class Key:
    """An nkey pair: the seed (secret) and its public key."""

    seed: bytes

    @staticmethod
    def new(prefix: int) -> Key:
        return Key(nkeys.encode_seed(os.urandom(32), prefix))

    @property
    def public(self) -> str:
        return str(nkeys.from_seed(self.seed).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return bytes(nkeys.from_seed(self.seed).sign(data))


def encode(subject: str, name: str, nats: dict[str, Any], issuer: Key) -> str:
    """A JWT with these claims, signed by `issuer`."""
    claims: dict[str, Any] = {
        "iat": int(time.time()), "iss": issuer.public, "name": name, "sub": subject,
        "nats": {**nats, "version": 2},
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signed = f"{_b64(json.dumps(HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def tier_template(tier: str) -> dict[str, Any]:
    """The user permission template of tier `tier`'s signing key."""
    permissions = tier_permissions(tier, NODE_NAME_TEMPLATE)
    return {
        "pub": {"allow": list(permissions.publish)},
        "sub": {"allow": list(permissions.subscribe)},
        "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
    }  # fmt: skip


LIMITS = {"subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT, "imports": NO_LIMIT,
          "exports": NO_LIMIT, "wildcards": True, "conn": NO_LIMIT, "leaf": NO_LIMIT}  # fmt: skip
JETSTREAM = {"mem_storage": NO_LIMIT, "disk_storage": NO_LIMIT, "streams": NO_LIMIT,
             "consumer": NO_LIMIT}  # fmt: skip


def service_exports(tiers: tuple[str, ...]) -> list[dict[str, Any]]:
    """What JOBS exports: every subject a tier's worker publishes, and the producers' job
    subjects; a pull (`CONSUMER.MSG.NEXT`) answers with many messages."""
    subjects = dict.fromkeys(
        [*(s for tier in tiers for s in tier_permissions(tier).publish), *producer_subjects()]
    )
    return [
        {"name": subject, "subject": subject, "type": "service",
         **({"response_type": "Stream"} if ".CONSUMER.MSG.NEXT." in subject else {})}
        for subject in subjects
    ]  # fmt: skip


def service_imports(subjects: tuple[str, ...], jobs: str) -> list[dict[str, Any]]:
    return [
        {"name": subject, "subject": subject, "account": jobs, "type": "service"}
        for subject in subjects
    ]


@dataclass
class Fleet:
    """The operator, the system account, JOBS, and one account per tier with its signing
    key."""

    tiers: tuple[str, ...]
    operator: Key = field(default_factory=lambda: Key.new(nkeys.PREFIX_BYTE_OPERATOR))
    system: Key = field(default_factory=lambda: Key.new(nkeys.PREFIX_BYTE_ACCOUNT))
    jobs: Key = field(default_factory=lambda: Key.new(nkeys.PREFIX_BYTE_ACCOUNT))
    tier_accounts: dict[str, Key] = field(default_factory=dict)
    tier_keys: dict[str, Key] = field(default_factory=dict)
    revoked: dict[str, int] = field(default_factory=dict)  # user public key: issued before

    operator_jwt: str = ""
    system_jwt: str = ""

    def __post_init__(self) -> None:
        for tier in self.tiers:
            self.tier_accounts.setdefault(tier, Key.new(nkeys.PREFIX_BYTE_ACCOUNT))
            self.tier_keys.setdefault(tier, Key.new(nkeys.PREFIX_BYTE_ACCOUNT))
        # issued once: nats-server reloads changed accounts, not a changed operator
        nats = {"type": "operator", "system_account": self.system.public}
        self.operator_jwt = encode(self.operator.public, "fleet", nats, self.operator)
        self.system_jwt = encode(self.system.public, "SYS", {"type": "account"}, self.operator)

    def jobs_jwt(self) -> str:
        """JOBS: JetStream, the operator's user, and the services every tier imports."""
        nats: dict[str, Any] = {
            "type": "account", "limits": {**LIMITS, **JETSTREAM},
            "exports": service_exports(self.tiers),
            "default_permissions": {"pub": {}, "sub": {}},
        }  # fmt: skip
        return encode(self.jobs.public, "JOBS", nats, self.operator)

    def tier_jwt(self, tier: str) -> str:
        """TIER_<tier>: no JetStream of its own, its tier's services imported from JOBS, and
        the scoped signing key whose template every node of the tier gets."""
        signing_key = {
            "kind": "user_scope", "key": self.tier_keys[tier].public, "role": f"tier-{tier}",
            "template": tier_template(tier), "description": f"the nodes of tier {tier}",
        }  # fmt: skip
        nats: dict[str, Any] = {
            "type": "account", "limits": LIMITS, "signing_keys": [signing_key],
            "imports": service_imports(tier_permissions(tier).publish, self.jobs.public),
            "default_permissions": {"pub": {}, "sub": {}},
        }  # fmt: skip
        if self.revoked:
            nats["revocations"] = dict(self.revoked)
        return encode(self.tier_accounts[tier].public, f"TIER_{tier}", nats, self.operator)

    def server_config(self) -> str:
        """What `nsc generate config --mem-resolver` writes: the auth part of nats.conf."""
        return (
            f"operator: {self.operator_jwt}\n"
            f"system_account: {self.system.public}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f"  {self.system.public}: {self.system_jwt}\n"
            f"  {self.jobs.public}: {self.jobs_jwt()}\n"
            + "".join(
                f"  {self.tier_accounts[tier].public}: {self.tier_jwt(tier)}\n"
                for tier in self.tiers
            )
            + "}\n"
        )

    def node_creds(
        self, directory: Path, node_id: str, tier: str, *, extra: dict[str, Any] | None = None
    ) -> tuple[Path, str]:
        """A creds file for `node_id`, issued under tier `tier`'s signing key (its
        permissions are the key's template), and the user's public key; `extra` claims
        (permissions of its own) make a JWT the server must refuse."""
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        nats = {"type": "user", "issuer_account": self.tier_accounts[tier].public, **(extra or {})}
        token = encode(user.public, node_id, nats, self.tier_keys[tier])
        return _creds(directory / f"{node_id}.creds", token, user), user.public

    def admin_creds(self, directory: Path) -> Path:
        """The operator's user (init-streams) in JOBS: issued by that account's key itself,
        with no permissions set, so it may use every subject of the account."""
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        nats = {
            "type": "user", "pub": {}, "sub": {},
            "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
        }  # fmt: skip
        return _creds(
            directory / "admin.creds", encode(user.public, "admin", nats, self.jobs), user
        )

    def start_server(self, directory: Path) -> EmbeddedNats:
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "nats.conf"
        config.write_text(self.server_config())
        return EmbeddedNats(directory / "data", config=config).start()

    def reload(self, server: EmbeddedNats) -> None:
        """Write the accounts as they are now (a revocation, say) and reload the server,
        as an operator does after `nsc generate config`."""
        assert server.config is not None
        server.config.write_text(self.server_config())
        subprocess.run(
            [EmbeddedNats.binary(), "--signal", f"reload={server.data_dir / 'nats-server.pid'}"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip


def _creds(path: Path, token: str, user: Key) -> Path:
    path.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{token}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user.seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )
    path.chmod(0o600)
    return path
