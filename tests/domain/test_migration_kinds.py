"""Expand and contract migrations, pure: the declaration (outside the checksum), the lint
of what an expand migration may hold, and what an older release's `migrate` does with a
schema ahead of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from app.domain.migrations import (
    Applied,
    ContractHeldBack,
    Kind,
    LiveNode,
    Migration,
    MigrationError,
    check_kind,
    held_back_by,
    parse_files,
    plan,
    schema_behind,
)

BODY = "CREATE TABLE t (id int);\n"


def test_declaring_a_kind_leaves_the_checksum_as_it_was() -> None:
    bare = Migration(1, "t", BODY)
    declared = Migration(1, "t", "-- kind: expand\n" + BODY)
    assert declared.checksum == bare.checksum
    assert (bare.kind, declared.kind) == (None, Kind.EXPAND)
    assert Migration(1, "t", "-- kind:  Contract \n" + BODY).kind is Kind.CONTRACT


@pytest.mark.parametrize(
    ("sql", "problems"),
    [
        ("-- kind: expand\nCREATE TABLE t (id int);", []),
        ("-- kind: expand\nALTER TABLE t ADD COLUMN n text;", []),
        ("-- kind: expand\nALTER TABLE t ADD COLUMN n int NOT NULL DEFAULT 0;", []),
        ("-- kind: expand\nCREATE INDEX CONCURRENTLY i ON t (n);", []),
        ("-- kind: expand\n-- we never DROP anything here\nCREATE TABLE u (id int);", []),
        ("-- kind: contract\n-- requires-nodes-at-least: 1.4.0\nALTER TABLE t DROP COLUMN n;",
         []),
        ("-- kind: contract\nALTER TABLE t DROP COLUMN n;",
         ["0007_t.sql: a contract migration declares no `-- requires-nodes-at-least"]),
        ("-- kind: contract\n-- requires-nodes-at-least: soon\nDROP TABLE t;",
         ["requires-nodes-at-least 'soon' is not a release version"]),
        ("-- kind: expand\n-- requires-nodes-at-least: 1.4.0\nCREATE TABLE u (id int);",
         ["an expand migration declares requires-nodes-at-least"]),
        (BODY, ["0007_t.sql: no `-- kind: expand` or `-- kind: contract` line"]),
        ("-- kind: sideways\n" + BODY, ["0007_t.sql: kind 'sideways' is neither"]),
        ("-- kind: expand\nALTER TABLE t DROP COLUMN n;", ["an expand migration holds DROP"]),
        ("-- kind: expand\nALTER TABLE t RENAME COLUMN n TO m;", ["holds RENAME"]),
        ("-- kind: expand\nALTER TABLE t ALTER COLUMN n TYPE bigint;", ["ALTER COLUMN ... TYPE"]),
        ("-- kind: expand\nALTER TABLE t ALTER COLUMN n SET NOT NULL;", ["SET NOT NULL"]),
        ("-- kind: expand\nALTER TABLE t ADD CONSTRAINT c UNIQUE (n);", ["a new constraint"]),
        ("-- kind: expand\nDELETE FROM t;", ["holds DELETE FROM"]),
        ("-- kind: expand\nALTER TABLE t ADD COLUMN n int NOT NULL;",
         ["adds a NOT NULL column without a DEFAULT"]),
    ],
)  # fmt: skip
def test_what_an_expand_migration_may_hold(sql: str, problems: list[str]) -> None:
    found = check_kind(Migration(7, "t", sql))
    assert len(found) == len(problems), found
    for got, wanted in zip(found, problems, strict=True):
        assert wanted in got


KNOWN = [Migration(1, "a", "-- kind: expand\n" + BODY), Migration(2, "b", "-- kind: expand\n")]


def applied(*versions: tuple[int, str | None]) -> list[Applied]:
    by = {m.version: m for m in KNOWN}
    return [
        Applied(v, by[v].name if v in by else f"n{v}", by[v].checksum if v in by else "x", kind)
        for v, kind in versions
    ]


def test_a_schema_ahead_by_expand_migrations_is_fine_and_said() -> None:
    done = plan(KNOWN, applied((1, "expand"), (2, "expand"), (3, "expand"), (4, "expand")))
    assert done.todo == []
    assert [a.version for a in done.ahead] == [3, 4]
    assert done.note == "schema ahead by 2 expand migrations"


def test_behind_runs_what_is_missing_and_even_is_nothing() -> None:
    assert [m.version for m in plan(KNOWN, applied((1, None))).todo] == [2]
    even = plan(KNOWN, applied((1, None), (2, "expand")))
    assert (even.todo, even.ahead, even.note) == ([], [], "")


@pytest.mark.parametrize(
    ("ahead", "says"),
    [
        ((3, "contract"), "ahead of this release by 0003_n3, a contract migration"),
        ((3, None), "0003_n3, a migration with no kind on record"),
    ],
)
def test_a_schema_ahead_by_a_contract_stops_the_older_release(
    ahead: tuple[int, str | None], says: str
) -> None:
    with pytest.raises(MigrationError, match=says):
        plan(KNOWN, applied((1, "expand"), (2, "expand"), ahead))


def test_an_applied_file_that_changed_is_still_refused() -> None:
    records = applied((1, "expand"), (2, "expand"))
    records[0] = Applied(1, "a", "changed", "expand")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        plan(KNOWN, records)


# the checksums the databases recorded when these were applied, before they declared a kind
RECORDED = {
    1: "a09856e4f46e9e99ab13474363df04d8ad2b9e291ca34fdf01ff0cf3190772e9",
    2: "1688093b8ed25b6b709090c25af064d613d3a924afc591d20a0cf0f3375951cf",
    3: "137a24dd09c24cf0226cee8fe41ca0f885ea4482d68d8756eb90d123d75206a8",
    4: "007e68f31cf92de009a2cde148be6ff9c8da3178e45f83e0d0f1c7b376d92ef2",
    5: "fed48998c94a2bc9b7302437200be50028e6d3350a5173d7d558e74c1982e5b3",
    6: "c9a359871c8c59f0c42656118740e8e02922da60e54ee9a8837090d2b39cd0a6",
}  # fmt: skip


def test_every_migration_of_the_project_declares_its_kind_and_keeps_its_checksum() -> None:
    root = Path(__file__).resolve().parents[2] / "migrations"
    migrations = parse_files({p.name: p.read_text() for p in root.glob("*.sql")})
    assert [p for m in migrations for p in check_kind(m)] == []
    for m in migrations:
        if m.version in RECORDED:
            assert m.checksum == RECORDED[m.version], m.filename


CONTRACT = Migration(
    9,
    "drop_claimant",
    "-- kind: contract\n-- requires-nodes-at-least: 1.4.0\n"
    "ALTER TABLE job_ledger DROP COLUMN claimant;\n",
)


def test_the_requirement_is_outside_the_checksum_and_read_as_a_release() -> None:
    bare = Migration(9, "drop_claimant", "ALTER TABLE job_ledger DROP COLUMN claimant;\n")
    assert CONTRACT.checksum == bare.checksum
    assert CONTRACT.requires_nodes_at_least == Version("1.4.0")
    assert bare.requires_nodes_at_least is None


def test_a_contract_is_held_back_by_the_live_nodes_below_its_release() -> None:
    nodes = [
        LiveNode("n-new", "1.4.0", "online"),
        LiveNode("n-newer", "1.10.0", "draining"),  # 1.10 > 1.4 as a release, not as text
        LiveNode("n-old", "1.3.9", "suspect"),
        LiveNode("n-pre", "1.4.0rc1", "online"),  # a pre-release comes before the release
        LiveNode("n-unknown", None, "online"),  # registered before releases were recorded
        LiveNode("n-odd", "not-a-version", "online"),
    ]
    holders = held_back_by(CONTRACT, nodes)
    assert [h.node_id for h in holders] == ["n-odd", "n-old", "n-pre", "n-unknown"]
    assert held_back_by(CONTRACT, nodes[:2]) == []
    assert held_back_by(Migration(8, "x", "-- kind: expand\n" + BODY), nodes) == []
    refused = ContractHeldBack(CONTRACT, holders[1:2], applied=[KNOWN[0]])
    assert str(refused) == (
        "0009_drop_claimant.sql is a contract migration for nodes at 1.4.0 or later, and 1 "
        "live node below it still uses what it drops: n-old (1.3.9, suspect). Nothing from "
        "0009_drop_claimant.sql on was applied (1 before it were); upgrade those nodes, or "
        "let them go offline (three missed heartbeats), then run migrate again"
    )


def test_a_contract_without_its_requirement_is_not_applied_at_all() -> None:
    undeclared = Migration(9, "drop", "-- kind: contract\nDROP TABLE t;\n")
    with pytest.raises(MigrationError, match="without a valid `-- requires-nodes-at-least"):
        held_back_by(undeclared, [])


def test_the_schema_is_behind_by_the_expand_migrations_not_applied() -> None:
    shipped = [*KNOWN, Migration(3, "c", "-- kind: expand\n" + BODY), CONTRACT]
    assert schema_behind(shipped, [1, 2, 3, 9]) == []
    assert schema_behind(shipped, [1, 2]) == ["0003_c.sql"]  # the contract may wait
    assert schema_behind(shipped, [1]) == ["0002_b.sql", "0003_c.sql"]
