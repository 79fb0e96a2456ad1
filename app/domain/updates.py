"""Self-update: read the published version file, and decide whether to move to it.

The version file is a bare version (`1.4.2`) or JSON `{"version": "1.4.2", "image":
"repo/name:1.4.2"}`. `decide_update` is pure: only a newer version (PEP 440 ordering),
only within the configured image repository (the tag or digest is all that changes),
never one that failed before, pre-releases only when allowed, and only inside the
maintenance window when one is set.

An update in flight is recorded on the own Deployment (annotations), not in memory, so any
manager instance can see it through: `pending_update` says, from those annotations, the
current image and the rollout, what is owed — nothing, watching the rollout (then
confirming or rolling back), a rollback, or the bookkeeping of a rollback already done.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, time
from enum import StrEnum

from packaging.version import InvalidVersion, Version

from app.domain.health import RolloutPhase

_BARE = re.compile(r"^v?[0-9][0-9A-Za-z.+!-]*$")
MAX_VERSION_FILE_BYTES = 4096


class VersionFileError(ValueError):
    """The version file is unreadable; the message says why (it is shown in the status)."""


@dataclass(frozen=True, slots=True)
class Published:
    version: str
    image: str | None = None


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
        published = Published(version.strip(), image.strip() if image else None)
    elif _BARE.fullmatch(text):
        published = Published(text)
    else:
        raise VersionFileError(f"version file content is not a version: {text[:40]!r}")
    try:
        Version(published.version)
    except InvalidVersion:
        raise VersionFileError(f"{published.version!r} is not a valid version") from None
    return published


def split_image(image: str) -> tuple[str, str | None]:
    """(repository, tag or digest) of an image reference."""
    if "@" in image:
        repository, _, digest = image.partition("@")
        return repository, digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon + 1 :]
    return image, None


@dataclass(frozen=True, slots=True)
class UpdatePolicy:
    repository: str
    allow_prerelease: bool = False
    window: tuple[time, time] | None = None  # UTC, start inclusive, end exclusive


class Choice(StrEnum):
    NOOP = "noop"
    UPDATE = "update"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class UpdateDecision:
    choice: Choice
    reason: str
    version: str | None = None
    image: str | None = None


def in_window(now: datetime, window: tuple[time, time] | None) -> bool:
    if window is None:
        return True
    start, end = window
    moment = now.time().replace(tzinfo=None)
    if start <= end:
        return start <= moment < end
    return moment >= start or moment < end  # the window spans midnight


def decide_update(
    *,
    current: str,
    published: Published,
    failed: frozenset[str],
    policy: UpdatePolicy,
    now: datetime,
) -> UpdateDecision:
    try:
        running = Version(current)
    except InvalidVersion:
        return UpdateDecision(Choice.SKIP, f"the running version {current!r} is not a version")
    latest = Version(published.version)
    if latest <= running:
        return UpdateDecision(Choice.NOOP, f"running {current}, published {published.version}")
    if published.version in failed:
        return UpdateDecision(
            Choice.SKIP, f"{published.version} failed before and was rolled back", published.version
        )
    if latest.is_prerelease and not policy.allow_prerelease:
        return UpdateDecision(
            Choice.SKIP, f"{published.version} is a pre-release (not allowed)", published.version
        )
    image = published.image or f"{policy.repository}:{published.version}"
    repository, reference = split_image(image)
    if repository != policy.repository:
        return UpdateDecision(
            Choice.SKIP,
            f"image {image!r} is not from the configured repository {policy.repository!r}",
            published.version,
        )
    if reference is None:
        return UpdateDecision(
            Choice.SKIP, f"image {image!r} has no tag or digest", published.version
        )
    if not in_window(now, policy.window):
        start, end = policy.window or (time(), time())
        return UpdateDecision(
            Choice.SKIP,
            f"outside the maintenance window {start:%H:%M}-{end:%H:%M} UTC",
            published.version,
        )
    return UpdateDecision(
        Choice.UPDATE, f"{current} -> {published.version}", published.version, image
    )


# The annotations on the own Deployment: the protocol between manager versions, so a name
# here never changes.
PREVIOUS_IMAGE = "workload-manager.io/previous-image"
TARGET_VERSION = "workload-manager.io/update-target"
TARGET_IMAGE = "workload-manager.io/update-image"
UPDATE_STARTED = "workload-manager.io/update-started"
CONFIRMED_VERSION = "workload-manager.io/update-confirmed"
FAILED_VERSIONS = "workload-manager.io/failed-versions"


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


def read_marks(annotations: Mapping[str, str] | None) -> UpdateMarks:
    notes = annotations or {}
    return UpdateMarks(
        previous_image=notes.get(PREVIOUS_IMAGE) or None,
        target_version=notes.get(TARGET_VERSION) or None,
        target_image=notes.get(TARGET_IMAGE) or None,
        started_at=_parse_time(notes.get(UPDATE_STARTED)),
        confirmed_version=notes.get(CONFIRMED_VERSION) or None,
        failed=frozenset(v for v in notes.get(FAILED_VERSIONS, "").split(",") if v),
    )


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


def pending_update(
    *,
    marks: UpdateMarks,
    image: str,
    rollout: RolloutPhase,
    now: datetime,
    deadline: float,
) -> Pending:
    """What the last self-update still needs, from the own Deployment alone.

    Pure, and the same for every manager instance: the old pod that applied the update,
    a restart of it, or the new pod once it runs.
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
    if rollout is RolloutPhase.READY:
        return Pending(
            Owed.WATCH, "the new pod is available; to be confirmed", target, previous,
            max(remaining, 0.0),
        )  # fmt: skip
    if remaining <= 0:
        return Pending(
            Owed.ROLLBACK,
            f"the new pod was not available within {deadline:.0f} s",
            target,
            previous,
        )
    return Pending(Owed.WATCH, "the new pod is rolling out", target, previous, remaining)
