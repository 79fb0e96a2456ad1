"""Migration bookkeeping, table-driven: file names, order, and refusing changed history."""

from __future__ import annotations

import pytest

from app.domain.migrations import Applied, Migration, MigrationError, parse_files, pending

M1 = Migration(1, "first", "CREATE TABLE a ();")
M2 = Migration(2, "second", "CREATE TABLE b ();")
M3 = Migration(3, "third", "CREATE TABLE c ();")


def applied(m: Migration, checksum: str | None = None) -> Applied:
    return Applied(m.version, m.name, checksum or m.checksum)


def test_files_parse_in_version_order() -> None:
    files = {"0002_second.sql": M2.sql, "0001_first.sql": M1.sql}
    assert parse_files(files) == [M1, M2]


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({"1_first.sql": ""}, "named NNNN_name.sql"),
        ({"0001-first.sql": ""}, "named NNNN_name.sql"),
        ({"0001_First.sql": ""}, "named NNNN_name.sql"),
        ({"0001_a.sql": "", "0001_b.sql": ""}, "version 1 is used by"),
    ],
)
def test_bad_file_sets_are_refused(files: dict[str, str], says: str) -> None:
    with pytest.raises(MigrationError, match=says):
        parse_files(files)


@pytest.mark.parametrize(
    ("files", "done", "todo"),
    [
        ([M1, M2], [], [M1, M2]),
        ([M1, M2], [applied(M1)], [M2]),
        ([M1, M2], [applied(M1), applied(M2)], []),
        ([M1, M2, M3], [applied(M1), applied(M2)], [M3]),
    ],
)
def test_pending(files: list[Migration], done: list[Applied], todo: list[Migration]) -> None:
    assert pending(files, done) == todo


@pytest.mark.parametrize(
    ("files", "done", "says"),
    [
        ([M1, M2], [applied(M1, checksum="0" * 64)], "0001_first.sql changed after it was applied"),
        ([M2], [applied(M1)], "0001_first is applied but its file is gone"),
        ([M1, M2, M3], [applied(M1), applied(M3)], "0002_second.sql is older than applied"),
    ],
)
def test_history_that_disagrees_is_refused(
    files: list[Migration], done: list[Applied], says: str
) -> None:
    with pytest.raises(MigrationError, match=says):
        pending(files, done)


def test_checksums_follow_the_text() -> None:
    assert M1.checksum == Migration(1, "first", "CREATE TABLE a ();").checksum
    assert M1.checksum != Migration(1, "first", "CREATE TABLE a (x int);").checksum
