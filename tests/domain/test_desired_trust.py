"""Trust in a desired state, pure: the signed bytes, the signature header, the binding to
the node, the order of serials, manifest digests, and the store's packing and budget."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib

import pytest

from app.domain.desired_trust import (
    DEFAULT_STORE_BUDGET,
    SIGNATURE_HEADER,
    Accepted,
    Stored,
    TrustError,
    check_binding,
    check_manifest,
    order,
    pack,
    parse_signature,
    signed_bytes,
    unpack,
)
from standins.sync_world import manifest


def test_the_signed_bytes_bind_the_body_to_the_node() -> None:
    body = b'{"serial": 7}'
    assert signed_bytes("node-a", body) == (
        b"workload-manager desired-state v1\nnode-a\n" + hashlib.sha256(body).hexdigest().encode()
    )
    assert signed_bytes("node-a", body) != signed_bytes("node-b", body)
    assert signed_bytes("node-a", body) != signed_bytes("node-a", body + b" ")


SIG = bytes(range(64))


@pytest.mark.parametrize(
    ("header", "says"),
    [
        (None, f"unsigned: no {SIGNATURE_HEADER} header"),
        ("  ", "unsigned"),
        ("not base64!", "is not base64"),
        (base64.b64encode(SIG[:63]).decode(), "holds 63 bytes, not 64"),
        (base64.b64encode(SIG + b"x").decode(), "holds 65 bytes"),
    ],
)
def test_a_signature_header_that_is_not_one_is_refused(header: str | None, says: str) -> None:
    with pytest.raises(TrustError, match=says):
        parse_signature(header)


def test_a_signature_header_reads_as_its_bytes() -> None:
    assert parse_signature(" " + base64.b64encode(SIG).decode() + " ") == SIG


@pytest.mark.parametrize(
    ("claimed", "serial", "result"),
    [
        ("node-a", 0, 0),
        ("node-a", 42, 42),
        ("node-b", 42, "is for node 'node-b', not this node"),
        (None, 42, "is for node None"),
        ("node-a", None, "has no serial"),
        ("node-a", -1, "has no serial"),
        ("node-a", True, "has no serial"),
        ("node-a", "42", "has no serial"),
        ("node-a", 4.2, "has no serial"),
    ],
)
def test_a_state_names_this_node_and_a_serial(
    claimed: object, serial: object, result: object
) -> None:
    if isinstance(result, int):
        assert check_binding(claimed_node=claimed, serial=serial, node_id="node-a") == result
    else:
        with pytest.raises(TrustError, match=str(result)):
            check_binding(claimed_node=claimed, serial=serial, node_id="node-a")


A = Accepted(42, "a" * 64)


@pytest.mark.parametrize(
    ("candidate", "last", "result"),
    [
        (A, None, True),  # the first one
        (Accepted(43, "b" * 64), A, True),  # newer
        (Accepted(10**12, "b" * 64), A, True),  # any jump forward
        (A, A, False),  # the same one again (a 200 where a 304 would do)
        (Accepted(41, "b" * 64), A, "serial 41 is below the last accepted 42"),
        (Accepted(41, "a" * 64), A, "a replayed or stale answer"),
        (Accepted(42, "b" * 64), A, "serial 42 again, with other bytes"),
    ],
)
def test_serials_only_go_forward(
    candidate: Accepted, last: Accepted | None, result: object
) -> None:
    if isinstance(result, bool):
        assert order(candidate, last) is result
    else:
        with pytest.raises(TrustError, match=str(result)):
            order(candidate, last)


RAW = json.dumps(manifest("api", "1.0.0")).encode()


@pytest.mark.parametrize(
    ("raw", "expected", "says"),
    [
        (RAW, hashlib.sha256(RAW).hexdigest(), None),
        (RAW, hashlib.sha256(RAW).hexdigest().upper(), None),
        (RAW + b"\n", hashlib.sha256(RAW).hexdigest(), "api 1.0.0: the manifest's SHA-256 is"),
        (RAW, None, "names no manifest_sha256"),
    ],
)
def test_a_manifest_must_be_the_bytes_its_state_signed(
    raw: bytes, expected: str | None, says: str | None
) -> None:
    if says is None:
        check_manifest(raw, expected, name="api", version="1.0.0")
    else:
        with pytest.raises(TrustError, match=says):
            check_manifest(raw, expected, name="api", version="1.0.0")


def typical(n: int) -> Stored:
    """A state of `n` workloads with manifests as the backend serves them (a container
    with env, resources and probes), two versions each: applied and last good."""
    workloads = []
    manifests: dict[tuple[str, str], bytes] = {}
    for i in range(n):
        name = f"workload-{i:03}"
        for version in (f"1.{i}.0", f"1.{i}.1"):
            body = manifest(name, version, env={"LOG_LEVEL": "info", "REGION": "eu-central"})
            container = body["spec"]["template"]["spec"]["containers"][0]
            container["resources"] = {"requests": {"cpu": "50m", "memory": "64Mi"},
                                       "limits": {"memory": "256Mi"}}  # fmt: skip
            container["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 8080}}
            container["ports"] = [{"containerPort": 8080, "name": "http"}]
            manifests[(name, version)] = json.dumps(body).encode()
        digest = hashlib.sha256(manifests[(name, f"1.{i}.1")]).hexdigest()
        workloads.append({"name": name, "version": f"1.{i}.1", "manifest_sha256": digest})
    state = json.dumps({"serial": 1, "node_id": "node-a", "workloads": workloads}).encode()
    return Stored(state, SIG, manifests)


def test_two_hundred_workloads_fit_the_store_with_their_manifests() -> None:
    stored = typical(200)
    packed = pack(stored)
    assert packed.with_manifests and packed.note == ""
    assert packed.size <= DEFAULT_STORE_BUDGET
    assert unpack(packed.data) == stored


def test_a_state_whose_manifests_do_not_fit_is_stored_without_them_and_says_so() -> None:
    stored = typical(20)
    packed = pack(stored, budget=pack(Stored(stored.body, SIG, {})).size + 100)
    assert not packed.with_manifests
    assert "stored without its manifests" in packed.note
    assert unpack(packed.data) == Stored(stored.body, SIG, {})


def test_a_state_that_does_not_fit_at_all_is_refused() -> None:
    with pytest.raises(TrustError, match="the state alone takes"):
        pack(typical(20), budget=100)


def test_manifest_bytes_come_back_exactly() -> None:
    odd = {("api", "1"): b'{"a": "\xc3\xa9"}\n', ("api", "2"): b"\xff\xfe not utf-8"}
    stored = Stored(b"{}", SIG, odd)
    assert unpack(pack(stored).data) == stored


GOOD = pack(Stored(b'{"serial": 1}', SIG, {("api", "1"): b"{}"})).data


def _bomb() -> str:
    return base64.b64encode(zlib.compress(b"\0" * (9 * 1024 * 1024))).decode()


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({}, "format is None"),
        ({**GOOD, "format": "v9"}, "format is 'v9'"),
        ({k: v for k, v in GOOD.items() if k != "state"}, "holds no state"),
        ({**GOOD, "state": "%%%"}, "stored state does not read"),
        ({**GOOD, "state": base64.b64encode(b"not zlib").decode()}, "stored state does not read"),
        ({**GOOD, "state": _bomb()}, "inflates beyond"),
        ({**GOOD, "signature": "%%%"}, "stored signature does not read"),
        ({**GOOD, "manifests": base64.b64encode(zlib.compress(b"[1]")).decode()},
         "stored manifests do not read"),
        ({**GOOD, "manifests": base64.b64encode(zlib.compress(b'{"api": {"1": 5}}')).decode()},
         "stored manifests do not read"),
    ],
)  # fmt: skip
def test_a_store_that_does_not_read_says_why(data: dict[str, str], says: str) -> None:
    with pytest.raises(TrustError, match=says):
        unpack(data)
