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

**Contract gating.** A contract migration also names the oldest manager release that no
longer uses what it drops: `-- requires-nodes-at-least: 1.4.0` (outside the checksum too;
the lint wants it on every contract and on nothing else). `migrate` applies it only when
no live node of the registry runs a release below that (`held_back_by`), compared as PEP
440 versions; a node whose release is not on record (it registered before releases were
recorded) counts as below, since nothing says it has stopped using what is dropped.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from packaging.version import InvalidVersion, Version

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_KIND = re.compile(r"^--[ \t]*kind:[ \t]*(\S+)[ \t]*\n?", re.MULTILINE)
_REQUIRES = re.compile(r"^--[ \t]*requires-nodes-at-least:[ \t]*(\S*)[ \t]*\n?", re.MULTILINE)
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
        """Of the text without its declarations (kind, requires-nodes-at-least): declaring
        them on an applied migration changes nothing."""
        text = _REQUIRES.sub("", _KIND.sub("", self.sql, count=1), count=1)
        return hashlib.sha256(text.encode()).hexdigest()

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
    def requires_nodes_at_least(self) -> Version | None:
        """The oldest manager release that no longer uses what this contract drops (None:
        not declared, or not a PEP 440 version: the lint says which)."""
        found = _REQUIRES.search(self.sql)
        if found is None:
            return None
        try:
            return Version(found.group(1))
        except InvalidVersion:
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
    requires = _REQUIRES.search(migration.sql)
    if migration.kind is Kind.CONTRACT:
        if requires is None:
            return [
                f"{migration.filename}: a contract migration declares no "
                "`-- requires-nodes-at-least: <release>` line (the oldest manager release "
                "that no longer uses what it drops): migrate could not tell which nodes it "
                "would strand"
            ]
        if migration.requires_nodes_at_least is None:
            return [
                f"{migration.filename}: requires-nodes-at-least {requires.group(1)!r} is "
                "not a release version (PEP 440, e.g. 1.4.0)"
            ]
        return []
    body = _COMMENTS.sub(" ", migration.sql)
    problems = [
        f"{migration.filename}: an expand migration holds {what}"
        for pattern, what in _CONTRACTING
        if pattern.search(body)
    ]
    if requires is not None:
        problems.append(
            f"{migration.filename}: an expand migration declares requires-nodes-at-least "
            "(only a contract waits for the nodes: every release can use an expanded schema)"
        )
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


@dataclass(frozen=True, slots=True)
class LiveNode:
    """A node the registry counts as live (not offline: it heartbeats, or has missed
    fewer than three), with the manager release it registered with (None: not recorded,
    a node of a release from before releases were recorded)."""

    node_id: str
    version: str | None
    liveness: str

    @property
    def described(self) -> str:
        return f"{self.node_id} ({self.version or 'release not recorded'}, {self.liveness})"


def _below(version: str | None, floor: Version) -> bool:
    if version is None:
        return True
    try:
        return Version(version) < floor
    except InvalidVersion:
        return True  # nothing says it has stopped using what is dropped


def held_back_by(migration: Migration, nodes: Iterable[LiveNode]) -> list[LiveNode]:
    """The live nodes that keep a contract migration from being applied: those whose
    release is below its requires-nodes-at-least (or unknown). An expand migration is
    held back by none. A contract without a valid declaration is refused outright."""
    if migration.kind is not Kind.CONTRACT:
        return []
    floor = migration.requires_nodes_at_least
    if floor is None:
        raise MigrationError(
            f"{migration.filename} is a contract migration without a valid "
            "`-- requires-nodes-at-least: <release>` line: it is not applied, since no one "
            "can tell which nodes it would strand"
        )
    return sorted((n for n in nodes if _below(n.version, floor)), key=lambda n: n.node_id)


class ContractHeldBack(MigrationError):
    """A contract migration that live older nodes still need what it drops; the
    migrations before it were applied (`applied`), nothing from it on."""

    def __init__(
        self, migration: Migration, holders: list[LiveNode], applied: list[Migration]
    ) -> None:
        n = len(holders)
        super().__init__(
            f"{migration.filename} is a contract migration for nodes at "
            f"{migration.requires_nodes_at_least} or later, and {n} live node"
            f"{'s' if n != 1 else ''} below it still use{'s' if n == 1 else ''} what it "
            f"drops: {', '.join(h.described for h in holders)}. Nothing from "
            f"{migration.filename} on was applied ({len(applied)} before it were); upgrade "
            "those nodes, or let them go offline (three missed heartbeats), then run "
            "migrate again"
        )
        self.migration = migration
        self.holders = holders
        self.applied = applied


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


def schema_behind(migrations: Iterable[Migration], applied_versions: Iterable[int]) -> list[str]:
    """The migrations this release ships that its code needs and the database has not
    applied (readiness fails while there are any): every expand one (or one without a
    kind). A contract one is left out: it only takes away what this release no longer
    uses, and it waits, by design, for the older nodes to go."""
    done = set(applied_versions)
    return [m.filename for m in migrations if m.version not in done and m.kind is not Kind.CONTRACT]
