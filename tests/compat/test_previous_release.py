"""The previous release against the newest schema, on embedded PostgreSQL: its `migrate`
exits 0 and its registry tests pass, as on a fleet where one node has upgraded and the
others restart on the release they run (issue 37: a schema change never strands a node).

The previous release is the commit pinned in previous_release.txt, taken from this clone's
history with `git archive` (a clone without it fails the test: it cannot be judged) and run
from the same virtualenv. Its registry tests run in a pytest of their own, in its own tree,
with a plugin that gives each database they create the newest schema first
(newest_schema_plugin.py), except the tests whose subject is migrating an empty database.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.adapters.registry import AsyncpgRegistry
from app.services import migrating
from standins.databases import MIGRATIONS

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PIN = HERE / "previous_release.txt"
REGISTRY_TESTS = "tests/adapters/test_registry.py"
# the previous release's registry tests that start from an empty database by their subject
# (what the first `migrate` of a new database does): they cannot start from the newest schema
EMPTY_DATABASE_TESTS = {
    "test_concurrent_migrators_apply_each_file_once": "four migrators, one applies every file",
    "test_failed_migration_leaves_nothing_half_applied": "no table is left of a failed run",
}


def pinned_commit() -> str:
    lines = [line.strip() for line in PIN.read_text().splitlines()]
    commits = [line for line in lines if line and not line.startswith("#")]
    assert len(commits) == 1 and re.fullmatch(r"[0-9a-f]{7,40}", commits[0]), (
        f"{PIN} holds one commit (hex) besides its comments"
    )
    return commits[0]


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's files, from this clone's history."""
    commit = pinned_commit()
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        pytest.fail(
            f"the previous release {commit} ({PIN.relative_to(ROOT)}) is not in this clone's "
            f"history ({found.stderr.strip() or 'not a git checkout'}): the compatibility "
            "test needs it (a full clone; `git fetch --unshallow` for a shallow one)",
            pytrace=False,
        )
    tree = tmp_path_factory.mktemp("previous-release")
    with subprocess.Popen(
        ["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE
    ) as archive:
        untar = subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout)
        assert archive.stdout is not None
        archive.stdout.close()
    assert (archive.returncode, untar.returncode) == (0, 0), f"git archive {commit} | tar -x"
    return tree


def previous(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A command of the previous release, run from its tree (its `app` first on the path)."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "CI")}
    return subprocess.run(
        [sys.executable, *args],
        cwd=tree,
        env={**keep, "PYTHONPATH": str(tree), **env},
        capture_output=True,
        text=True,
        timeout=100,
    )


async def test_the_previous_release_migrates_over_the_newest_schema(
    database: str, previous_tree: Path
) -> None:
    newest = AsyncpgRegistry(database, timeout=5)
    await newest.open()
    try:
        assert len(await migrating.migrate(newest, MIGRATIONS)) == len(
            list(MIGRATIONS.glob("*.sql"))
        )
        done = previous(previous_tree, "-m", "app", "migrate", DATABASE_URL=database)
        assert done.returncode == 0, f"the previous release's migrate:\n{done.stderr}"
        assert "schema up to date (0 applied now)" in done.stdout
        # and the newest finds the schema as it left it
        assert await migrating.migrate(newest, MIGRATIONS) == []
    finally:
        await newest.close()


def test_the_previous_releases_registry_tests_pass_on_the_newest_schema(
    previous_tree: Path, tmp_path: Path
) -> None:
    registry_tests = (previous_tree / REGISTRY_TESTS).read_text()
    for name in EMPTY_DATABASE_TESTS:  # a name that went away is not left out silently
        assert f"def {name}(" in registry_tests, f"{name} is no longer in {REGISTRY_TESTS}"
    report = tmp_path / "newest-migrate.txt"
    deselect = [f"--deselect={REGISTRY_TESTS}::{name}" for name in EMPTY_DATABASE_TESTS]
    done = previous(
        previous_tree,
        "-m", "pytest", REGISTRY_TESTS, "-q", "-p", "newest_schema_plugin", *deselect,
        PYTHONPATH=f"{previous_tree}{os.pathsep}{HERE}",
        COMPAT_NEWEST_ROOT=str(ROOT),
        COMPAT_REPORT=str(report),
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"the previous release's registry tests:\n{done.stdout[-6000:]}"
    assert report.is_file(), "the plugin never migrated the previous release's databases"
    assert "applied 0001_worker_capabilities.sql" in report.read_text()
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None and int(passed.group(1)) >= 20, summary
    assert f"{len(EMPTY_DATABASE_TESTS)} deselected" in summary, summary
