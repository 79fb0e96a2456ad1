"""The last good desired state over real HTTP to the signing local backend and a real
store file: what is taken, what is refused (and that it changes nothing), what is kept
and re-verified at start, and when the backend's failure makes the stored state stand in."""

from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from app.adapters.backend import BackendClient, BackendError, Signed
from app.adapters.desired_signature import DesiredStateVerifier
from app.adapters.signing import NodeSigner
from app.domain.desired_trust import Stored, TrustError, pack, signed_bytes, unpack
from app.services.last_good import FileStateStore, LastGood, preload_data
from app.services.syncing import BackendSource
from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import manifest

NODE = "node-last-good"
KEY = Ed25519PrivateKey.generate()  # the node's
SIGNER = Ed25519PrivateKey.generate()  # the backend's desired-state key
STRANGER = Ed25519PrivateKey.generate()
NOW = datetime.now(UTC)


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class CountingStore(FileStateStore):
    """The real file store, counting its writes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writes = 0

    async def save(self, data: Mapping[str, str | None]) -> None:
        self.writes += 1
        await super().save(data)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LocalBackend, ThreadedServer]]:
    backend = LocalBackend(NODE, KEY.public_key())
    backend.signing_key = SIGNER
    with backend.serve() as server:
        yield backend, server


@pytest.fixture
def backend(served: tuple[LocalBackend, ThreadedServer]) -> LocalBackend:
    served[0].reset()
    return served[0]


@pytest.fixture
def url(served: tuple[LocalBackend, ThreadedServer]) -> str:
    return served[1].url


def client(url: str) -> BackendClient:
    return BackendClient(
        base_url=url, signer=NodeSigner(NODE, KEY), timeout=2.0, attempts=1, max_wait=0.05,
        deadline=3.0,
    )  # fmt: skip


def last_good(store: FileStateStore | None, *, budget: int = 900 * 1024) -> LastGood:
    verifier = DesiredStateVerifier([raw_public(SIGNER)])
    return LastGood(verifier=verifier, node_id=NODE, store=store, budget=budget)


def desire(backend: LocalBackend, *pairs: tuple[str, str]) -> None:
    for name, version in pairs:
        backend.set_manifest(name, version, manifest(name, version))
    backend.set_desired([{"name": n, "version": v} for n, v in pairs])


async def synced(source: BackendSource, kept: LastGood) -> None:
    """What one sync does with the source: the state, each manifest, then the store."""
    state = await source.desired()
    for workload in state.workloads:
        await source.manifest(workload.name, workload.version)
    await source.settle({(w.name, w.version) for w in state.workloads})
    assert kept.state is state


async def test_a_signed_state_is_taken_stored_and_read_again_at_start(
    backend: LocalBackend, url: str, tmp_path: Path
) -> None:
    store = CountingStore(tmp_path / "desired-state.json")
    kept = last_good(store)
    assert (await kept.open()).endswith("empty, nothing stored yet")
    desire(backend, ("api", "1.0.0"), ("web", "2.0.0"))
    http = client(url)
    source = BackendSource(http, url, last_good=kept)
    await synced(source, kept)
    assert store.writes == 1
    await synced(source, kept)  # the same (a 304): nothing written
    assert store.writes == 1
    assert kept.accepted is not None
    serial = kept.accepted.serial

    again = last_good(CountingStore(store.path))  # a restarted manager
    said = await again.open()
    assert said.endswith(f"serial {serial} verified, 2 workload(s), 2 manifest(s)"), said
    assert again.state is not None and again.state.by_name()["web"].version == "2.0.0"
    assert again.stored_manifest("api", "1.0.0") == json.dumps(manifest("api", "1.0.0")).encode()
    await http.aclose()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("other-key", "the signature is not by a trusted key"),
        ("other-node", "the signature is not by a trusted key for this node (node-last-good)"),
        ("tampered", "the signature is not by a trusted key"),
        ("not-json", "not used: the stored state does not read"),
    ],
)
async def test_a_store_that_does_not_verify_is_not_used(
    backend: LocalBackend, url: str, tmp_path: Path, change: str, said: str
) -> None:
    path = tmp_path / "desired-state.json"
    desire(backend, ("api", "1.0.0"))
    http = client(url)
    kept = last_good(FileStateStore(path))
    await synced(BackendSource(http, url, last_good=kept), kept)
    await http.aclose()
    data = json.loads(path.read_text())
    stored = unpack(data)
    if change == "other-key":
        signature = STRANGER.sign(signed_bytes(NODE, stored.body))
        data.update(pack(Stored(stored.body, signature, stored.manifests)).data)
    elif change == "other-node":
        signature = SIGNER.sign(signed_bytes("node-other", stored.body))
        data.update(pack(Stored(stored.body, signature, stored.manifests)).data)
    elif change == "tampered":
        body = stored.body.replace(b'"1.0.0"', b'"6.6.6"')
        data.update(pack(Stored(body, stored.signature, stored.manifests)).data)
    else:
        data["state"] = "not base64!"
    path.write_text(json.dumps(data))

    restarted = last_good(FileStateStore(path))
    found = await restarted.open()
    assert said in found, found
    assert restarted.state is None


async def test_a_preload_seeds_an_empty_store_and_must_be_signed(
    backend: LocalBackend, url: str, tmp_path: Path
) -> None:
    desire(backend, ("api", "1.0.0"))
    http = client(url)
    _etag, answer = await http.get_desired_signed(None)
    await http.aclose()
    assert isinstance(answer, Signed) and answer.signature is not None
    signature = base64.b64decode(answer.signature)
    preload = tmp_path / "preload.json"
    preload.write_text(preload_data(Stored(answer.body, signature, {})))

    store = CountingStore(tmp_path / "store" / "desired-state.json")
    kept = last_good(store)
    said = await kept.open(preload)
    assert said.startswith(f"DESIRED_STATE_PRELOAD {preload}: serial "), said
    assert store.writes == 1 and store.path.exists()  # the next start reads the store
    assert (await last_good(store).open()).startswith(f"file {store.path}: serial ")

    forged = tmp_path / "forged.json"
    forged.write_text(preload_data(Stored(answer.body, STRANGER.sign(b"x"), {})))
    empty = CountingStore(tmp_path / "other" / "desired-state.json")
    refused = last_good(empty)
    assert "not used: the signature is not by a trusted key" in await refused.open(forged)
    assert refused.state is None and empty.writes == 0


async def test_what_the_budget_does_not_hold_is_stored_without_manifests(
    backend: LocalBackend, url: str, tmp_path: Path
) -> None:
    pairs = [(f"w{i:03d}", "1.0.0") for i in range(120)]
    for name, version in pairs:  # manifests that do not compress away
        noisy = manifest(name, version)
        noisy["metadata"]["annotations"] = {"noise": random.Random(name).randbytes(256).hex()}
        backend.set_manifest(name, version, noisy)
    backend.set_desired([{"name": n, "version": v} for n, v in pairs])
    http = client(url)
    store = FileStateStore(tmp_path / "desired-state.json")
    kept = last_good(store, budget=20 * 1024)
    source = BackendSource(http, url, last_good=kept)
    await synced(source, kept)
    assert "; stored without its manifests: with them it takes " in source.origin().text(NOW)
    await http.aclose()
    assert kept.note.startswith("stored without its manifests: with them it takes ")
    assert unpack(json.loads(store.path.read_text())).manifests == {}
    assert (await last_good(store).open()).endswith("120 workload(s), 0 manifest(s)")


async def test_the_order_refuses_going_back_and_rewriting(
    backend: LocalBackend, url: str, tmp_path: Path
) -> None:
    desire(backend, ("api", "1.0.0"))
    http = client(url)
    first = (await http.get_desired_signed(None))[1]
    desire(backend, ("api", "2.0.0"))
    second = (await http.get_desired_signed(None))[1]
    await http.aclose()
    kept = last_good(None)
    state = kept.take(second)
    assert kept.take(second) is state  # the same answer again: the one taken
    with pytest.raises(TrustError, match=r"serial \d+ is below the last accepted \d+"):
        kept.take(first)
    assert kept.state is state
    assert kept.accepted is not None
    body = json.loads(second.body)
    body["revision"] = "rewritten"
    rewritten = json.dumps(body).encode()
    resigned = base64.b64encode(SIGNER.sign(signed_bytes(NODE, rewritten))).decode()
    with pytest.raises(TrustError, match=r"serial \d+ again, with other bytes"):
        kept.take(Signed(rewritten, resigned))
    assert kept.state is state


@pytest.mark.parametrize(
    ("failure", "offline"),
    [("503", True), ("500", True), ("timeout", True), ("429", False), ("garbage", False)],
)
async def test_only_a_failing_backend_makes_the_stored_state_stand_in(
    backend: LocalBackend, url: str, tmp_path: Path, failure: str, offline: bool
) -> None:
    desire(backend, ("api", "1.0.0"))
    http = client(url)
    kept = last_good(FileStateStore(tmp_path / "desired-state.json"))
    await synced(BackendSource(http, url, last_good=kept), kept)
    restarted = last_good(FileStateStore(tmp_path / "desired-state.json"))
    await restarted.open()
    source = BackendSource(http, url, last_good=restarted)
    backend.fail("workloads", failure, times=None, delay=10.0)  # type: ignore[arg-type]
    if offline:
        state = await source.desired()
        assert state is restarted.state
        origin = source.origin()
        assert origin.source == "last good" and origin.offline_since is not None
        with pytest.raises(BackendError, match="not reported: the backend is unreachable"):
            await source.applied("api", _report())
        assert await source.manifest("api", "1.0.0") == manifest("api", "1.0.0")
        backend.clear_failures()
        await source.desired()
        assert source.origin().source == "backend" and source.origin().offline_since is None
    else:  # an answer, not a failure: the sync ends as before
        with pytest.raises((BackendError, TrustError)):
            await source.desired()
        assert source.origin().offline_since is None
    backend.clear_failures()
    await http.aclose()


async def test_a_retry_after_while_the_stored_state_stands_in_is_kept(
    backend: LocalBackend, url: str, tmp_path: Path
) -> None:
    """A `503` with `Retry-After: 30` makes the stored state stand in, and the sync asks
    the backend again when that time has passed (not only at its next interval, up to
    an hour later): the source keeps what the answer asked for, until an answer comes."""
    desire(backend, ("api", "1.0.0"))
    now = [time.time()]
    http = BackendClient(base_url=url, signer=NodeSigner(NODE, KEY), timeout=2.0, attempts=1,
                         max_wait=0.05, deadline=3.0, clock=lambda: now[0])  # fmt: skip
    kept = last_good(FileStateStore(tmp_path / "desired-state.json"))
    source = BackendSource(http, url, last_good=kept)
    await synced(source, kept)
    assert source.retry_after is None
    backend.fail("workloads", "503", times=1, retry_after="30")
    assert await source.desired() is kept.state
    assert source.origin().source == "last good"
    asked = _retry_after(source)  # read again: the call changed it
    assert asked is not None and 30.0 <= asked <= 33.0
    now[0] += 34.0  # the hold has passed: the next call is made, and answered
    await source.desired()
    assert source.retry_after is None
    await http.aclose()


def _retry_after(source: BackendSource) -> float | None:
    return source.retry_after


def _report() -> Any:
    from datetime import UTC, datetime

    from app.services.syncing import VersionReport

    return VersionReport("1.0.0", datetime.now(UTC))


async def test_the_report_says_where_the_desired_state_came_from(
    backend: LocalBackend, url: str, tmp_path: Path
) -> None:
    from datetime import UTC, datetime, timedelta

    from app.services.last_good import Origin
    from app.services.reporting import Reporter
    from app.services.workloads import WorkloadBook

    book = WorkloadBook(stale_after=30, forget_after=3600, capacity=10)
    http = client(url)
    reporter = Reporter(node_id=NODE, book=book, backend=http, disk_path=tmp_path, started_at=0.0)
    now = datetime.now(UTC)
    book.desired_origin = Origin("last good", 42, now - timedelta(hours=3), now, "ConnectError")
    outcome = await reporter.report_once()
    await http.aclose()
    assert outcome.succeeded, outcome
    (sent,) = backend.reports
    desired = sent["desired"]
    assert desired["from"] == "last good" and desired["desired_serial"] == 42
    assert desired["offline_since"].endswith("Z") and desired["stored_at"].endswith("Z")
    assert desired["text"].startswith("last good, serial 42, stored 3 h ago; backend unreachable")


def test_the_contract_file_says_what_is_signed_and_reported() -> None:
    """docs/backend-api.md fails this until it names the header, the signed string, the
    signed state's fields and each field of the report's `desired`."""
    import re

    from app.domain.desired import DesiredState, DesiredWorkload
    from app.domain.desired_trust import SIGNATURE_HEADER, SIGNED_PREFIX
    from app.services.last_good import Origin

    doc = (Path(__file__).resolve().parents[2] / "docs" / "backend-api.md").read_text()
    assert f"`{SIGNATURE_HEADER}`" in doc
    assert f"{SIGNED_PREFIX}\\n{{node_id}}\\n{{SHA256HEX(body)}}" in doc
    for signed in ("serial", "node_id", "issued_at", "manifest_sha256"):
        assert signed in {*DesiredState.model_fields, *DesiredWorkload.model_fields}
        assert f"| `{signed}` |" in doc
    example = re.search(r'"desired": (\{"from".*?\})\n', doc, re.DOTALL)
    assert example is not None
    sent = Origin("backend").as_dict(NOW)
    assert set(re.findall(r'"([a-z_]+)":', example.group(1))) == set(sent)
