"""In CI a skipped test fails the run, unless its reason says it cannot run on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import pytest
from tests.support.ci_skips import cannot_run_here

def test_runs():
    assert True

@pytest.mark.skipif(True, reason={reason!r})
def test_skipped():
    pass
"""


def run(tmp_path: Path, reason: str, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(SUITE.format(reason=reason))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci is not None:
        env["CI"] = ci
    plugins = ["-p", "tests.support.ci_skips", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", *plugins, "-q", str(tmp_path)]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("reason", "ci", "code"),
    [
        ("chromium is not installed", "true", 1),
        ("chromium is not installed", None, 0),
        ("chromium is not installed", "false", 0),
        ("cannot run here: as root only", "true", 0),
    ],
)
def test_a_skip_an_install_step_could_fix_fails_the_run_in_ci(
    tmp_path: Path, reason: str, ci: str | None, code: int
) -> None:
    result = run(tmp_path, reason, ci)
    assert result.returncode == code, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout
    listed = "skipped, though an install step would run them" in result.stdout
    assert listed == (not reason.startswith("cannot run here"))
