"""Self-update decisions and version-file parsing, table-driven."""

from __future__ import annotations

from datetime import UTC, datetime, time

import pytest

from app.domain.updates import (
    Choice,
    Published,
    UpdatePolicy,
    VersionFileError,
    decide_update,
    in_window,
    parse_version_file,
    split_image,
)

REPO = "ghcr.io/node-system/workload-manager"
POLICY = UpdatePolicy(repository=REPO)
NOON = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("content", "published"),
    [
        (b"1.4.2", Published("1.4.2")),
        (b"  1.4.2\n", Published("1.4.2")),
        (b"v2.0.0", Published("v2.0.0")),
        (b"1.5.0rc1", Published("1.5.0rc1")),
        (b'{"version": "1.4.2"}', Published("1.4.2")),
        (b'{"version": "1.4.2", "image": "repo/x:1.4.2", "notes": "x"}',
         Published("1.4.2", "repo/x:1.4.2")),
    ],
)  # fmt: skip
def test_version_files(content: bytes, published: Published) -> None:
    assert parse_version_file(content) == published


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "empty"),
        (b"<html>Access Denied</html>", "not a version"),
        (b"latest", "not a version"),
        (b"1.4.2 beta", "not a version"),
        (b"1.4..2", "not a valid version"),
        (b'{"version": 142}', "no string `version`"),
        (b'{"version": "1.0", "image": 5}', "`image` must be a string"),
        (b'{"version": ', "does not parse"),
        (b"\xff\xfe", "not UTF-8"),
        (b"1" * 5000, "larger than"),
    ],
)
def test_garbage_version_files_are_refused(content: bytes, says: str) -> None:
    with pytest.raises(VersionFileError, match=says):
        parse_version_file(content)


@pytest.mark.parametrize(
    ("image", "parts"),
    [
        ("repo/x:1.2", ("repo/x", "1.2")),
        ("registry:5000/repo/x:1.2", ("registry:5000/repo/x", "1.2")),
        ("registry:5000/repo/x", ("registry:5000/repo/x", None)),
        ("repo/x@sha256:abc", ("repo/x", "sha256:abc")),
        ("x", ("x", None)),
    ],
)
def test_split_image(image: str, parts: tuple[str, str | None]) -> None:
    assert split_image(image) == parts


@pytest.mark.parametrize(
    ("current", "published", "failed", "policy", "choice", "says"),
    [
        ("1.4.1", Published("1.4.2"), frozenset(), POLICY, Choice.UPDATE, "1.4.1 -> 1.4.2"),
        ("1.4.2", Published("1.4.2"), frozenset(), POLICY, Choice.NOOP, "published 1.4.2"),
        ("1.5.0", Published("1.4.2"), frozenset(), POLICY, Choice.NOOP, "running 1.5.0"),
        ("1.9.0", Published("1.10.0"), frozenset(), POLICY, Choice.UPDATE, "1.10.0"),
        ("1.4.1", Published("v1.4.2"), frozenset(), POLICY, Choice.UPDATE, "v1.4.2"),
        ("1.4.1", Published("1.4.2"), frozenset({"1.4.2"}), POLICY, Choice.SKIP, "failed before"),
        ("1.4.1", Published("1.5.0rc1"), frozenset(), POLICY, Choice.SKIP, "pre-release"),
        ("1.4.1", Published("1.5.0rc1"), frozenset(),
         UpdatePolicy(REPO, allow_prerelease=True), Choice.UPDATE, "1.5.0rc1"),
        ("1.5.0rc1", Published("1.5.0"), frozenset(), POLICY, Choice.UPDATE, "1.5.0"),
        ("1.4.1", Published("1.4.2", "evil.example/wm:1.4.2"), frozenset(), POLICY, Choice.SKIP,
         "not from the configured repository"),
        ("1.4.1", Published("1.4.2", f"{REPO}"), frozenset(), POLICY, Choice.SKIP,
         "no tag or digest"),
        ("1.4.1", Published("1.4.2", f"{REPO}@sha256:0123"), frozenset(), POLICY,
         Choice.UPDATE, "1.4.2"),
        ("dev-build", Published("1.4.2"), frozenset(), POLICY, Choice.SKIP, "not a version"),
        ("1.4.1", Published("1.4.2"), frozenset(),
         UpdatePolicy(REPO, window=(time(2), time(5))), Choice.SKIP, "maintenance window 02:00"),
        ("1.4.1", Published("1.4.2"), frozenset(),
         UpdatePolicy(REPO, window=(time(11), time(13))), Choice.UPDATE, "1.4.2"),
    ],
)  # fmt: skip
def test_decide_update(
    current: str,
    published: Published,
    failed: frozenset[str],
    policy: UpdatePolicy,
    choice: Choice,
    says: str,
) -> None:
    decision = decide_update(
        current=current, published=published, failed=failed, policy=policy, now=NOON
    )
    assert decision.choice is choice
    assert says in decision.reason


def test_an_update_names_the_image_in_the_configured_repository() -> None:
    decision = decide_update(
        current="1.0.0", published=Published("1.1.0"), failed=frozenset(), policy=POLICY, now=NOON
    )
    assert decision.image == f"{REPO}:1.1.0"


@pytest.mark.parametrize(
    ("hour", "window", "inside"),
    [
        (3, (time(2), time(5)), True),
        (5, (time(2), time(5)), False),
        (23, (time(22), time(4)), True),
        (1, (time(22), time(4)), True),
        (12, (time(22), time(4)), False),
        (12, None, True),
    ],
)
def test_window(hour: int, window: tuple[time, time] | None, inside: bool) -> None:
    assert in_window(datetime(2026, 1, 1, hour, 0, tzinfo=UTC), window) is inside
