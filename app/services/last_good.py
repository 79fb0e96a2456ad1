"""The last good desired state: verified, ordered, kept on the node, used while the backend
is away.

With DESIRED_STATE_PUBLIC_KEYS set, every desired state the backend answers is taken here
(`take`) before anything parses it as a desired state: its Ed25519 signature for this node
over the exact bytes, then the node and serial it names, then its order against the last
one accepted (`app.domain.desired_trust`). Each manifest fetched for it is checked against
the digest the signed state names (`check_manifest`) before it is parsed.

What was accepted is kept (`save`) in a store that outlives the pod: the ConfigMap
`workload-manager-desired-state` of the manager's namespace (a file in DATA_DIR outside a
cluster): the body as it came, its signature, and the manifests of the versions desired and
of the last good ones (a revert's), compressed within a byte budget. A store is written
only when what it would hold changes, so a steady state writes nothing. At start (`open`)
it is read and verified again as if it had just come from the backend; an empty store is
seeded from DESIRED_STATE_PRELOAD (the same form, signed). What cannot be verified is not
used, and the reason is what `open` says.

Manifests of versions the stored state names are checked against its digests when read;
those of older versions kept for a revert were checked when they were fetched and are
trusted as the store is (only the manager's ServiceAccount may patch it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from app.adapters.backend import Signed, parse_json
from app.adapters.desired_signature import DesiredStateVerifier
from app.domain.desired import DEFAULT_MAX_WORKLOADS, DesiredState, parse_desired
from app.domain.desired_trust import (
    DEFAULT_STORE_BUDGET,
    STORE_KEYS,
    Accepted,
    Stored,
    TrustError,
    body_sha256,
    check_binding,
    check_manifest,
    order,
    pack,
    parse_signature,
    unpack,
)

log = logging.getLogger(__name__)

STATE_CONFIG_MAP = "workload-manager-desired-state"
STORED_AT_KEY = "stored_at"
# a preload file is read whole: a ConfigMap's worth, with room
MAX_PRELOAD_BYTES = 2 * 1024 * 1024

Key = tuple[str, str]  # (workload, version)


class StateStore(Protocol):
    where: str

    async def load(self) -> Mapping[str, str] | None: ...

    async def save(self, data: Mapping[str, str | None]) -> None: ...


class ConfigMapStateStore:
    """The ConfigMap `workload-manager-desired-state` (k8s/ creates it; the manager may get
    and patch that one name). A key set to None is removed (a JSON merge patch)."""

    def __init__(self, kube: Any, name: str = STATE_CONFIG_MAP) -> None:
        self._kube = kube
        self.where = f"ConfigMap {kube.namespace}/{name}"
        self._name = name

    async def load(self) -> Mapping[str, str] | None:
        data: Mapping[str, str] | None = await self._kube.read_config_map(self._name)
        return data or None

    async def save(self, data: Mapping[str, str | None]) -> None:
        await self._kube.write_config_map(self._name, dict(data))


class FileStateStore:
    """A JSON file in DATA_DIR, for a manager outside a cluster; replaced atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = f"file {path}"

    async def load(self) -> Mapping[str, str] | None:
        text = await asyncio.to_thread(_read_file, self.path)
        return None if text is None else _read_data(text, self.where)

    async def save(self, data: Mapping[str, str | None]) -> None:
        kept = {k: v for k, v in data.items() if v is not None}
        await asyncio.to_thread(_replace_file, self.path, json.dumps(kept, separators=(",", ":")))


def _read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _replace_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".desired-state.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_data(text: bytes, where: str) -> dict[str, str]:
    if len(text) > MAX_PRELOAD_BYTES:
        raise TrustError(f"{where} is larger than {MAX_PRELOAD_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError:
        raise TrustError(f"{where} is not JSON") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise TrustError(f"{where} is not an object of strings")
    return data


def preload_data(stored: Stored) -> str:
    """A DESIRED_STATE_PRELOAD file's text for a signed state (and its manifests)."""
    return json.dumps(pack(stored, budget=MAX_PRELOAD_BYTES).data, indent=1)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the desired state a sync used came from, for the status, the page and the
    report: `backend` (answered and verified), `last good` (stored; the backend is away),
    or `folder` (DESIRED_STATE_DIR, unsigned, development)."""

    source: str
    serial: int | None = None
    stored_at: datetime | None = None
    offline_since: datetime | None = None
    reason: str | None = None  # why the backend was not used
    store_note: str | None = None  # what the last save left out, or why it failed

    def text(self, now: datetime) -> str:
        if self.source == "folder":
            return "desired state from a folder (unsigned)"
        parts = [self.source]
        if self.serial is not None:
            parts.append(f"serial {self.serial}")
        if self.stored_at is not None:
            parts.append(f"stored {_ago(now - self.stored_at)} ago")
        text = ", ".join(parts)
        if self.offline_since is not None:
            text += f"; backend unreachable since {_stamp(self.offline_since)}"
            if self.reason:
                text += f": {self.reason}"
        if self.store_note:
            text += f"; {self.store_note}"
        return text

    def as_dict(self, now: datetime) -> dict[str, Any]:
        return {
            "from": self.source,
            "desired_serial": self.serial,
            "stored_at": self.stored_at,
            "offline_since": self.offline_since,
            "reason": self.reason,
            "store_note": self.store_note,
            "text": self.text(now),
        }


def _stamp(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _ago(span: Any) -> str:
    seconds = max(0, int(span.total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172_800:
        return f"{seconds // 3600} h"
    return f"{seconds // 86_400} d"


class LastGood:
    def __init__(
        self,
        *,
        verifier: DesiredStateVerifier,
        node_id: str,
        store: StateStore | None,
        budget: int = DEFAULT_STORE_BUDGET,
        max_workloads: int = DEFAULT_MAX_WORKLOADS,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._verifier = verifier
        self._node_id = node_id
        self._store = store
        self._budget = budget
        self._max_workloads = max_workloads
        self._clock = clock
        self.state: DesiredState | None = None
        self.accepted: Accepted | None = None
        self.stored_at: datetime | None = None
        self._body = b""
        self._signature = b""
        self._manifests: dict[Key, bytes] = {}
        # what the store holds (its data without the time), to write only on a change
        self._written: dict[str, str] | None = None
        self._holding: tuple[bytes, frozenset[Key]] | None = None
        self.note = ""  # the last save's note (manifests left out), or why it failed

    @property
    def where(self) -> str:
        return self._store.where if self._store is not None else "memory only"

    # --- taking a state

    def take(self, answer: Signed) -> DesiredState:
        """The desired state of a backend answer, verified and ordered (the one already
        taken when it is the same); TrustError naming why it is refused, before it is
        parsed as a desired state, with nothing changed."""
        self._verifier.verify(node_id=self._node_id, body=answer.body, header=answer.signature)
        state, accepted = self._read(answer.body)
        if not order(accepted, self.accepted) and self.state is not None:
            return self.state
        self._hold(state, accepted, answer.body, parse_signature(answer.signature))
        return state

    def _read(self, body: bytes) -> tuple[DesiredState, Accepted]:
        """A verified body's state and its place in the order (TrustError when it does not
        name this node or a serial; DesiredStateError when it is no desired state)."""
        raw = parse_json(body, "desired state")
        if not isinstance(raw, dict):
            raise TrustError("the signed state is not a JSON object")
        serial = check_binding(
            claimed_node=raw.get("node_id"), serial=raw.get("serial"), node_id=self._node_id
        )
        state = parse_desired(raw, max_workloads=self._max_workloads)
        return state, Accepted(serial, body_sha256(body))

    def _hold(self, state: DesiredState, accepted: Accepted, body: bytes, sig: bytes) -> None:
        self.state, self.accepted = state, accepted
        self._body, self._signature = body, sig

    # --- manifests

    def digest(self, name: str, version: str) -> str | None:
        if self.state is None:
            return None
        workload = self.state.by_name().get(name)
        if workload is None or workload.version != version:
            return None
        return workload.manifest_sha256

    def stored_manifest(self, name: str, version: str) -> bytes | None:
        return self._manifests.get((name, version))

    def check_manifest(self, name: str, version: str, raw: bytes) -> None:
        """TrustError unless `raw` is what the signed state names for this version; kept
        (for the store) when it is."""
        check_manifest(raw, self.digest(name, version), name=name, version=version)
        self._manifests[(name, version)] = raw

    # --- the store

    async def open(self, preload: Path | None = None) -> str:
        """Read the store (seeded from `preload` when empty) and verify what it holds; what
        was found, for the component's reason. Never raises for what the store holds: a
        state that does not verify is not used, and said."""
        if self._store is None:
            return "no store: the last good state is kept in memory only"
        source = self._store.where
        try:
            data = await self._store.load()
            if data is None and preload is not None:
                source = f"DESIRED_STATE_PRELOAD {preload}"
                text = await asyncio.to_thread(_read_file, preload)
                if text is None:
                    raise TrustError("the file does not exist")
                data = _read_data(text, source)
            if data is None:
                return f"{self._store.where}: empty, nothing stored yet"
            stored_at = _parse_time(data.get(STORED_AT_KEY))
            stored = unpack(data)
            header = base64.b64encode(stored.signature).decode("ascii")
            self._verifier.verify(node_id=self._node_id, body=stored.body, header=header)
            state, accepted = self._read(stored.body)
        except (TrustError, ValueError, OSError) as exc:
            log.warning("last good state in %s not used: %s", source, exc)
            return f"{source}: not used: {exc}"
        except Exception as exc:  # the store's own errors (the cluster): said, not fatal
            log.warning("last good state in %s not read: %s", source, exc)
            return f"{source}: not read: {exc}"
        manifests = {}
        for (name, version), raw in stored.manifests.items():
            expected = state.by_name().get(name)
            if expected is not None and expected.version == version:
                try:
                    check_manifest(raw, expected.manifest_sha256, name=name, version=version)
                except TrustError as exc:
                    log.warning("stored manifest not used: %s", exc)
                    continue
            manifests[(name, version)] = raw
        self._hold(state, accepted, stored.body, stored.signature)
        self._manifests = manifests
        if source == self._store.where:
            self._written = _without_time(data)
            self.stored_at = stored_at
        else:  # a preload: stored now, so that the next start finds it
            await self.save(set(manifests))
        return (
            f"{source}: serial {accepted.serial} verified, {len(state.workloads)} workload(s), "
            f"{len(manifests)} manifest(s)"
        )

    async def save(self, keep: Iterable[Key]) -> bool:
        """Store the accepted state with the manifests of `keep` (those known); written only
        when that changes. False when the store could not be written (kept in memory, tried
        again at the next save); True otherwise."""
        if self._store is None or self.state is None:
            return True
        wanted = set(keep)
        self._manifests = {k: v for k, v in self._manifests.items() if k in wanted}
        # the state and the manifests held, compared before anything is packed: a steady
        # state (every sync, every look while an update is judged) costs a set comparison
        holding = (self._body, frozenset(self._manifests))
        if holding == self._holding:
            return True
        try:
            packed = pack(Stored(self._body, self._signature, self._manifests), budget=self._budget)
        except TrustError as exc:
            self.note = f"not stored: {exc}"
            log.warning("last good state %s", self.note)
            return False
        if packed.data == self._written:
            self._holding = holding
            return True
        now = self._clock()
        data: dict[str, str | None] = {key: packed.data.get(key) for key in STORE_KEYS}
        data[STORED_AT_KEY] = _stamp(now)
        try:
            await self._store.save(data)
        except Exception as exc:  # the cluster's errors: the next sync tries again
            self.note = f"not stored in {self._store.where}: {exc}"
            log.warning("last good state %s", self.note)
            return False
        self._written, self.stored_at, self.note = dict(packed.data), now, packed.note
        self._holding = holding
        if packed.note:
            log.warning("last good state %s", packed.note)
        return True


def _without_time(data: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in data.items() if k != STORED_AT_KEY}


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return None
    return at if at.tzinfo is not None else None
