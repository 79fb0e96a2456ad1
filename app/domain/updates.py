"""Self-update: read the published version file, and decide whether to move to it.

The version file is a bare version (`1.4.2`) or JSON `{"version": "1.4.2", "image":
"repo/name:1.4.2"}`. `decide_update` is pure: only a newer version (PEP 440 ordering),
only within the configured image repository (the tag or digest is all that changes),
never one that failed before, pre-releases only when allowed, and only inside the
maintenance window when one is set.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, time
from enum import StrEnum

from packaging.version import InvalidVersion, Version

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
