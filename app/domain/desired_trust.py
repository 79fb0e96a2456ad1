"""Trust in a desired state: what the backend signs, how its answers are ordered, how a
manifest is bound to the state that names it, and how the last good state is packed for
the store on the node. Pure: the Ed25519 check itself is the adapters' (this module says
which bytes it covers).

**The signature.** A 200 answer to `GET /v1/nodes/{node}/workloads` carries
`X-Desired-State-Signature: <base64 of the 64-byte Ed25519 signature>` over the UTF-8
bytes of `workload-manager desired-state v1\\n{node_id}\\n{sha256 hex of the body}`
(`signed_bytes`): the exact body bytes, bound to the node that asked. One signature
covers the manifests too: each desired workload names `manifest_sha256`, the SHA-256 of
the exact bytes the manifest call answers, and a manifest whose bytes differ is refused
(`check_manifest`).

**The order.** A signed state carries `serial` (strictly increasing per node), `node_id`
and `issued_at`. Against the last accepted state (`order`): a lower serial is refused (a
replayed or stale answer could otherwise un-halt a rollout), the same serial is accepted
only with the same body (a backend that re-signs the same serial with other content is
refused), a higher one is accepted.

**The store.** `pack` puts the accepted body, its signature and the manifests it needs
into a ConfigMap's `data` (strings): each part zlib-compressed and base64-encoded, within
a byte budget; a state whose manifests do not fit is stored without them, and says so.
`unpack` reads it back or says why it cannot; what it returns is verified again (the
signature, the order) before it is used.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from app.domain.updates import parse_public_key

SIGNATURE_HEADER = "X-Desired-State-Signature"
SIGNED_PREFIX = "workload-manager desired-state v1"
SIGNATURE_BYTES = 64
# a ConfigMap holds at most 1 MiB of data; the rest of the object needs some room
DEFAULT_STORE_BUDGET = 900 * 1024
STORE_KEYS = ("state", "signature", "manifests", "format")
STORE_FORMAT = "v1"
MAX_KEYS = 8
# the public half of the local backend's development key (standins/backend.py), which
# .env.example names: a production node refuses to trust it
DEVELOPMENT_PUBLIC_KEY = base64.b64decode("TMyP/XJGj1RKqR+XwcQ3QNRm6Bdcx82c/Bobcak0HcY=")


class TrustError(ValueError):
    """A desired state (or a manifest) that is not taken; the message says why."""


@dataclass(frozen=True, slots=True)
class DesiredKeys:
    """The Ed25519 public keys a desired state may be signed by (DESIRED_STATE_PUBLIC_KEYS:
    comma-separated, each base64 of the 32 raw bytes or a PEM), several for a rotation."""

    keys: tuple[bytes, ...]

    @classmethod
    def parse(cls, text: str) -> DesiredKeys:
        entries = [e for e in (part.strip() for part in text.split(",")) if e]
        if not entries:
            raise ValueError("expected at least one Ed25519 public key")
        if len(entries) > MAX_KEYS:
            raise ValueError(f"at most {MAX_KEYS} keys")
        keys = []
        for index, entry in enumerate(entries, 1):
            try:
                keys.append(parse_public_key(entry))
            except ValueError as exc:
                raise ValueError(f"key {index}: {exc}") from None
        return cls(tuple(keys))

    def __str__(self) -> str:
        return ",".join(base64.b64encode(k).decode("ascii") for k in self.keys)


def body_sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def signed_bytes(node_id: str, body: bytes) -> bytes:
    """What the backend signs for `node_id`'s answer `body` (the module docstring)."""
    return f"{SIGNED_PREFIX}\n{node_id}\n{body_sha256(body)}".encode()


def parse_signature(header: str | None) -> bytes:
    """The 64 signature bytes of the header's value; TrustError when absent or malformed."""
    if header is None or not header.strip():
        raise TrustError(f"unsigned: no {SIGNATURE_HEADER} header")
    try:
        raw = base64.b64decode(header.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise TrustError(f"{SIGNATURE_HEADER} is not base64") from None
    if len(raw) != SIGNATURE_BYTES:
        raise TrustError(f"{SIGNATURE_HEADER} holds {len(raw)} bytes, not {SIGNATURE_BYTES}")
    return raw


@dataclass(frozen=True, slots=True)
class Accepted:
    """A desired state taken: its serial and the digest of its exact bytes."""

    serial: int
    digest: str  # body_sha256 of the answer


def check_binding(*, claimed_node: object, serial: object, node_id: str) -> int:
    """The serial of a signed state that names this node; TrustError otherwise (the
    signature already binds the bytes to the node: this is the state saying so too)."""
    if claimed_node != node_id:
        raise TrustError(f"the state is for node {claimed_node!r}, not this node ({node_id})")
    if isinstance(serial, bool) or not isinstance(serial, int) or serial < 0:
        raise TrustError("the state has no serial (a non-negative integer)")
    return serial


def order(candidate: Accepted, last: Accepted | None) -> bool:
    """Whether `candidate` is new (True) or the one already taken (False); TrustError
    when it goes back (a lower serial) or rewrites one (the same serial, other bytes)."""
    if last is None or candidate.serial > last.serial:
        return True
    if candidate.serial < last.serial:
        raise TrustError(
            f"serial {candidate.serial} is below the last accepted {last.serial}: "
            "a replayed or stale answer"
        )
    if candidate.digest != last.digest:
        raise TrustError(f"serial {candidate.serial} again, with other bytes")
    return False


def check_manifest(raw: bytes, expected: str | None, *, name: str, version: str) -> None:
    """A manifest's exact bytes against the digest its signed state names."""
    if expected is None:
        raise TrustError(f"{name} {version}: the signed state names no manifest_sha256")
    found = hashlib.sha256(raw).hexdigest()
    if found != expected.lower():
        raise TrustError(
            f"{name} {version}: the manifest's SHA-256 is {found[:16]}…, "
            f"not the signed {expected[:16]}…"
        )


# --- the store on the node


@dataclass(frozen=True, slots=True)
class Stored:
    body: bytes
    signature: bytes
    manifests: Mapping[tuple[str, str], bytes]  # (name, version) -> exact bytes


@dataclass(frozen=True, slots=True)
class Packed:
    data: dict[str, str]  # the ConfigMap's data
    size: int  # bytes of data, keys included
    with_manifests: bool
    note: str = ""  # why the manifests were left out


def _squeeze(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def _open(text: str, what: str, limit: int) -> bytes:
    try:
        packed = base64.b64decode(text, validate=True)
        inflater = zlib.decompressobj()
        raw = inflater.decompress(packed, limit + 1)
    except (binascii.Error, ValueError, zlib.error):
        raise TrustError(f"the stored {what} does not read") from None
    if len(raw) > limit or inflater.unconsumed_tail:
        raise TrustError(f"the stored {what} inflates beyond {limit} bytes")
    return raw


def _size(data: Mapping[str, str]) -> int:
    return sum(len(k) + len(v) for k, v in data.items())


def pack(stored: Stored, *, budget: int = DEFAULT_STORE_BUDGET) -> Packed:
    """The ConfigMap data for `stored`, within `budget` bytes; without the manifests when
    they do not fit. TrustError when not even the state and its signature fit."""
    data = {
        "format": STORE_FORMAT,
        "state": _squeeze(stored.body),
        "signature": base64.b64encode(stored.signature).decode("ascii"),
    }
    bare = _size(data)
    if bare > budget:
        raise TrustError(f"the state alone takes {bare} bytes, over the store's {budget}")
    listing: dict[str, dict[str, str]] = {}
    for (name, version), raw in sorted(stored.manifests.items()):
        listing.setdefault(name, {})[version] = raw.decode("utf-8", "surrogateescape")
    if not listing:
        return Packed(data, bare, with_manifests=True)
    blob = json.dumps(listing, separators=(",", ":"), ensure_ascii=False)
    full = {**data, "manifests": _squeeze(blob.encode("utf-8", "surrogateescape"))}
    if _size(full) <= budget:
        return Packed(full, _size(full), with_manifests=True)
    note = (
        f"stored without its manifests: with them it takes {_size(full)} bytes, "
        f"over the store's {budget}"
    )
    return Packed(data, bare, with_manifests=False, note=note)


def unpack(data: Mapping[str, str], *, limit: int = 8 * 1024 * 1024) -> Stored:
    """What `pack` stored; TrustError naming what does not read. Each part inflates to
    at most `limit` bytes (a crafted ConfigMap is no zip bomb)."""
    if data.get("format") != STORE_FORMAT:
        raise TrustError(f"the store's format is {data.get('format')!r}, not {STORE_FORMAT!r}")
    if "state" not in data or "signature" not in data:
        raise TrustError("the store holds no state")
    body = _open(data["state"], "state", limit)
    try:
        signature = base64.b64decode(data["signature"], validate=True)
    except (binascii.Error, ValueError):
        raise TrustError("the stored signature does not read") from None
    manifests: dict[tuple[str, str], bytes] = {}
    if "manifests" in data:
        try:
            text = _open(data["manifests"], "manifests", limit)
            listing = json.loads(text.decode("utf-8", "surrogateescape"))
        except ValueError:
            raise TrustError("the stored manifests do not read") from None
        if not isinstance(listing, dict):
            raise TrustError("the stored manifests do not read")
        for name, versions in listing.items():
            if not isinstance(versions, dict):
                raise TrustError("the stored manifests do not read")
            for version, text in versions.items():
                if not isinstance(text, str):
                    raise TrustError("the stored manifests do not read")
                manifests[(name, version)] = text.encode("utf-8", "surrogateescape")
    return Stored(body, signature, manifests)
