"""Schema migrations as data: which files exist, which are applied, what to run next.

Files are `NNNN_name.sql`, applied in version order, each recorded with a checksum of
its text. An applied file that changed, or disappeared, stops the run: the database
and the code would no longer agree on what the schema is.

**Expand and contract.** A migration declares itself with a line `-- kind: expand` (it
only adds: tables, nullable columns or columns with a default, indexes) or `-- kind:
contract` (it drops or changes what code may still use). The declaration is not part of
the checksum, so declaring a migration already applied changes nothing. `check_kind`
reads its statements and refuses an expand migration that contracts. Each applied
migration is recorded with its kind, so an older release that finds newer migrations
applied (`plan`) goes on when every one of them is an expand ("schema ahead by N expand
migrations": its code still finds all it uses), and stops when one is a contract or has
no kind on record.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_KIND = re.compile(r"^--[ \t]*kind:[ \t]*(\S+)[ \t]*\n?", re.MULTILINE)
# statements an expand migration may not hold (comments are stripped before the look)
_CONTRACTING = (
    (re.compile(r"\bDROP\b", re.I), "DROP"),
    (re.compile(r"\bRENAME\b", re.I), "RENAME"),
    (re.compile(r"\bTRUNCATE\b", re.I), "TRUNCATE"),
    (re.compile(r"\bDELETE\s+FROM\b", re.I), "DELETE FROM"),
    (re.compile(r"\bALTER\s+COLUMN\b[^;]*\bTYPE\b", re.I), "ALTER COLUMN ... TYPE"),
    (re.compile(r"\bSET\s+NOT\s+NULL\b", re.I), "SET NOT NULL"),
    (re.compile(r"\bADD\s+(?:CONSTRAINT|PRIMARY\s+KEY|UNIQUE)\b", re.I), "a new constraint"),
)
_ADD_COLUMN = re.compile(r"\bADD\s+COLUMN\b([^,;]*)", re.I)
_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)


class Kind(StrEnum):
    EXPAND = "expand"
    CONTRACT = "contract"


class MigrationError(RuntimeError):
    """The migrations cannot be applied as they are (the message says which file)."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """Of the text without its kind declaration (declaring one changes nothing)."""
        return hashlib.sha256(_KIND.sub("", self.sql, count=1).encode()).hexdigest()

    @property
    def kind(self) -> Kind | None:
        found = _KIND.search(self.sql)
        if found is None:
            return None
        try:
            return Kind(found.group(1).lower())
        except ValueError:
            return None

    @property
    def filename(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


@dataclass(frozen=True, slots=True)
class Applied:
    version: int
    name: str
    checksum: str
    kind: str | None = None  # as recorded when applied (None: before kinds were recorded)


def check_kind(migration: Migration) -> list[str]:
    """What is wrong with a migration's declaration (lint: an empty list is fine)."""
    found = _KIND.search(migration.sql)
    if found is None:
        return [f"{migration.filename}: no `-- kind: expand` or `-- kind: contract` line"]
    if migration.kind is None:
        return [f"{migration.filename}: kind {found.group(1)!r} is neither expand nor contract"]
    if migration.kind is Kind.CONTRACT:
        return []
    body = _COMMENTS.sub(" ", migration.sql)
    problems = [
        f"{migration.filename}: an expand migration holds {what}"
        for pattern, what in _CONTRACTING
        if pattern.search(body)
    ]
    for added in _ADD_COLUMN.finditer(body):
        column = added.group(1)
        if re.search(r"\bNOT\s+NULL\b", column, re.I) and not re.search(
            r"\bDEFAULT\b", column, re.I
        ):
            problems.append(
                f"{migration.filename}: an expand migration adds a NOT NULL column "
                "without a DEFAULT (older code inserting rows would fail)"
            )
    return problems


@dataclass(frozen=True, slots=True)
class Plan:
    """What `migrate` does: run `todo`; `ahead` are applied migrations this release does
    not know (all expand: its code still finds everything it uses)."""

    todo: list[Migration]
    ahead: list[Applied] = field(default_factory=list)

    @property
    def note(self) -> str:
        if not self.ahead:
            return ""
        n = len(self.ahead)
        return f"schema ahead by {n} expand migration{'s' if n != 1 else ''}"


def plan(migrations: Iterable[Migration], applied: Iterable[Applied]) -> Plan:
    """`pending`, for a release that may be older than the schema: applied migrations
    newer than every file it has are fine when each is recorded as an expand."""
    known = list(migrations)
    newest = max((m.version for m in known), default=0)
    records = list(applied)
    ahead = sorted((r for r in records if r.version > newest), key=lambda r: r.version)
    blocking = [r for r in ahead if r.kind != Kind.EXPAND.value]
    if blocking:
        first = blocking[0]
        what = (
            "a contract migration"
            if first.kind == Kind.CONTRACT.value
            else ("a migration with no kind on record")
        )
        raise MigrationError(
            f"the schema is ahead of this release by {first.version:04d}_{first.name}, "
            f"{what}: this release's code may need what it changed; run a newer release"
        )
    todo = pending(known, [r for r in records if r.version <= newest])
    return Plan(todo, ahead)


def parse_files(files: Mapping[str, str]) -> list[Migration]:
    """Migrations from {filename: text}; other files are an error, not silently skipped."""
    found: dict[int, Migration] = {}
    for filename, sql in files.items():
        match = _FILE.fullmatch(filename)
        if match is None:
            raise MigrationError(f"{filename}: migration files are named NNNN_name.sql")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(
                f"{filename}: version {version} is used by {found[version].filename}"
            )
        found[version] = Migration(version, match.group(2), sql)
    return [found[v] for v in sorted(found)]


def pending(migrations: Iterable[Migration], applied: Iterable[Applied]) -> list[Migration]:
    """The migrations still to run, in order; refuses when history and files disagree."""
    by_version = {m.version: m for m in migrations}
    done: set[int] = set()
    for record in applied:
        migration = by_version.get(record.version)
        if migration is None:
            raise MigrationError(
                f"migration {record.version:04d}_{record.name} is applied but its file is gone"
            )
        if migration.checksum != record.checksum:
            raise MigrationError(
                f"{migration.filename} changed after it was applied "
                "(write a new migration instead of editing an applied one)"
            )
        done.add(record.version)
    todo = [m for v, m in sorted(by_version.items()) if v not in done]
    if done and todo and todo[0].version < max(done):
        raise MigrationError(
            f"{todo[0].filename} is older than applied migration {max(done):04d}: "
            "renumber it after the last applied one"
        )
    return todo
