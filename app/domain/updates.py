"""Self-update: read the published version file, and decide whether to move to it.

The version file is a bare version (`1.4.2`) or JSON `{"version": "1.4.2", "image":
"repo/name:1.4.2", "rollout": {"percent": 20, "halt": false, "seed": "..."}}` (`rollout`
is a workload's `RolloutSpec`; without it every node updates at once; `"serial": 7`, strictly
increasing per publication, orders the copies: one below the serial recorded on the own
Deployment is refused, `check_serial`). `decide_update` is
pure: only an image of the configured repository whose tag is the version (or which pins
a sha256 digest, a tag beside it being the version), never a version below the highest
one confirmed on this node, only a newer version than the running one (PEP 440
ordering), never one that failed before, pre-releases (of the version or the tag) only
when allowed, only on a node the rollout's wave has reached (`waiting-wave`) and is not
halted (`halted`), and only inside the maintenance window (a workload's `UpdateWindow`)
when one is set. The wave and the window gate starting an update only: what an update
in flight owes (`pending_update`) is done whatever they say.

When a public key is configured the file must carry a detached Ed25519 signature over its
exact bytes (base64, at the file's location plus `.sig`, or where SELF_UPDATE_SIGNATURE_URL
says): `parse_public_key`, `parse_signature` and `signature_location` are the pure half of
that check, which the fetching adapter does before anything here sees the content.

An update in flight is recorded on the own Deployment (annotations), not in memory, so any
manager instance can see it through: `pending_update` says, from those annotations, the
current image and the rollout, what is owed — nothing, watching the rollout (then
confirming or rolling back), a rollback, or the bookkeeping of a rollback already done.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from urllib.parse import urlsplit, urlunsplit

from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

from app.domain.health import RolloutPhase
from app.domain.rollout import (
    Halted,
    RolloutSpec,
    UpdateWindow,
    WaitingWave,
    place,
    seed_for,
    wave,
    window_open,
)
from app.domain.rollout import in_window as in_window  # its home was here

_BARE = re.compile(r"^v?[0-9][0-9A-Za-z.+!-]*$")
MAX_VERSION_FILE_BYTES = 4096


class VersionFileError(ValueError):
    """The version file is unreadable; the message says why (it is shown in the status)."""


@dataclass(frozen=True, slots=True)
class Published:
    version: str
    image: str | None = None
    rollout: RolloutSpec | None = None  # None: every node at once
    # strictly increasing per publication: a copy below the serial recorded on the own
    # Deployment is stale (`check_serial`), so it cannot undo a later halt
    serial: int | None = None


def _serial(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise VersionFileError("version file `serial` must be a non-negative integer")
    return value


def check_serial(published: Published, recorded: int | None) -> None:
    """VersionFileError when the file goes back from the serial recorded on the own
    Deployment (`VERSION_FILE_SERIAL`): a stale or replayed copy, even one signed."""
    if recorded is None:
        return
    if published.serial is None:
        raise VersionFileError(
            f"version file has no serial, and serial {recorded} was recorded: a stale copy"
        )
    if published.serial < recorded:
        raise VersionFileError(
            f"version file serial {published.serial} is below the recorded {recorded}: "
            "a stale or replayed copy, refused"
        )


def _rollout(value: object) -> RolloutSpec | None:
    """The version file's `rollout`, validated as a workload's is."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise VersionFileError("version file `rollout` must be an object")
    try:
        return RolloutSpec.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(("rollout", *(str(part) for part in first["loc"])))
        raise VersionFileError(f"version file `{where}`: {first['msg']}") from None


def parse_version_file(content: bytes) -> Published:
    if len(content) > MAX_VERSION_FILE_BYTES:
        raise VersionFileError(f"version file is larger than {MAX_VERSION_FILE_BYTES} bytes")
    try:
        text = content.decode().strip()
    except UnicodeDecodeError:
        raise VersionFileError("version file is not UTF-8 text") from None
    if not text:
        raise VersionFileError("version file is empty")
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            raise VersionFileError("version file looks like JSON but does not parse") from None
        version, image = data.get("version"), data.get("image")
        if not isinstance(version, str):
            raise VersionFileError("version file JSON has no string `version`")
        if image is not None and not isinstance(image, str):
            raise VersionFileError("version file `image` must be a string")
        published = Published(
            version.strip(),
            image.strip() if image else None,
            _rollout(data.get("rollout")),
            _serial(data.get("serial")),
        )
    elif _BARE.fullmatch(text):
        published = Published(text)
    else:
        raise VersionFileError(f"version file content is not a version: {text[:40]!r}")
    try:
        Version(published.version)
    except InvalidVersion:
        raise VersionFileError(f"{published.version!r} is not a valid version") from None
    return published


# From the OCI distribution reference grammar (github.com/distribution/reference): a tag
# is `[\w][\w.-]{0,127}`; of the digests only sha256 is taken (the OCI image spec's
# registered sha256 form: 64 lowercase hex digits).
_TAG = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_SHA256_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class ImageRef:
    repository: str
    tag: str | None = None
    digest: str | None = None


def parse_image(image: str) -> ImageRef:
    """The parts of `repository[:tag][@digest]`, as written (not checked)."""
    name, at, digest = image.partition("@")
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:
        repository, tag = name[:colon], name[colon + 1 :]
    else:
        repository, tag = name, None
    return ImageRef(repository, tag, digest if at else None)


def split_image(image: str) -> tuple[str, str | None]:
    """(repository, digest, else tag) of an image reference."""
    ref = parse_image(image)
    return ref.repository, ref.digest or ref.tag


def same_version(tag: str, version: str) -> bool:
    """Whether an image tag names `version`: the same text, or the same with a leading `v`
    on one side only (PEP 440 reads `v1.4.2` as 1.4.2; both tag styles are common).
    Any other spelling is refused: the tag is what the registry serves, exactly."""
    return tag.removeprefix("v") == version.removeprefix("v")


def image_refusal(image: str, *, version: str, repository: str) -> str | None:
    """Why `image` may not be what the manager runs as `version`, or None if it may."""
    ref = parse_image(image)
    if ref.repository != repository:
        return f"image {image!r} is not from the configured repository {repository!r}"
    if ref.digest is not None and not _SHA256_DIGEST.fullmatch(ref.digest):
        return f"image {image!r}: the digest is not sha256:<64 lowercase hex digits>"
    if ref.tag is not None and not _TAG.fullmatch(ref.tag):
        return f"image {image!r}: {ref.tag!r} is not a valid tag"
    if ref.tag is None and ref.digest is None:
        return f"image {image!r} has no tag or digest"
    if ref.tag is not None and not same_version(ref.tag, version):
        return f"image {image!r}: its tag {ref.tag!r} is not the version {version}"
    return None


# --- the version file's signature

MAX_SIGNATURE_BYTES = 1024
SIGNATURE_SUFFIX = ".sig"
# RFC 8410: the DER SubjectPublicKeyInfo of an Ed25519 key is this prefix and the 32 bytes
_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PEM_PUBLIC = re.compile(
    r"-----BEGIN PUBLIC KEY-----\s*([A-Za-z0-9+/=\s]+?)\s*-----END PUBLIC KEY-----"
)


class SignatureError(ValueError):
    """The version file's signature is missing, malformed or wrong (the message says which)."""


def parse_public_key(text: str) -> bytes:
    """The 32 raw bytes of an Ed25519 public key given as base64 of them, or as a PEM
    SubjectPublicKeyInfo (`-----BEGIN PUBLIC KEY-----`, RFC 8410)."""
    text = text.strip()
    pem = _PEM_PUBLIC.fullmatch(text)
    try:
        raw = base64.b64decode("".join((pem.group(1) if pem else text).split()), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if pem is not None:
        if len(raw) != len(_ED25519_SPKI_PREFIX) + 32 or not raw.startswith(_ED25519_SPKI_PREFIX):
            raise ValueError("the PEM public key is not an Ed25519 key")
        return raw[len(_ED25519_SPKI_PREFIX) :]
    if len(raw) != 32:
        raise ValueError(
            "expected an Ed25519 public key: base64 of its 32 raw bytes, or a PEM "
            "(-----BEGIN PUBLIC KEY-----)"
        )
    return raw


@dataclass(frozen=True, slots=True)
class VersionFileKey:
    """The Ed25519 public key the version file's signature is checked with
    (SELF_UPDATE_PUBLIC_KEY): its 32 raw bytes, parsed once."""

    raw: bytes

    @classmethod
    def parse(cls, text: str) -> VersionFileKey:
        """From base64 of the 32 raw bytes, or a PEM; ValueError (`parse_public_key`'s,
        never quoting the text) for anything else."""
        return cls(parse_public_key(text))

    def __str__(self) -> str:
        """Base64 of the raw bytes, as SELF_UPDATE_PUBLIC_KEY takes it."""
        return base64.b64encode(self.raw).decode()


def parse_signature(content: bytes) -> bytes:
    """The 64 bytes of a detached Ed25519 signature file: base64, surrounding white space
    allowed, at most MAX_SIGNATURE_BYTES."""
    if len(content) > MAX_SIGNATURE_BYTES:
        raise SignatureError(f"the signature is larger than {MAX_SIGNATURE_BYTES} bytes")
    try:
        raw = base64.b64decode(content.strip(), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 64:
        raise SignatureError("the signature is not the base64 of a 64-byte Ed25519 signature")
    return raw


def signature_location(url: str, configured: str | None = None) -> str:
    """Where the signature of the version file at `url` is: `configured` when given, else
    the same location, its path followed by `.sig` (an s3:// key, or an http(s) path with
    its query kept)."""
    if configured is not None:
        return configured
    if url.startswith("s3://"):
        return url + SIGNATURE_SUFFIX
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path + SIGNATURE_SUFFIX, fragment=""))


def signature_needs_own_url(url: str) -> bool:
    """Whether the signature of the version file at `url` cannot be found beside it: an
    http(s) URL with a query is presigned (S3, GCS, Azure SAS), and its signature in the
    query covers that path alone, so `<path>.sig` with the same query is refused."""
    if url.startswith("s3://"):
        return False
    return bool(urlsplit(url).query)


@dataclass(frozen=True, slots=True)
class UpdatePolicy:
    repository: str
    allow_prerelease: bool = False
    # SELF_UPDATE_WINDOW: when an update may start (`window_open`); None is always
    window: UpdateWindow | None = None
    # the node's id: its place in a wave of the version file's `rollout`
    node_id: str = ""


# the name a version file's rollout places nodes under (its seed: `workload-manager/<version>`)
ROLLOUT_NAME = "workload-manager"


class Choice(StrEnum):
    NOOP = "noop"
    UPDATE = "update"
    SKIP = "skip"
    WAITING_WAVE = "waiting-wave"  # the version file's rollout has not reached this node
    HALTED = "halted"  # the version file's rollout is halted


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The highest version confirmed on this node, and its image when it is known."""

    version: str
    image: str | None = None


@dataclass(frozen=True, slots=True)
class UpdateDecision:
    choice: Choice
    reason: str
    version: str | None = None
    image: str | None = None


def reassertion(
    *, current: str, highest: Confirmed | None, failed: frozenset[str], repository: str
) -> UpdateDecision:
    """At start-up: is the own image below the highest version confirmed on this node?

    Something other than the self-update put an older image back (K3S re-applies the
    install file of its auto-deploy folder at every start, with the image it was installed
    with). The confirmed image is then taken again, without the version file: an update
    (watched, confirmed or rolled back as any other). Noop when nothing is confirmed or the
    running version is not below it; skip, with the reason, when the confirmed image is
    unknown, not the configured repository's, or its version failed since.
    """
    if highest is None:
        return UpdateDecision(Choice.NOOP, "no version confirmed on this node")
    try:
        running = Version(current)
    except InvalidVersion:
        return UpdateDecision(Choice.SKIP, f"the running version {current!r} is not a version")
    if running >= Version(highest.version):
        return UpdateDecision(
            Choice.NOOP, f"running {current}, {highest.version} is the highest confirmed"
        )
    if highest.image is None:
        return UpdateDecision(
            Choice.SKIP,
            f"running {current}, below {highest.version}, whose image is not recorded",
            highest.version,
        )
    if highest.version in failed:
        return UpdateDecision(
            Choice.SKIP, f"{highest.version} failed since it was confirmed", highest.version
        )
    refusal = image_refusal(highest.image, version=highest.version, repository=repository)
    if refusal is not None:
        return UpdateDecision(Choice.SKIP, refusal, highest.version)
    return UpdateDecision(
        Choice.UPDATE,
        f"running {current}, below {highest.version}, the highest version confirmed on this "
        "node: the install put an older image back",
        highest.version,
        highest.image,
    )


def decide_update(
    *,
    current: str,
    published: Published,
    failed: frozenset[str],
    policy: UpdatePolicy,
    now: datetime,
    highest: Confirmed | None = None,
) -> UpdateDecision:
    """Noop, update or skip. The image is judged first: a file naming an image that does
    not match its version is refused (skip, with the reason), never taken for a noop."""
    try:
        running = Version(current)
    except InvalidVersion:
        return UpdateDecision(Choice.SKIP, f"the running version {current!r} is not a version")
    latest = Version(published.version)
    image = published.image or f"{policy.repository}:{published.version}"
    refusal = image_refusal(image, version=published.version, repository=policy.repository)
    if refusal is not None:
        return UpdateDecision(Choice.SKIP, refusal, published.version)
    if highest is not None:
        floor = Version(highest.version)
        if latest < floor:
            return UpdateDecision(
                Choice.SKIP,
                f"{published.version} is below {highest.version}, the highest version "
                "confirmed on this node (a downgrade is refused)",
                published.version,
            )
        if latest == floor and highest.image is not None and image != highest.image:
            return UpdateDecision(
                Choice.SKIP,
                f"{published.version} was confirmed on this node as {highest.image!r}, "
                f"not {image!r}",
                published.version,
            )
    if latest <= running:
        return UpdateDecision(Choice.NOOP, f"running {current}, published {published.version}")
    if published.version in failed:
        return UpdateDecision(
            Choice.SKIP, f"{published.version} failed before and was rolled back", published.version
        )
    # an image's tag is the version itself (image_refusal), so it is a pre-release only
    # when the version is
    if latest.is_prerelease and not policy.allow_prerelease:
        return UpdateDecision(
            Choice.SKIP, f"{published.version} is a pre-release (not allowed)", published.version
        )
    rollout = published.rollout
    where = place(seed_for(ROLLOUT_NAME, published.version, rollout), policy.node_id)
    gate = wave(where, rollout)
    if isinstance(gate, Halted):
        return UpdateDecision(Choice.HALTED, gate.reason, published.version)
    if isinstance(gate, WaitingWave):
        return UpdateDecision(Choice.WAITING_WAVE, gate.reason, published.version)
    if not window_open(policy.window, now):
        return UpdateDecision(
            Choice.SKIP, f"outside the maintenance window {policy.window}", published.version
        )
    waved = f" ({gate.reason})" if rollout is not None else ""
    return UpdateDecision(
        Choice.UPDATE, f"{current} -> {published.version}{waved}", published.version, image
    )


# The annotations on the own Deployment: the protocol between manager versions, so a name
# here never changes.
PREVIOUS_IMAGE = "workload-manager.io/previous-image"
TARGET_VERSION = "workload-manager.io/update-target"
TARGET_IMAGE = "workload-manager.io/update-image"
UPDATE_STARTED = "workload-manager.io/update-started"
# when the update's new ReplicaSet was first seen available: the start of its min healthy
# time (SELF_UPDATE_MIN_HEALTHY_SECONDS), which a manager that resumes the watch continues
AVAILABLE_SINCE = "workload-manager.io/update-available-since"
CONFIRMED_VERSION = "workload-manager.io/update-confirmed"
FAILED_VERSIONS = "workload-manager.io/failed-versions"
# the highest version a confirmation recorded on this node, and its image: the floor below
# which no published version is taken (it outlives pods, as the Deployment does)
HIGHEST_VERSION = "workload-manager.io/highest-confirmed-version"
HIGHEST_IMAGE = "workload-manager.io/highest-confirmed-image"
# the highest version file serial read (`check_serial`)
VERSION_FILE_SERIAL = "workload-manager.io/version-file-serial"


def stamp(at: datetime) -> str:
    """A time as Kubernetes writes it (UTC, whole seconds)."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class UpdateMarks:
    """What the own Deployment's annotations say about the last self-update."""

    previous_image: str | None = None
    target_version: str | None = None
    target_image: str | None = None  # absent on updates written by older managers
    started_at: datetime | None = None
    confirmed_version: str | None = None
    failed: frozenset[str] = frozenset()
    highest: Confirmed | None = None
    available_since: datetime | None = None  # the new ReplicaSet first seen available
    serial: int | None = None  # the highest version file serial read (VERSION_FILE_SERIAL)


def _highest(version: str | None, image: str | None) -> Confirmed | None:
    if not version:
        return None
    try:
        Version(version)
    except InvalidVersion:
        return None  # not written by a manager; a floor that cannot be compared is none
    return Confirmed(version, image or None)


def read_marks(annotations: Mapping[str, str] | None) -> UpdateMarks:
    notes = annotations or {}
    return UpdateMarks(
        previous_image=notes.get(PREVIOUS_IMAGE) or None,
        target_version=notes.get(TARGET_VERSION) or None,
        target_image=notes.get(TARGET_IMAGE) or None,
        started_at=_parse_time(notes.get(UPDATE_STARTED)),
        confirmed_version=notes.get(CONFIRMED_VERSION) or None,
        failed=frozenset(v for v in notes.get(FAILED_VERSIONS, "").split(",") if v),
        highest=_highest(notes.get(HIGHEST_VERSION), notes.get(HIGHEST_IMAGE)),
        available_since=_parse_time(notes.get(AVAILABLE_SINCE)),
        serial=_recorded_serial(notes.get(VERSION_FILE_SERIAL)),
    )


def _recorded_serial(value: str | None) -> int | None:
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 19:
        return None
    return int(value)


def confirmation(marks: UpdateMarks, version: str, image: str | None) -> dict[str, str | None]:
    """The annotations a confirmation of `version` (run as `image`) writes: the confirmed
    version, and the highest confirmed one when this one is higher (or the same and the
    image was not known). Never lowers the floor."""
    notes: dict[str, str | None] = {CONFIRMED_VERSION: version}
    try:
        confirmed = Version(version)
    except InvalidVersion:
        return notes
    highest = marks.highest
    if (
        highest is None
        or confirmed > Version(highest.version)
        or (confirmed == Version(highest.version) and highest.image is None)
    ):
        notes[HIGHEST_VERSION] = version
        notes[HIGHEST_IMAGE] = image
    return notes


class Owed(StrEnum):
    NOTHING = "nothing"
    WATCH = "watch"  # an update is rolling out: watch it, then confirm or roll back
    ROLLBACK = "rollback"  # the update failed: put the previous image back
    FINISH_ROLLBACK = "finish-rollback"  # the image is back already: record the failure


@dataclass(frozen=True, slots=True)
class Pending:
    owed: Owed
    reason: str
    version: str | None = None
    previous_image: str | None = None
    remaining: float = 0.0  # WATCH: seconds left of the update's deadline
    image: str | None = None  # WATCH: the image the update set, when recorded
    # WATCH of an available update: when it was first seen available (None: not yet)
    available_since: datetime | None = None


def healthy_span(
    since: datetime | None, *, now: datetime, min_healthy: float
) -> tuple[datetime, float]:
    """The start of an available update's min healthy time, and the seconds of it left:
    from `since` (when it was first seen available), or from now when it was not (or
    when `since` is in the future: clock skew)."""
    start = since if since is not None and since <= now else now
    return start, max(0.0, min_healthy - (now - start).total_seconds())


def pending_update(
    *,
    marks: UpdateMarks,
    image: str,
    rollout: RolloutPhase,
    now: datetime,
    deadline: float,
    min_healthy: float = 0.0,
) -> Pending:
    """What the last self-update still needs, from the own Deployment alone.

    Pure, and the same for every manager instance: the old pod that applied the update,
    a restart of it, or the new pod once it runs. With a min healthy time, an update
    first seen available (`available_since`) is confirmed only once it stayed so that
    long: available now, it is watched on; unavailable now, it failed.
    """
    target, previous = marks.target_version, marks.previous_image
    if target is None:
        return Pending(Owed.NOTHING, "no update in flight")
    if marks.confirmed_version == target:
        return Pending(Owed.NOTHING, f"the update to {target} was confirmed", target)
    if previous is None:
        return Pending(
            Owed.NOTHING, f"the update to {target} has no previous image to go back to", target
        )
    if image == previous:
        return Pending(
            Owed.FINISH_ROLLBACK,
            f"the image was put back to {previous} outside the self-update",
            target,
            previous,
        )
    if marks.target_image is not None and image != marks.target_image:
        return Pending(
            Owed.NOTHING,
            f"the image was changed to {image} outside the self-update (it set "
            f"{marks.target_image}); left alone",
            target,
        )
    if rollout is RolloutPhase.FAILED:
        return Pending(
            Owed.ROLLBACK,
            "the Deployment reports ProgressDeadlineExceeded",
            target,
            previous,
        )
    if marks.started_at is None:  # written by an older manager: the deadline starts now
        remaining = deadline
    else:
        elapsed = max(0.0, (now - marks.started_at).total_seconds())
        remaining = deadline - elapsed
    since = marks.available_since if min_healthy > 0 else None
    if rollout is RolloutPhase.READY:
        if since is None:
            why = "the new pod is available; to be confirmed"
        else:
            seen = max(0.0, (now - since).total_seconds())
            why = f"the new pod available for {seen:.0f} s of {min_healthy:.0f} s; to be confirmed"
        return Pending(
            Owed.WATCH, why, target, previous, max(remaining, 0.0), marks.target_image, since
        )
    if since is not None:
        return Pending(
            Owed.ROLLBACK,
            f"the Deployment became unavailable within the {min_healthy:.0f} s the new pod "
            "must stay available",
            target,
            previous,
        )
    if remaining <= 0:
        return Pending(
            Owed.ROLLBACK,
            f"the new pod was not available within {deadline:.0f} s",
            target,
            previous,
        )
    return Pending(
        Owed.WATCH, "the new pod is rolling out", target, previous, remaining, marks.target_image
    )
