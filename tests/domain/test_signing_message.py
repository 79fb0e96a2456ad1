"""The canonical request string is fixed by the contract: check it byte for byte."""

from __future__ import annotations

import hashlib

import pytest

from app.domain.signing import canonical_request

EMPTY_SHA = hashlib.sha256(b"").hexdigest()
BODY_SHA = hashlib.sha256(b'{"a":1}').hexdigest()


@pytest.mark.parametrize(
    ("method", "target", "body", "expected"),
    [
        (
            "get",
            "/v1/nodes/n1/workloads",
            b"",
            f"GET\n/v1/nodes/n1/workloads\n1700000000\n{EMPTY_SHA}",
        ),
        (
            "POST",
            "/v1/nodes/n1/health",
            b'{"a":1}',
            f"POST\n/v1/nodes/n1/health\n1700000000\n{BODY_SHA}",
        ),
        (
            "GET",
            "/v1/nodes/n1/workloads/api/manifest?version=1.2.0",
            b"",
            f"GET\n/v1/nodes/n1/workloads/api/manifest?version=1.2.0\n1700000000\n{EMPTY_SHA}",
        ),
    ],
)
def test_canonical_request(method: str, target: str, body: bytes, expected: str) -> None:
    message = canonical_request(method=method, target=target, timestamp="1700000000", body=body)
    assert message == expected.encode()
