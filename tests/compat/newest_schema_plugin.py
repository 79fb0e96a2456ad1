"""A pytest plugin loaded into the previous release's own test run (`-p
newest_schema_plugin`, tests/compat/test_previous_release.py): once its session's
PostgreSQL is up, the newest release's `migrate` migrates `template1`, so every database its
tests create starts with the newest schema, as a fleet's does after one node upgraded.

It imports nothing of either release (the previous release's `app` is the one on the path):
the newest `migrate` runs as a process from the tree COMPAT_NEWEST_ROOT names, and what it
said is written to COMPAT_REPORT, for the outer test to check that it ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    server = yield
    if fixturedef.argname == "postgres_server":
        _migrate_template(server.url.rpartition("/")[0] + "/template1")
    return server


def _migrate_template(url: str) -> None:
    newest = Path(os.environ["COMPAT_NEWEST_ROOT"])
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    done = subprocess.run(
        [sys.executable, "-m", "app", "migrate"],
        cwd=newest,
        env={**keep, "PYTHONPATH": str(newest), "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    Path(os.environ["COMPAT_REPORT"]).write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        pytest.exit(f"the newest release's migrate failed on template1:\n{done.stderr}", 3)
