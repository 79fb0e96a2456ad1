"""Ctrl-C, as a person running `make run` sends it: the same clean shutdown as SIGTERM,
and no traceback after it."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["terminal", "background-job"])
def test_ctrl_c_shuts_down_cleanly_without_a_traceback(
    tmp_path: Path, sigint_ignored: bool
) -> None:
    """Also when the manager was started with SIGINT ignored, as a script's background job
    is: the exit code still says it was interrupted."""
    proc = ManagerProcess(env={}, workdir=tmp_path).start(sigint_ignored=sigint_ignored)
    try:
        proc.send(signal.SIGINT)
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.stop()
        raise
    log = proc.log()
    assert "shutdown steps done" in log, log
    assert "Traceback" not in log, log
    assert code == 128 + signal.SIGINT, log  # as a shell reports an interrupted command
