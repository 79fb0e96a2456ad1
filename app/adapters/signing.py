"""The node's Ed25519 identity: loading the key, deriving the node id, signing requests.

Accepts a PKCS#8 PEM, or a 32-byte seed as base64 or hex (the node CLI's formats).
The private key never leaves this module except as a signature; its repr is masked.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from app.domain.signing import (
    NODE_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    canonical_request,
)

_HEX_SEED = re.compile(r"^[0-9a-fA-F]{64}$")


class InvalidKeyError(ValueError):
    """The configured key is not a usable Ed25519 private key (message names the source)."""


def parse_private_key(text: str, *, source: str = "NODE_PRIVATE_KEY") -> Ed25519PrivateKey:
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(text.encode(), password=None)
        except (ValueError, TypeError):
            raise InvalidKeyError(f"{source}: not a readable unencrypted PKCS#8 PEM key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidKeyError(f"{source}: the PEM key is not an Ed25519 key")
        return key
    seed: bytes | None = None
    if _HEX_SEED.fullmatch(text):
        seed = bytes.fromhex(text)
    else:
        try:
            seed = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            seed = None
    if seed is None or len(seed) != 32:
        raise InvalidKeyError(f"{source}: expected a PKCS#8 PEM or a 32-byte seed in base64 or hex")
    return Ed25519PrivateKey.from_private_bytes(seed)


def load_private_key(*, inline: str | None, file: Path | None) -> Ed25519PrivateKey | None:
    if inline is not None:
        return parse_private_key(inline)
    if file is not None:
        try:
            text = file.read_text()
        except OSError as exc:
            raise InvalidKeyError(
                f"NODE_PRIVATE_KEY_FILE: cannot read {file}: {exc.strerror}"
            ) from None
        return parse_private_key(text, source="NODE_PRIVATE_KEY_FILE")
    return None


def public_key_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def node_id_for(key: Ed25519PublicKey) -> str:
    """A stable node id from the public key when none is configured."""
    return "node-" + hashlib.sha256(public_key_bytes(key)).hexdigest()[:16]


@dataclass(frozen=True)
class NodeSigner:
    node_id: str
    _key: Ed25519PrivateKey

    def __repr__(self) -> str:
        return f"NodeSigner(node_id={self.node_id!r}, key=***)"

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def headers(self, *, method: str, target: str, body: bytes, timestamp: int) -> dict[str, str]:
        ts = str(timestamp)
        message = canonical_request(method=method, target=target, timestamp=ts, body=body)
        signature = base64.b64encode(self._key.sign(message)).decode()
        return {NODE_ID_HEADER: self.node_id, TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: signature}


def generate_keypair() -> tuple[str, str, str]:
    """A new key as (PKCS#8 PEM, base64 seed, base64 public key)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    seed = key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    public = public_key_bytes(key.public_key())
    return pem, base64.b64encode(seed).decode(), base64.b64encode(public).decode()
