"""The canonical string a node signs for each backend request (CONTRACTS §1).

Kept pure so that the signer (adapters) and any verifier agree byte for byte.
"""

from __future__ import annotations

import hashlib

NODE_ID_HEADER = "X-Node-Id"
TIMESTAMP_HEADER = "X-Node-Timestamp"
SIGNATURE_HEADER = "X-Node-Signature"


def canonical_request(*, method: str, target: str, timestamp: str, body: bytes) -> bytes:
    """`METHOD\\nTARGET\\nTIMESTAMP\\nsha256(body)` as UTF-8; TARGET is path plus `?query`."""
    digest = hashlib.sha256(body).hexdigest()
    return f"{method.upper()}\n{target}\n{timestamp}\n{digest}".encode()
