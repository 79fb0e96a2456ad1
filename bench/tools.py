"""The load tools the benchmarks drive: wrk, oha, `nats bench` (the NATS CLI).

`tools/bench-tools/install.sh` installs them (`make bench` runs it first); a tool is looked
up on PATH, then in that script's cache. A run's CPU time is the tool's own.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.proc import children_cpu

INSTALL = "tools/bench-tools/install.sh"
REPO = Path(__file__).resolve().parent.parent


def find(name: str) -> str:
    """The path of the tool `name`, on PATH or in the install script's cache."""
    if not (found := shutil.which(name)):
        printed = subprocess.run([str(REPO / INSTALL), "--print"], capture_output=True,
                                 text=True, timeout=30).stdout.strip().splitlines()  # fmt: skip
        found = shutil.which(name, path=printed[-1]) if printed else None
    if found:
        return found
    raise RuntimeError(f"{name} is not installed: run {INSTALL} (make bench does)")


@dataclass(frozen=True)
class Ran:
    stdout: str
    cpu_seconds: float  # user + system of the tool's process


def run(argv: Sequence[str], *, timeout: float) -> Ran:
    """Run a tool to the end; a non-zero exit is an error that shows its stderr."""
    before = children_cpu()
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} exited with {done.returncode}: "
                           f"{done.stderr[-800:]}")  # fmt: skip
    return Ran(done.stdout, children_cpu() - before)


def version(name: str, *flags: str) -> str:
    """The first line a tool prints of its own version."""
    done = subprocess.run([find(name), *flags], capture_output=True, text=True, timeout=30)
    return ((done.stdout or done.stderr).strip().splitlines() or [name])[0]
