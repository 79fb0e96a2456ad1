"""Self-update decisions and version-file parsing, table-driven."""

from __future__ import annotations

import base64
from dataclasses import replace
from datetime import UTC, datetime, time, timedelta

import pytest

from app.domain.health import RolloutPhase
from app.domain.rollout import RolloutSpec, UpdateWindow, place, seed_for
from app.domain.updates import (
    AVAILABLE_SINCE,
    CONFIRMED_VERSION,
    FAILED_VERSIONS,
    HIGHEST_IMAGE,
    HIGHEST_VERSION,
    MAX_SIGNATURE_BYTES,
    PREVIOUS_IMAGE,
    TARGET_IMAGE,
    TARGET_VERSION,
    UPDATE_STARTED,
    VERSION_FILE_SERIAL,
    Choice,
    Confirmed,
    ImageRef,
    Owed,
    Published,
    SignatureError,
    UpdateMarks,
    UpdatePolicy,
    VersionFileError,
    VersionFileKey,
    check_serial,
    confirmation,
    decide_update,
    healthy_span,
    in_window,
    parse_image,
    parse_public_key,
    parse_signature,
    parse_version_file,
    pending_update,
    read_marks,
    reassertion,
    signature_location,
    signature_needs_own_url,
    split_image,
    stamp,
)

REPO = "ghcr.io/node-system/workload-manager"
POLICY = UpdatePolicy(repository=REPO)
NOON = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
DIGEST = "0123456789abcdef" * 4
NEW_IMAGE = f"{REPO}:1.1.0"


def windowed(setting: str) -> UpdatePolicy:
    """The policy with SELF_UPDATE_WINDOW set to `setting`."""
    return UpdatePolicy(REPO, window=UpdateWindow.from_setting(setting))


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
        (b'{"version": "1.4.2", "serial": 42}', Published("1.4.2", serial=42)),
        (b'{"version": "1.4.2", "serial": 0}', Published("1.4.2", serial=0)),
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
        (b'{"version": "1.0", "serial": -1}', "`serial` must be a non-negative integer"),
        (b'{"version": "1.0", "serial": "7"}', "`serial` must be a non-negative integer"),
        (b'{"version": "1.0", "serial": true}', "`serial` must be a non-negative integer"),
        (b'{"version": "1.0", "serial": 1.5}', "`serial` must be a non-negative integer"),
    ],
)
def test_garbage_version_files_are_refused(content: bytes, says: str) -> None:
    with pytest.raises(VersionFileError, match=says):
        parse_version_file(content)


@pytest.mark.parametrize(
    ("serial", "recorded", "says"),
    [
        (None, None, None),  # nothing recorded, nothing numbered: as before serials
        (5, None, None),
        (5, 5, None),  # the same file again
        (6, 5, None),
        (4, 5, "serial 4 is below the recorded 5"),
        (None, 5, "has no serial, and serial 5 was recorded"),
    ],
)
def test_a_version_file_serial_only_goes_forward(
    serial: int | None, recorded: int | None, says: str | None
) -> None:
    published = Published("1.4.2", serial=serial)
    if says is None:
        check_serial(published, recorded)
    else:
        with pytest.raises(VersionFileError, match=says):
            check_serial(published, recorded)


@pytest.mark.parametrize(
    ("annotation", "serial"),
    [("12", 12), ("0", 0), ("", None), ("-1", None), ("x", None), ("1" * 20, None)],
)
def test_the_recorded_serial_reads_only_a_number(annotation: str, serial: int | None) -> None:
    assert read_marks({VERSION_FILE_SERIAL: annotation}).serial == serial


@pytest.mark.parametrize(
    ("content", "rollout"),
    [
        (b"1.4.2", None),  # a bare version: everyone at once
        (b'{"version": "1.4.2"}', None),
        (b'{"version": "1.4.2", "rollout": null}', None),
        (b'{"version": "1.4.2", "rollout": {"percent": 20}}', RolloutSpec(percent=20)),
        (b'{"version": "1.4.2", "rollout": {"percent": 20, "halt": false, "seed": "wave-1"}}',
         RolloutSpec(percent=20, seed="wave-1")),
        (b'{"version": "1.4.2", "rollout": {"halt": true}}', RolloutSpec(halt=True)),
        (b'{"version": "1.4.2", "rollout": {}}', RolloutSpec()),  # 100 %: everyone
        (b'{"version": "1.4.2", "rollout": {"percent": 0.5, "later": 1}}',
         RolloutSpec(percent=0.5)),  # fields to come are ignored, as a workload's are
    ],
)  # fmt: skip
def test_the_version_file_may_carry_a_rollout(content: bytes, rollout: RolloutSpec | None) -> None:
    published = parse_version_file(content)
    assert (published.version, published.rollout) == ("1.4.2", rollout)


@pytest.mark.parametrize(
    ("rollout", "says"),
    [
        ("5", "version file `rollout` must be an object"),
        ('"20%"', "version file `rollout` must be an object"),
        ('{"percent": 150}', "version file `rollout.percent`: .*less than or equal to 100"),
        ('{"percent": -1}', "version file `rollout.percent`"),
        ('{"percent": "half"}', "version file `rollout.percent`"),
        ('{"percent": NaN}', "version file `rollout.percent`"),
        ('{"halt": "maybe"}', "version file `rollout.halt`"),
        ('{"seed": ""}', "version file `rollout.seed`"),
        ('{"seed": 7}', "version file `rollout.seed`"),
    ],
)
def test_a_bad_rollout_is_refused_naming_the_field(rollout: str, says: str) -> None:
    with pytest.raises(VersionFileError, match=says):
        parse_version_file(f'{{"version": "1.4.2", "rollout": {rollout}}}'.encode())


# places for the default seed `workload-manager/1.4.2`, and for the seed "canary-7"
PLACES = {"node-a": (0.26, 30.93), "node-b": (25.86, 93.72), "node-c": (92.86, 95.41),
          "node-d": (90.52, 22.10)}  # fmt: skip


def test_the_places_of_the_wave_tests() -> None:
    for node, (default, canary) in PLACES.items():
        assert place(seed_for("workload-manager", "1.4.2", None), node) == pytest.approx(
            default, abs=0.01
        )
        assert place("canary-7", node) == pytest.approx(canary, abs=0.01)


def waves(node: str, *, window: str | None = None) -> UpdatePolicy:
    return UpdatePolicy(
        REPO, node_id=node, window=UpdateWindow.from_setting(window) if window else None
    )


def rolling(percent: float = 100.0, *, halt: bool = False, seed: str | None = None) -> Published:
    return Published("1.4.2", rollout=RolloutSpec(percent=percent, halt=halt, seed=seed))


@pytest.mark.parametrize(
    ("current", "published", "failed", "policy", "choice", "says"),
    [
        # no rollout: everyone at once
        ("1.4.1", Published("1.4.2"), frozenset(), waves("node-c"), Choice.UPDATE,
         "1.4.1 -> 1.4.2"),
        # a node placed below the percent applies, the others wait for a wider wave
        ("1.4.1", rolling(20), frozenset(), waves("node-a"), Choice.UPDATE,
         "1.4.1 -> 1.4.2 (place 0.2 < 20 %)"),
        ("1.4.1", rolling(20), frozenset(), waves("node-b"), Choice.WAITING_WAVE,
         "place 25.8 ≥ 20 %"),
        ("1.4.1", rolling(30), frozenset(), waves("node-b"), Choice.UPDATE,
         "(place 25.8 < 30 %)"),
        ("1.4.1", rolling(100), frozenset(), waves("node-c"), Choice.UPDATE, "1.4.1 -> 1.4.2"),
        ("1.4.1", rolling(0), frozenset(), waves("node-a"), Choice.WAITING_WAVE,
         "place 0.2 ≥ 0 %"),
        # the seed chooses the early nodes
        ("1.4.1", rolling(25, seed="canary-7"), frozenset(), waves("node-d"), Choice.UPDATE,
         "(place 22 < 25 %)"),  # rounded down, as shown
        ("1.4.1", rolling(25, seed="canary-7"), frozenset(), waves("node-a"),
         Choice.WAITING_WAVE, "place 30.9 ≥ 25 %"),
        # a halt stops every new update, whatever the percent
        ("1.4.1", rolling(100, halt=True), frozenset(), waves("node-a"), Choice.HALTED,
         "the rollout is halted"),
        # the wave is judged before the window (as a workload's is)
        ("1.4.1", rolling(20), frozenset(), waves("node-b", window="02:00-05:00"),
         Choice.WAITING_WAVE, "place 25.8 ≥ 20 %"),
        ("1.4.1", rolling(20), frozenset(), waves("node-a", window="02:00-05:00"), Choice.SKIP,
         "outside the maintenance window"),
        # and after what is no update at all: nothing new, failed before, a pre-release
        ("1.4.2", rolling(100, halt=True), frozenset(), waves("node-a"), Choice.NOOP,
         "published 1.4.2"),
        ("1.4.1", rolling(0), frozenset({"1.4.2"}), waves("node-a"), Choice.SKIP,
         "failed before"),
        ("1.4.1", Published("1.5.0rc1", rollout=RolloutSpec(halt=True)), frozenset(),
         waves("node-a"), Choice.SKIP, "pre-release"),
        ("1.4.1", Published("1.4.2", "evil.example/wm:1.4.2", RolloutSpec(percent=0)),
         frozenset(), waves("node-a"), Choice.SKIP, "not from the configured repository"),
    ],
)  # fmt: skip
def test_decide_update_waves(
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
    assert decision.choice is choice, decision
    assert says in decision.reason
    if choice in (Choice.WAITING_WAVE, Choice.HALTED):
        assert decision.reason == says  # the wave's own reason
        assert (decision.version, decision.image) == ("1.4.2", None)


@pytest.mark.parametrize(
    ("image", "parts"),
    [
        ("repo/x:1.2", ("repo/x", "1.2")),
        ("registry:5000/repo/x:1.2", ("registry:5000/repo/x", "1.2")),
        ("registry:5000/repo/x", ("registry:5000/repo/x", None)),
        ("repo/x@sha256:abc", ("repo/x", "sha256:abc")),
        ("repo/x:1.2@sha256:abc", ("repo/x", "sha256:abc")),
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
        ("dev-build", Published("1.4.2"), frozenset(), POLICY, Choice.SKIP, "not a version"),
        # the window (NOON is a Sunday, 14:00 in Kyiv)
        ("1.4.1", Published("1.4.2"), frozenset(), windowed("02:00-05:00"), Choice.SKIP,
         "outside the maintenance window every day 02:00-05:00 UTC"),
        ("1.4.1", Published("1.4.2"), frozenset(), windowed("11:00-13:00"), Choice.UPDATE,
         "1.4.2"),
        ("1.4.1", Published("1.4.2"), frozenset(),
         windowed('{"days": ["sat"], "start": "11:00", "end": "13:00"}'), Choice.SKIP,
         "outside the maintenance window sat 11:00-13:00 UTC"),
        ("1.4.1", Published("1.4.2"), frozenset(),
         windowed('{"days": ["sun"], "start": "13:00", "end": "15:00", "tz": "Europe/Kyiv"}'),
         Choice.UPDATE, "1.4.1 -> 1.4.2"),
        ("1.4.1", Published("1.4.2"), frozenset(),
         windowed('{"days": ["sun"], "start": "11:00", "end": "13:00", "tz": "Europe/Kyiv"}'),
         Choice.SKIP, "outside the maintenance window sun 11:00-13:00 Europe/Kyiv"),
        # crossing midnight: the window's day is the day it opens
        ("1.4.1", Published("1.4.2"), frozenset(),
         windowed('{"days": ["sat"], "start": "23:00", "end": "13:00"}'), Choice.UPDATE,
         "1.4.2"),
        ("1.4.1", Published("1.4.2"), frozenset(),
         windowed('{"days": ["sun"], "start": "23:00", "end": "13:00"}'), Choice.SKIP,
         "outside the maintenance window sun 23:00-13:00 UTC"),
        # nothing to start: the window is not what the decision says
        ("1.4.2", Published("1.4.2"), frozenset(), windowed("02:00-05:00"), Choice.NOOP,
         "published 1.4.2"),
        # the image's tag is the version: a newer version cannot carry an older image
        ("1.4.1", Published("9.9.9", f"{REPO}:0.0.1"), frozenset(), POLICY, Choice.SKIP,
         "tag '0.0.1' is not the version 9.9.9"),
        ("1.4.1", Published("1.4.2", f"{REPO}:latest"), frozenset(), POLICY, Choice.SKIP,
         "tag 'latest' is not the version 1.4.2"),
        ("1.4.1", Published("1.4.2", f"{REPO}:1.4.2"), frozenset(), POLICY, Choice.UPDATE,
         "1.4.1 -> 1.4.2"),
        # a leading `v` is the same version (PEP 440), in the tag or in the version
        ("1.4.1", Published("1.4.2", f"{REPO}:v1.4.2"), frozenset(), POLICY, Choice.UPDATE,
         "1.4.2"),
        ("1.4.1", Published("v1.4.2", f"{REPO}:1.4.2"), frozenset(), POLICY, Choice.UPDATE,
         "1.4.2"),
        # but no other spelling: the tag is what the registry serves, exactly
        ("1.4.1", Published("1.5.0rc1", f"{REPO}:1.5.0-rc1"), frozenset(),
         UpdatePolicy(REPO, allow_prerelease=True), Choice.SKIP, "is not the version 1.5.0rc1"),
        # a pre-release image under a release version is refused, whatever the policy
        ("1.4.1", Published("1.5.0", f"{REPO}:1.5.0-rc1"), frozenset(), POLICY, Choice.SKIP,
         "tag '1.5.0-rc1' is not the version 1.5.0"),
        ("1.4.1", Published("1.5.0", f"{REPO}:1.5.0rc1"), frozenset(),
         UpdatePolicy(REPO, allow_prerelease=True), Choice.SKIP, "is not the version 1.5.0"),
        # a digest pins no tag: the version alone says whether it is a pre-release
        ("1.4.1", Published("1.5.0rc1", f"{REPO}@sha256:{DIGEST}"), frozenset(), POLICY,
         Choice.SKIP, "1.5.0rc1 is a pre-release (not allowed)"),
        ("1.4.1", Published("1.5.0rc1", f"{REPO}:1.5.0rc1@sha256:{DIGEST}"), frozenset(),
         UpdatePolicy(REPO, allow_prerelease=True), Choice.UPDATE, "1.4.1 -> 1.5.0rc1"),
        # a pinned digest: sha256 and 64 lowercase hex digits, and a tag beside it is the version
        ("1.4.1", Published("1.4.2", f"{REPO}@sha256:{DIGEST}"), frozenset(), POLICY,
         Choice.UPDATE, "1.4.2"),
        ("1.4.1", Published("1.4.2", f"{REPO}:1.4.2@sha256:{DIGEST}"), frozenset(), POLICY,
         Choice.UPDATE, "1.4.2"),
        ("1.4.1", Published("1.4.2", f"{REPO}:0.0.1@sha256:{DIGEST}"), frozenset(), POLICY,
         Choice.SKIP, "tag '0.0.1' is not the version 1.4.2"),
        ("1.4.1", Published("1.4.2", f"{REPO}@sha256:0123"), frozenset(), POLICY, Choice.SKIP,
         "not sha256:<64 lowercase hex digits>"),
        ("1.4.1", Published("1.4.2", f"{REPO}@sha256:{DIGEST.upper()}"), frozenset(), POLICY,
         Choice.SKIP, "not sha256:<64 lowercase hex digits>"),
        ("1.4.1", Published("1.4.2", f"{REPO}@md5:{DIGEST[:32]}"), frozenset(), POLICY,
         Choice.SKIP, "not sha256:<64 lowercase hex digits>"),
        ("1.4.1", Published("1.4.2", f"{REPO}@sha256:{DIGEST}@sha256:{DIGEST}"), frozenset(),
         POLICY, Choice.SKIP, "not sha256:<64 lowercase hex digits>"),
        ("1.4.1", Published("1.4.2", f"{REPO}:1.4.2 "), frozenset(), POLICY, Choice.SKIP,
         "is not a valid tag"),
        ("1.4.1", Published("1.4.2", f"{REPO}:1.4.2:1.4.2"), frozenset(), POLICY, Choice.SKIP,
         "not from the configured repository"),
        # the image is judged before the version: a bad image is refused, never a noop
        ("1.5.0", Published("1.4.2", f"{REPO}:0.0.1"), frozenset(), POLICY, Choice.SKIP,
         "is not the version 1.4.2"),
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


@pytest.mark.parametrize(
    ("image", "ref"),
    [
        ("repo/x:1.2", ImageRef("repo/x", "1.2")),
        ("registry:5000/repo/x", ImageRef("registry:5000/repo/x")),
        ("registry:5000/repo/x:1.2", ImageRef("registry:5000/repo/x", "1.2")),
        (f"repo/x@sha256:{DIGEST}", ImageRef("repo/x", None, f"sha256:{DIGEST}")),
        (f"repo/x:1.2@sha256:{DIGEST}", ImageRef("repo/x", "1.2", f"sha256:{DIGEST}")),
        ("repo/x:", ImageRef("repo/x", "")),
        ("repo/x@", ImageRef("repo/x", None, "")),
    ],
)
def test_parse_image(image: str, ref: ImageRef) -> None:
    assert parse_image(image) == ref


@pytest.mark.parametrize(
    ("image", "says"),
    [
        (f"{REPO}:", "'' is not a valid tag"),
        (f"{REPO}@", "the digest is not sha256"),
        (f"{REPO}:{'1' * 129}", "is not a valid tag"),
        (f"{REPO}:-1.4.2", "is not a valid tag"),
    ],
)
def test_malformed_images_are_refused(image: str, says: str) -> None:
    decision = decide_update(
        current="1.0.0", published=Published("1.4.2", image), failed=frozenset(), policy=POLICY,
        now=NOON,
    )  # fmt: skip
    assert decision.choice is Choice.SKIP and says in decision.reason, decision


def test_a_pinned_digest_is_what_gets_patched() -> None:
    for image in (f"{REPO}@sha256:{DIGEST}", f"{REPO}:1.1.0@sha256:{DIGEST}"):
        decision = decide_update(
            current="1.0.0", published=Published("1.1.0", image), failed=frozenset(),
            policy=POLICY, now=NOON,
        )  # fmt: skip
        assert decision.choice is Choice.UPDATE and decision.image == image


PRE = UpdatePolicy(REPO, allow_prerelease=True)
AT_1_5 = Confirmed("1.5.0", f"{REPO}:1.5.0")


@pytest.mark.parametrize(
    ("current", "published", "highest", "choice", "says"),
    [
        # the node was moved back (a rollback outside the self-update): not below the floor
        ("1.0.0", Published("1.4.9"), AT_1_5, Choice.SKIP,
         "1.4.9 is below 1.5.0, the highest version confirmed on this node"),
        ("1.0.0", Published("1.5.0rc1"), AT_1_5, Choice.SKIP, "below 1.5.0"),
        ("1.0.0", Published("1.4.9", f"{REPO}@sha256:{DIGEST}"), AT_1_5, Choice.SKIP,
         "below 1.5.0"),
        # the steady state after an update: nothing to do, and said so
        ("1.5.0", Published("1.5.0"), AT_1_5, Choice.NOOP, "running 1.5.0, published 1.5.0"),
        # a downgrade published to a node at the floor is refused, not a quiet noop
        ("1.5.0", Published("1.4.2"), AT_1_5, Choice.SKIP, "a downgrade is refused"),
        # the floor's own version, as it was confirmed: back to it
        ("1.0.0", Published("1.5.0"), AT_1_5, Choice.UPDATE, "1.0.0 -> 1.5.0"),
        ("1.0.0", Published("1.5.0", f"{REPO}:1.5.0"), AT_1_5, Choice.UPDATE, "1.5.0"),
        # the floor's version as another image: refused
        ("1.0.0", Published("1.5.0", f"{REPO}@sha256:{DIGEST}"), AT_1_5, Choice.SKIP,
         f"1.5.0 was confirmed on this node as '{REPO}:1.5.0'"),
        ("1.5.0", Published("1.5.0", f"{REPO}:1.5.0@sha256:{DIGEST}"), AT_1_5, Choice.SKIP,
         "was confirmed on this node as"),
        # the floor's image not known (recorded without it): its version is enough
        ("1.0.0", Published("1.5.0", f"{REPO}@sha256:{DIGEST}"), Confirmed("1.5.0"),
         Choice.UPDATE, "1.5.0"),
        # above the floor: as without one
        ("1.5.0", Published("1.6.0"), AT_1_5, Choice.UPDATE, "1.5.0 -> 1.6.0"),
        ("1.0.0", Published("1.6.0"), AT_1_5, Choice.UPDATE, "1.0.0 -> 1.6.0"),
        ("1.5.0", Published("1.6.0rc1"), AT_1_5, Choice.SKIP, "pre-release"),
    ],
)  # fmt: skip
def test_no_version_below_the_highest_confirmed_one(
    current: str, published: Published, highest: Confirmed, choice: Choice, says: str
) -> None:
    decision = decide_update(
        current=current, published=published, failed=frozenset(), policy=POLICY, now=NOON,
        highest=highest,
    )  # fmt: skip
    assert decision.choice is choice, decision
    assert says in decision.reason


@pytest.mark.parametrize(
    ("highest", "version", "image", "written"),
    [
        (None, "1.1.0", NEW_IMAGE, {HIGHEST_VERSION: "1.1.0", HIGHEST_IMAGE: NEW_IMAGE}),
        (Confirmed("1.0.0", "x"), "1.1.0", NEW_IMAGE,
         {HIGHEST_VERSION: "1.1.0", HIGHEST_IMAGE: NEW_IMAGE}),
        (Confirmed("1.1.0"), "1.1.0", NEW_IMAGE,
         {HIGHEST_VERSION: "1.1.0", HIGHEST_IMAGE: NEW_IMAGE}),
        (None, "1.1.0", None, {HIGHEST_VERSION: "1.1.0", HIGHEST_IMAGE: None}),
        # never lowered, nor its image replaced
        (Confirmed("1.1.0", NEW_IMAGE), "1.1.0", "other", {}),
        (Confirmed("2.0.0", "x"), "1.1.0", NEW_IMAGE, {}),
        (None, "not-a-version", NEW_IMAGE, {}),
    ],
)  # fmt: skip
def test_a_confirmation_raises_the_floor_and_never_lowers_it(
    highest: Confirmed | None, version: str, image: str | None, written: dict[str, str | None]
) -> None:
    assert confirmation(UpdateMarks(highest=highest), version, image) == {
        CONFIRMED_VERSION: version,
        **written,
    }


SIGNATURE = bytes(range(64))
RAW_KEY = bytes(range(32))
SPKI = bytes.fromhex("302a300506032b6570032100") + RAW_KEY


def pem(der: bytes) -> str:
    body = base64.b64encode(der).decode()
    return f"-----BEGIN PUBLIC KEY-----\n{body}\n-----END PUBLIC KEY-----\n"


@pytest.mark.parametrize(
    "text",
    [base64.b64encode(RAW_KEY).decode(), f"  {base64.b64encode(RAW_KEY).decode()}\n", pem(SPKI)],
)
def test_public_keys(text: str) -> None:
    assert parse_public_key(text) == RAW_KEY


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "base64 of its 32 raw bytes"),
        ("not base64!", "base64 of its 32 raw bytes"),
        (base64.b64encode(RAW_KEY[:31]).decode(), "base64 of its 32 raw bytes"),
        (RAW_KEY.hex(), "base64 of its 32 raw bytes"),  # hex is not taken: ambiguous
        (pem(bytes.fromhex("302a300506032b6571032100") + RAW_KEY), "not an Ed25519 key"),  # X448
        (pem(SPKI[:-1]), "not an Ed25519 key"),
        ("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----", "32 raw bytes"),
    ],
)
def test_unusable_public_keys_are_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_public_key(text)


NOT_A_KEY = (
    "expected an Ed25519 public key: base64 of its 32 raw bytes, or a PEM "
    "(-----BEGIN PUBLIC KEY-----)"
)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (base64.b64encode(RAW_KEY).decode(), VersionFileKey(RAW_KEY)),
        (f"  {base64.b64encode(RAW_KEY).decode()}\n", VersionFileKey(RAW_KEY)),
        (pem(SPKI), VersionFileKey(RAW_KEY)),
    ],
)
def test_the_version_file_key_is_parsed_once_into_its_raw_bytes(
    text: str, parsed: VersionFileKey
) -> None:
    key = VersionFileKey.parse(text)
    assert key == parsed
    assert str(key) == base64.b64encode(RAW_KEY).decode()  # as SELF_UPDATE_PUBLIC_KEY takes it


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", NOT_A_KEY),
        ("not base64!", NOT_A_KEY),
        (base64.b64encode(RAW_KEY[:31]).decode(), NOT_A_KEY),
        (RAW_KEY.hex(), NOT_A_KEY),
        (pem(bytes.fromhex("302a300506032b6571032100") + RAW_KEY), "the PEM public key is not an "
         "Ed25519 key"),
    ],
)  # fmt: skip
def test_an_unusable_version_file_key_is_refused_without_quoting_it(text: str, error: str) -> None:
    with pytest.raises(ValueError) as caught:
        VersionFileKey.parse(text)
    assert str(caught.value) == error


@pytest.mark.parametrize(
    "content",
    [base64.b64encode(SIGNATURE), base64.b64encode(SIGNATURE) + b"\n",
     b"\r\n " + base64.b64encode(SIGNATURE) + b" \n"],
)  # fmt: skip
def test_signatures(content: bytes) -> None:
    assert parse_signature(content) == SIGNATURE


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "not the base64 of a 64-byte"),
        (b"<Error><Code>NoSuchKey</Code></Error>", "not the base64 of a 64-byte"),
        (base64.b64encode(SIGNATURE[:63]), "not the base64 of a 64-byte"),
        (base64.b64encode(SIGNATURE + b"x"), "not the base64 of a 64-byte"),
        (SIGNATURE, "not the base64 of a 64-byte"),  # raw bytes, not base64
        (SIGNATURE.hex().encode(), "not the base64 of a 64-byte"),
        (b" " * (MAX_SIGNATURE_BYTES + 1), f"larger than {MAX_SIGNATURE_BYTES} bytes"),
    ],
)
def test_unusable_signatures_are_refused(content: bytes, says: str) -> None:
    with pytest.raises(SignatureError, match=says):
        parse_signature(content)


@pytest.mark.parametrize(
    ("url", "location"),
    [
        ("https://releases.example/wm/version.json", "https://releases.example/wm/version.json.sig"),
        ("https://releases.example/wm/version?channel=stable#x",
         "https://releases.example/wm/version.sig?channel=stable"),
        ("http://127.0.0.1:8000/version", "http://127.0.0.1:8000/version.sig"),
        ("s3://wm-releases/wm/version.json", "s3://wm-releases/wm/version.json.sig"),
    ],
)  # fmt: skip
def test_signature_location(url: str, location: str) -> None:
    assert signature_location(url) == location
    assert signature_location(url, "s3://elsewhere/version.sig") == "s3://elsewhere/version.sig"


@pytest.mark.parametrize(
    ("url", "own"),
    [
        ("https://b.s3.eu-west-1.amazonaws.com/version?X-Amz-Signature=ab&X-Amz-Expires=9", True),
        ("https://a.blob.core.windows.net/c/version?sv=2022-11-02&sig=abc", True),
        ("https://releases.example/wm/version?channel=stable", True),
        ("https://releases.example/wm/version", False),
        ("https://releases.example/wm/version?", False),
        ("http://127.0.0.1:8000/version#x", False),
        ("s3://wm-releases/wm/version.json", False),
    ],
)  # fmt: skip
def test_a_url_with_a_query_needs_its_own_signature_url(url: str, own: bool) -> None:
    assert signature_needs_own_url(url) is own


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
    if owed is Owed.WATCH:  # what a confirmation records as the floor's image
        assert pending.image == marks.target_image


MIN_HEALTHY = 60.0
SEEN = replace(IN_FLIGHT, available_since=NOON - timedelta(seconds=20))  # available 20 s ago


@pytest.mark.parametrize(
    ("marks", "image", "rollout", "min_healthy", "owed", "says"),
    [
        # available, its min healthy time under way: watched until it is over
        (SEEN, NEW, READY, MIN_HEALTHY, Owed.WATCH, "available for 20 s of 60 s"),
        (replace(SEEN, available_since=NOON - timedelta(hours=1)), NEW, READY, MIN_HEALTHY,
         Owed.WATCH, "available for 3600 s of 60 s"),  # over: confirmed at the next read
        (IN_FLIGHT, NEW, READY, MIN_HEALTHY, Owed.WATCH,
         "the new pod is available; to be confirmed"),  # not seen yet: the time starts now
        # available once, unavailable since, not confirmed: a failed update
        (SEEN, NEW, ROLLING, MIN_HEALTHY, Owed.ROLLBACK,
         "the Deployment became unavailable within the 60 s the new pod must stay available"),
        (SEEN, NEW, FAILED, MIN_HEALTHY, Owed.ROLLBACK, "ProgressDeadlineExceeded"),
        # 0 s: today's rule, the mark means nothing
        (SEEN, NEW, ROLLING, 0.0, Owed.WATCH, "rolling out"),
        (SEEN, NEW, READY, 0.0, Owed.WATCH, "the new pod is available; to be confirmed"),
        # settled before the min healthy time is looked at
        (replace(SEEN, confirmed_version="1.1.0"), NEW, ROLLING, MIN_HEALTHY, Owed.NOTHING,
         "confirmed"),
        (SEEN, OLD, ROLLING, MIN_HEALTHY, Owed.FINISH_ROLLBACK, "put back to"),
        (SEEN, OTHER, ROLLING, MIN_HEALTHY, Owed.NOTHING, "outside the self-update"),
    ],
)  # fmt: skip
def test_pending_update_with_a_min_healthy_time(
    marks: UpdateMarks, image: str, rollout: RolloutPhase, min_healthy: float, owed: Owed,
    says: str,
) -> None:  # fmt: skip
    pending = pending_update(
        marks=marks, image=image, rollout=rollout, now=NOON, deadline=DEADLINE,
        min_healthy=min_healthy,
    )  # fmt: skip
    assert pending.owed is owed, pending
    assert says in pending.reason, pending
    if owed is Owed.WATCH and rollout is READY and min_healthy:
        assert pending.available_since == marks.available_since


@pytest.mark.parametrize(
    ("since", "min_healthy", "start", "left"),
    [
        (None, 60.0, NOON, 60.0),  # first seen now
        (NOON - timedelta(seconds=20), 60.0, NOON - timedelta(seconds=20), 40.0),
        (NOON - timedelta(seconds=60), 60.0, NOON - timedelta(seconds=60), 0.0),
        (NOON - timedelta(hours=1), 60.0, NOON - timedelta(hours=1), 0.0),
        (NOON + timedelta(seconds=5), 60.0, NOON, 60.0),  # clock skew: a future mark is now
        (NOON - timedelta(seconds=20), 0.0, NOON - timedelta(seconds=20), 0.0),
    ],
)  # fmt: skip
def test_healthy_span(
    since: datetime | None, min_healthy: float, start: datetime, left: float
) -> None:
    assert healthy_span(since, now=NOON, min_healthy=min_healthy) == (start, left)


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
        ({HIGHEST_VERSION: "1.1.0", HIGHEST_IMAGE: NEW},
         UpdateMarks(highest=Confirmed("1.1.0", NEW))),
        ({HIGHEST_VERSION: "1.1.0"}, UpdateMarks(highest=Confirmed("1.1.0"))),
        ({HIGHEST_VERSION: "one", HIGHEST_IMAGE: NEW}, UpdateMarks()),
        ({HIGHEST_IMAGE: NEW}, UpdateMarks()),
        ({AVAILABLE_SINCE: "2026-11-29T11:59:40Z"},
         UpdateMarks(available_since=NOON - timedelta(seconds=20))),
        ({AVAILABLE_SINCE: "soon"}, UpdateMarks()),
        # the last confirmation alone sets no floor (it may predate the floor's checks)
        ({CONFIRMED_VERSION: "9.9.9"}, UpdateMarks(confirmed_version="9.9.9")),
    ],
)  # fmt: skip
def test_read_marks(annotations: dict[str, str] | None, marks: UpdateMarks) -> None:
    assert read_marks(annotations) == marks


def test_a_stamped_start_reads_back() -> None:
    at = datetime(2026, 11, 29, 11, 59, 0, 750_000, tzinfo=UTC)
    assert stamp(at) == "2026-11-29T11:59:00Z"
    assert read_marks({UPDATE_STARTED: stamp(at)}).started_at == at.replace(microsecond=0)


# A re-applied install file (K3S re-applies its auto-deploy folder at every start) puts the
# install's image back below the version confirmed on this node: the manager re-asserts it.
CONFIRMED_2 = Confirmed("0.2.0", f"{REPO}:0.2.0")


@pytest.mark.parametrize(
    ("current", "highest", "failed", "choice", "image"),
    [
        ("0.1.0", CONFIRMED_2, frozenset(), Choice.UPDATE, f"{REPO}:0.2.0"),
        ("0.2.0", CONFIRMED_2, frozenset(), Choice.NOOP, None),  # already there
        ("0.3.0", CONFIRMED_2, frozenset(), Choice.NOOP, None),  # above the floor
        ("0.1.0", None, frozenset(), Choice.NOOP, None),  # nothing confirmed here
        ("0.1.0", Confirmed("0.2.0", None), frozenset(), Choice.SKIP, None),  # image unknown
        ("0.1.0", CONFIRMED_2, frozenset({"0.2.0"}), Choice.SKIP, None),  # failed since
        ("0.1.0", Confirmed("0.2.0", "elsewhere/manager:0.2.0"), frozenset(), Choice.SKIP, None),
        ("not-a-version", CONFIRMED_2, frozenset(), Choice.SKIP, None),
    ],
)
def test_reassertion_of_the_confirmed_version(
    current: str,
    highest: Confirmed | None,
    failed: frozenset[str],
    choice: Choice,
    image: str | None,
) -> None:
    decision = reassertion(current=current, highest=highest, failed=failed, repository=REPO)
    assert decision.choice is choice, decision
    assert decision.image == image
    if choice is Choice.UPDATE:
        assert decision.version == "0.2.0"
        assert "below 0.2.0, the highest version confirmed on this node" in decision.reason
