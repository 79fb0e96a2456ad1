"""Where a server's CPU goes under load: py-spy samples, summed by package and by function.

Optional (`python -m bench --profile`): py-spy is not a project dependency; install it
into the virtualenv with `pip install py-spy`. It samples without pausing the process
(--nonblocking) but still costs CPU, so it gets a load phase of its own, never measured.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")
_SITE = re.compile(r"^.*/(?:site|dist)-packages/")
# Frames under every sample (process start-up down to the event loop): not worth listing.
_BOOTSTRAP = ("uvicorn/main.py", "uvicorn/server.py", "uvicorn/_compat.py", "app/__main__.py",
              "app/cli.py")  # fmt: skip


def py_spy() -> str | None:
    """The py-spy next to this interpreter, or on PATH; None when it is not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def start(pid: int, seconds: float, output: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    """Start sampling `pid` for `seconds`; the caller drives the load meanwhile, then waits."""
    exe = py_spy()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
         "--rate", str(rate), "--format", "raw", "--output", str(output), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def _where(frame: str) -> tuple[str, str]:
    """(function (file), package) for one py-spy frame; stdlib packages are marked."""
    match = _FRAME.match(frame)
    if match is None:
        return frame or "(no Python frame)", frame or "(no Python frame)"
    file = _SITE.sub("", match["file"])
    top = file.lstrip("/").split("/", 1)[0].removesuffix(".py")
    if file.startswith("<"):  # "<frozen runpy>"
        top = file.strip("<>").removeprefix("frozen ")
    if file.startswith("<") or top in sys.stdlib_module_names:
        return f"{match['func']} ({file})", f"{top} (stdlib)"
    return f"{match['func']} ({file})", top


def _boot(function: str) -> bool:
    return any(f"({file})" in function for file in _BOOTSTRAP)


def summarize(raw: str, top: int = 25) -> dict[str, Any]:
    """Shares of samples: by the package of the innermost frame, and by function, inclusive."""
    total = 0
    by_package: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = [_where(f) for f in stack.split(";")]
        by_package[frames[-1][1]] += samples
        leaf[frames[-1][0]] += samples
        for function in {f for f, pkg in frames if "(stdlib)" not in pkg and not _boot(f)}:
            inclusive[function] += samples

    def shares(counter: Counter[str], n: int) -> list[dict[str, Any]]:
        return [
            {"name": name, "percent": round(100.0 * count / total, 1)}
            for name, count in counter.most_common(n)
        ]

    return {
        "samples": total,
        "by_package": shares(by_package, 12) if total else [],
        "inclusive": shares(inclusive, top) if total else [],
        "self": shares(leaf, top) if total else [],
    }
