"""The load tools the benchmarks drive: wrk (closed loop) and oha (fixed rate) for HTTP,
`nats bench` (the NATS CLI) for the jobs benchmark's JetStream floor.

`tools/bench-tools/install.sh` installs them (`make bench` runs it first); a tool is looked
up on PATH, then in that script's cache. A run's CPU time is the tool's own (getrusage of
the waited-for children), to show what the load generator cost beside the server.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.proc import children_cpu

REPO = Path(__file__).resolve().parent.parent
INSTALL = "tools/bench-tools/install.sh"
QUICK = 30.0  # seconds for `install.sh --print` and a tool's --version


class ToolMissing(RuntimeError):
    """A load tool is not installed: the message says how to get it."""


def find(name: str) -> str:
    """The path of the tool `name`, on PATH or in the install script's cache."""
    if found := shutil.which(name):
        return found
    printed = subprocess.run([str(REPO / INSTALL), "--print"], capture_output=True, text=True,
                             check=False, timeout=QUICK)  # fmt: skip
    path = printed.stdout.strip().splitlines()[-1] if printed.stdout.strip() else None
    if printed.returncode == 0 and path and (found := shutil.which(name, path=path)):
        return found
    raise ToolMissing(f"{name} is not installed: run {INSTALL} (make bench does)")


@dataclass(frozen=True)
class Ran:
    stdout: str
    stderr: str
    cpu_seconds: float  # user + system of the tool's process


def run(argv: Sequence[str], *, timeout: float) -> Ran:
    """Run a tool to the end; a non-zero exit is an error that shows its stderr."""
    before = children_cpu()
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        name = Path(argv[0]).name
        raise RuntimeError(f"{name} exited with {done.returncode}: {done.stderr[-800:]}")
    return Ran(done.stdout, done.stderr, children_cpu() - before)


def version(name: str, *flags: str) -> str:
    """The first line a tool prints of its own version."""
    done = subprocess.run([find(name), *flags], capture_output=True, text=True, check=False,
                          timeout=QUICK)  # fmt: skip
    text = (done.stdout or done.stderr).strip()
    return text.splitlines()[0] if text else name
