"""Node key loading in every accepted format, and signatures a verifier accepts."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.adapters.signing import (
    InvalidKeyError,
    NodeSigner,
    generate_keypair,
    load_private_key,
    node_id_for,
    parse_private_key,
)
from app.domain.signing import canonical_request

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
SEED = KEY.private_bytes(
    serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
)
PEM = KEY.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@pytest.mark.parametrize(
    "text",
    [PEM, "\n" + PEM + "\n", base64.b64encode(SEED).decode(), SEED.hex(), SEED.hex().upper()],
)
def test_accepted_formats_give_the_same_key(text: str) -> None:
    assert raw_public(parse_private_key(text)) == raw_public(KEY)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "32-byte seed"),
        ("not base64 !!", "32-byte seed"),
        (base64.b64encode(b"short").decode(), "32-byte seed"),
        ("-----BEGIN PRIVATE KEY-----\ngarbage\n-----END PRIVATE KEY-----", "PKCS#8 PEM"),
    ],
)
def test_rejected_keys_say_why_without_echoing(text: str, says: str) -> None:
    with pytest.raises(InvalidKeyError) as caught:
        parse_private_key(text)
    assert says in str(caught.value)
    assert str(caught.value).startswith("NODE_PRIVATE_KEY:")


def test_non_ed25519_pem_is_refused() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    other = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(InvalidKeyError, match="not an Ed25519 key"):
        parse_private_key(other.decode())


def test_key_file(tmp_path: Path) -> None:
    path = tmp_path / "node.pem"
    path.write_text(PEM)
    key = load_private_key(inline=None, file=path)
    assert key is not None and raw_public(key) == raw_public(KEY)
    with pytest.raises(InvalidKeyError, match="NODE_PRIVATE_KEY_FILE: cannot read"):
        load_private_key(inline=None, file=tmp_path / "missing.pem")
    assert load_private_key(inline=None, file=None) is None


def test_signer_headers_verify_and_repr_hides_the_key() -> None:
    signer = NodeSigner("n1", KEY)
    headers = signer.headers(method="post", target="/v1/x?y=1", body=b"{}", timestamp=1_700_000_000)
    assert headers["X-Node-Id"] == "n1"
    assert headers["X-Node-Timestamp"] == "1700000000"
    message = canonical_request(
        method="POST", target="/v1/x?y=1", timestamp="1700000000", body=b"{}"
    )
    KEY.public_key().verify(base64.b64decode(headers["X-Node-Signature"]), message)
    assert SEED.hex() not in repr(signer) and "***" in repr(signer)


def test_generated_keys_round_trip_and_node_ids_are_stable() -> None:
    pem, seed, public = generate_keypair()
    from_pem, from_seed = parse_private_key(pem), parse_private_key(seed)
    assert raw_public(from_pem) == raw_public(from_seed) == base64.b64decode(public)
    assert node_id_for(from_pem.public_key()) == node_id_for(from_seed.public_key())
    assert node_id_for(from_pem.public_key()).startswith("node-")
