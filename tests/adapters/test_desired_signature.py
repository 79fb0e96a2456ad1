"""The desired state's Ed25519 check: any trusted key (rotation), bound to the node and
to the exact bytes; every way an answer is not signed is refused with its reason."""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from app.adapters.desired_signature import DesiredStateVerifier
from app.domain.desired_trust import TrustError, signed_bytes

OLD, NEW, STRANGER = (Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32) for i in (1, 2, 3))
BODY = b'{"serial": 42, "node_id": "node-a", "workloads": []}'


def raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def header(key: Ed25519PrivateKey, node: str = "node-a", body: bytes = BODY) -> str:
    return base64.b64encode(key.sign(signed_bytes(node, body))).decode()


VERIFIER = DesiredStateVerifier([raw(OLD), raw(NEW)])


@pytest.mark.parametrize("key", [OLD, NEW], ids=["old-key", "new-key"])
def test_either_trusted_key_verifies(key: Ed25519PrivateKey) -> None:
    VERIFIER.verify(node_id="node-a", body=BODY, header=header(key))


@pytest.mark.parametrize(
    ("node", "body", "signed", "says"),
    [
        ("node-a", BODY, None, "unsigned"),
        ("node-a", BODY, "!!", "is not base64"),
        ("node-a", BODY, header(STRANGER), "not by a trusted key"),
        ("node-a", BODY + b" ", header(NEW), "not by a trusted key"),  # tampered body
        ("node-b", BODY, header(NEW), "for this node (node-b)"),  # another node's answer
    ],
)
def test_what_is_not_signed_for_this_node_and_body_is_refused(
    node: str, body: bytes, signed: str | None, says: str
) -> None:
    with pytest.raises(TrustError, match=re.escape(says)):
        VERIFIER.verify(node_id=node, body=body, header=signed)


def test_a_verifier_needs_a_key() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        DesiredStateVerifier([])


def test_the_local_backend_signs_what_it_serves_and_moves_its_serial_on_change() -> None:
    import json

    from standins.backend import LocalBackend
    from standins.sync_world import manifest

    local = LocalBackend("node-a", OLD.public_key())
    local.signing_key = NEW
    local.set_manifest("api", "1.0.0", manifest("api", "1.0.0"))
    local.set_desired([{"name": "api", "version": "1.0.0"}])

    def served() -> tuple[bytes, dict[str, Any]]:
        reply = local._get_workloads({})
        assert reply.status == 200
        signed = dict(reply.headers)["X-Desired-State-Signature"]
        VERIFIER.verify(node_id="node-a", body=reply.body, header=signed)
        return reply.body, json.loads(reply.body)

    first, state = served()
    assert (state["serial"], state["node_id"]) == (1, "node-a")
    assert (
        state["workloads"][0]["manifest_sha256"]
        == hashlib.sha256(json.dumps(manifest("api", "1.0.0")).encode()).hexdigest()
    )
    again, _ = served()
    assert again == first  # the same serial is the same bytes
    local.set_desired([{"name": "api", "version": "1.0.0"}, {"name": "web", "version": "2"}])
    _, state = served()
    assert state["serial"] == 2
