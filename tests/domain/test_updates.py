"""Self-update decisions and version-file parsing, table-driven."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, time, timedelta

import pytest

from app.domain.health import RolloutPhase
from app.domain.updates import (
    CONFIRMED_VERSION,
    FAILED_VERSIONS,
    PREVIOUS_IMAGE,
    TARGET_IMAGE,
    TARGET_VERSION,
    UPDATE_STARTED,
    Choice,
    Owed,
    Published,
    UpdateMarks,
    UpdatePolicy,
    VersionFileError,
    decide_update,
    in_window,
    parse_version_file,
    pending_update,
    read_marks,
    split_image,
    stamp,
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


OLD, NEW, OTHER = f"{REPO}:1.0.0", f"{REPO}:1.1.0", f"{REPO}:9.9.9"
DEADLINE = 300.0
# an update to 1.1.0 applied a minute before NOON, not yet confirmed
IN_FLIGHT = UpdateMarks(
    previous_image=OLD,
    target_version="1.1.0",
    target_image=NEW,
    started_at=NOON - timedelta(seconds=60),
)
READY, ROLLING, FAILED = RolloutPhase.READY, RolloutPhase.ROLLING_OUT, RolloutPhase.FAILED


@pytest.mark.parametrize(
    ("marks", "image", "rollout", "owed", "remaining", "says"),
    [
        # nothing in flight, or settled
        (UpdateMarks(), OLD, READY, Owed.NOTHING, 0.0, "no update in flight"),
        (UpdateMarks(previous_image=OLD, failed=frozenset({"1.1.0"})), OLD, FAILED,
         Owed.NOTHING, 0.0, "no update in flight"),
        (replace(IN_FLIGHT, confirmed_version="1.1.0"), NEW, READY, Owed.NOTHING, 0.0,
         "confirmed"),
        (replace(IN_FLIGHT, confirmed_version="1.1.0"), NEW, FAILED, Owed.NOTHING, 0.0,
         "confirmed"),
        (replace(IN_FLIGHT, previous_image=None), NEW, FAILED, Owed.NOTHING, 0.0,
         "no previous image"),
        # someone else changed the image since: not the updater's to undo
        (IN_FLIGHT, OTHER, FAILED, Owed.NOTHING, 0.0, "outside the self-update"),
        # in flight: watch it
        (IN_FLIGHT, NEW, ROLLING, Owed.WATCH, 240.0, "rolling out"),
        (replace(IN_FLIGHT, confirmed_version="1.0.0"), NEW, ROLLING, Owed.WATCH, 240.0,
         "rolling out"),
        (replace(IN_FLIGHT, started_at=NOON + timedelta(seconds=5)), NEW, ROLLING,
         Owed.WATCH, DEADLINE, "rolling out"),  # clock skew: a start in the future is now
        (replace(IN_FLIGHT, started_at=None), NEW, ROLLING, Owed.WATCH, DEADLINE,
         "rolling out"),  # written by an older manager: the deadline starts now
        (IN_FLIGHT, NEW, READY, Owed.WATCH, 240.0, "to be confirmed"),
        (replace(IN_FLIGHT, started_at=NOON - timedelta(hours=1)), NEW, READY, Owed.WATCH,
         0.0, "to be confirmed"),  # done, even if late: confirm rather than roll back
        (replace(IN_FLIGHT, target_image=None), NEW, READY, Owed.WATCH, 240.0,
         "to be confirmed"),  # an older manager's successful update, never confirmed
        # failed: roll back
        (IN_FLIGHT, NEW, FAILED, Owed.ROLLBACK, 0.0, "ProgressDeadlineExceeded"),
        (replace(IN_FLIGHT, target_image=None), NEW, FAILED, Owed.ROLLBACK, 0.0,
         "ProgressDeadlineExceeded"),  # an older manager's failed rollback
        (replace(IN_FLIGHT, started_at=NOON - timedelta(seconds=DEADLINE)), NEW, ROLLING,
         Owed.ROLLBACK, 0.0, "not available within 300 s"),
        # the image is back already: only the bookkeeping is owed
        (IN_FLIGHT, OLD, READY, Owed.FINISH_ROLLBACK, 0.0, "put back to"),
        (IN_FLIGHT, OLD, ROLLING, Owed.FINISH_ROLLBACK, 0.0, "put back to"),
        (replace(IN_FLIGHT, failed=frozenset({"1.1.0"})), OLD, READY, Owed.FINISH_ROLLBACK,
         0.0, "put back to"),
    ],
)  # fmt: skip
def test_pending_update(
    marks: UpdateMarks,
    image: str,
    rollout: RolloutPhase,
    owed: Owed,
    remaining: float,
    says: str,
) -> None:
    pending = pending_update(marks=marks, image=image, rollout=rollout, now=NOON, deadline=DEADLINE)
    assert pending.owed is owed, pending
    assert says in pending.reason
    assert pending.remaining == pytest.approx(remaining)
    if owed is not Owed.NOTHING:
        assert pending.version == "1.1.0" and pending.previous_image == OLD


@pytest.mark.parametrize(
    ("annotations", "marks"),
    [
        (None, UpdateMarks()),
        ({}, UpdateMarks()),
        ({"deployment.kubernetes.io/revision": "3"}, UpdateMarks()),
        (
            {PREVIOUS_IMAGE: OLD, TARGET_VERSION: "1.1.0", TARGET_IMAGE: NEW,
             UPDATE_STARTED: "2026-11-29T11:59:00Z", CONFIRMED_VERSION: "1.0.0",
             FAILED_VERSIONS: "0.9.0,1.0.1"},
            UpdateMarks(OLD, "1.1.0", NEW, NOON - timedelta(seconds=60), "1.0.0",
                        frozenset({"0.9.0", "1.0.1"})),
        ),
        # unreadable or empty values count as absent
        ({TARGET_VERSION: "", UPDATE_STARTED: "yesterday", FAILED_VERSIONS: ",,"},
         UpdateMarks()),
        ({UPDATE_STARTED: "2026-11-29T11:59:00"},
         UpdateMarks(started_at=NOON - timedelta(seconds=60))),  # no zone: UTC
    ],
)  # fmt: skip
def test_read_marks(annotations: dict[str, str] | None, marks: UpdateMarks) -> None:
    assert read_marks(annotations) == marks


def test_a_stamped_start_reads_back() -> None:
    at = datetime(2026, 11, 29, 11, 59, 0, 750_000, tzinfo=UTC)
    assert stamp(at) == "2026-11-29T11:59:00Z"
    assert read_marks({UPDATE_STARTED: stamp(at)}).started_at == at.replace(microsecond=0)
