"""A skipped test is a failure in CI, unless it says it cannot run on this machine.

`make test` installs what its tests need (the Debian packages, the scanner's virtualenv, the
control plane and the images), so a test that skips in CI names a missing install step, not a
missing machine. A skip whose reason is made by `cannot_run_here(...)` is one that no install
step can fix here (say, it needs another user than the one running); it is listed but does
not fail the run. Outside CI (no `CI` variable) skips are listed as pytest does.
"""

from __future__ import annotations

import os

import pytest

PREFIX = "cannot run here: "


def cannot_run_here(why: str) -> str:
    """A skip reason that CI accepts: what this machine lacks that no install step gives."""
    return PREFIX + why


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


class SkipsInCi:
    """Collects the skips an install step could fix; in CI they fail the run."""

    def __init__(self) -> None:
        self.fixable: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr
        reason = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix(
            "Skipped: "
        )
        if not reason.startswith(PREFIX):
            self.fixable.append((report.nodeid, reason))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.fixable and in_ci() and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.fixable:
            return
        verdict = "failed the run: CI is set" if in_ci() else "fail the run when CI is set"
        terminalreporter.section(f"skipped, though an install step would run them ({verdict})")
        for nodeid, reason in self.fixable:
            terminalreporter.write_line(f"{nodeid}: {reason}")


def pytest_configure(config: pytest.Config) -> None:
    # on the controller only: xdist workers send their reports to it
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipsInCi(), "skips-in-ci")
