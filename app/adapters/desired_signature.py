"""The Ed25519 check of a signed desired state (the bytes it covers are the domain's:
`app.domain.desired_trust.signed_bytes`). Several keys may be trusted at once
(DESIRED_STATE_PUBLIC_KEYS), so the backend can rotate its key: an answer is taken when
any of them verifies it."""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from app.domain.desired_trust import TrustError, parse_signature, signed_bytes


class DesiredStateVerifier:
    def __init__(self, keys: Sequence[bytes]) -> None:
        """`keys`: raw 32-byte Ed25519 public keys (at least one)."""
        if not keys:
            raise ValueError("a verifier needs at least one key")
        self._keys = [Ed25519PublicKey.from_public_bytes(k) for k in keys]

    def verify(self, *, node_id: str, body: bytes, header: str | None) -> None:
        """Return when a trusted key signed `body` for `node_id`; TrustError naming why
        not (unsigned, malformed, or signed by no trusted key for this node and body)."""
        signature = parse_signature(header)
        message = signed_bytes(node_id, body)
        for key in self._keys:
            try:
                key.verify(signature, message)
            except InvalidSignature:
                continue
            return
        raise TrustError(
            f"the signature is not by a trusted key for this node ({node_id}) and these "
            f"bytes ({len(self._keys)} key(s) tried)"
        )
