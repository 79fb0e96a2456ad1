"""Schema migrations as data: which files exist, which are applied, what to run next.

Files are `NNNN_name.sql`, applied in version order, each recorded with a checksum of
its text. An applied file that changed, or disappeared, stops the run: the database
and the code would no longer agree on what the schema is.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class MigrationError(RuntimeError):
    """The migrations cannot be applied as they are (the message says which file)."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def filename(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


@dataclass(frozen=True, slots=True)
class Applied:
    version: int
    name: str
    checksum: str


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
