"""The node's Ed25519 identity: loading the key, deriving the node id, signing requests.

Accepts a PKCS#8 PEM, or a 32-byte seed as base64 or hex (the node CLI's formats), from
NODE_PRIVATE_KEY, NODE_PRIVATE_KEY_FILE, or the `private_key` of the original service's
YAML config file. The private key never leaves this module except as a signature; its
repr is masked, and no error message quotes it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
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


CONFIG_KEY_FIELD = "private_key"
CONFIG_NODE_ID_FIELD = "node_id"


@dataclass(frozen=True)
class ConfigFileIdentity:
    """What the manager takes from the original service's config file."""

    key: Ed25519PrivateKey = field(repr=False)
    node_id: str | None


def load_config_file(path: Path) -> ConfigFileIdentity:
    """The node's key, and its id if given, from the original service's YAML config file
    (`~/.config/lfgnode/config.yaml`, or NODE_CONFIG_FILE).

    `private_key` is required, in any format NODE_PRIVATE_KEY takes; `node_id` is optional.
    Every other key belongs to the old service and is ignored. An error names the file and
    the field, never the value (YAML errors keep only their line and column: their snippet
    could be the key).
    """
    needs = f"a mapping with {CONFIG_KEY_FIELD}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidKeyError(f"{path}: cannot read {CONFIG_KEY_FIELD}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidKeyError(f"{path}: not UTF-8 text, expected {needs}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
            where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
        raise InvalidKeyError(f"{path}: not valid YAML{where}, expected {needs}") from None
    if not isinstance(data, dict):
        found = "an empty file" if data is None else f"a YAML {type(data).__name__}"
        hint = " (a file holding only the key goes in NODE_PRIVATE_KEY_FILE)"
        raise InvalidKeyError(
            f"{path}: expected {needs}, found {found}" + (hint if isinstance(data, str) else "")
        )
    value = data.get(CONFIG_KEY_FIELD)
    if value is None:
        raise InvalidKeyError(f"{path}: {CONFIG_KEY_FIELD} is missing or empty")
    if not isinstance(value, str):
        raise InvalidKeyError(
            f"{path}: {CONFIG_KEY_FIELD} must be a string (a PKCS#8 PEM or a 32-byte seed in "
            f"base64 or hex), not a YAML {type(value).__name__}"
        )
    key = parse_private_key(value, source=f"{path}: {CONFIG_KEY_FIELD}")
    node_id = data.get(CONFIG_NODE_ID_FIELD)
    if node_id is not None and (not isinstance(node_id, str) or not node_id.strip()):
        raise InvalidKeyError(
            f"{path}: {CONFIG_NODE_ID_FIELD} must be a non-empty string "
            "(quote it if it looks like a number)"
        )
    return ConfigFileIdentity(key, node_id.strip() if node_id is not None else None)


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
