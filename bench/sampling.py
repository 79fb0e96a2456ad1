"""Where a process's CPU goes under load: py-spy samples, summed by package and by function.

Optional (`python -m bench --profile`): py-spy is not a project dependency; install it
into the virtualenv with `pip install py-spy`. It samples without pausing the process
(--nonblocking) but still costs CPU, so it gets a load phase of its own, never measured.
It sees only the running coroutine's frames: read the shares by innermost frame.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.report import table

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")
_SITE = re.compile(r"^.*/(?:site|dist)-packages/")
# Frames under every sample (process start-up down to the event loop): not worth listing.
_BOOTSTRAP = ("uvicorn/main.py", "uvicorn/server.py", "uvicorn/_compat.py", "app/__main__.py",
              "app/cli.py")  # fmt: skip


def start(pid: int, seconds: float, output: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    """Start sampling `pid` for `seconds`; FileNotFoundError when py-spy is not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    exe = str(beside) if beside.exists() else shutil.which("py-spy")
    if exe is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
         "--rate", str(rate), "--format", "raw", "--output", str(output), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def finish(sampler: subprocess.Popen[bytes], output: Path, seconds: float) -> dict[str, Any]:
    """Wait for py-spy to end (polling: a thread waiting on it would be sampled) and sum up."""
    deadline = time.monotonic() + seconds + 30.0
    while sampler.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if sampler.poll() is None:
        sampler.kill()
    _, stderr = sampler.communicate()
    if sampler.returncode != 0 or not output.exists():
        return {"error": f"py-spy exited with {sampler.returncode}: {stderr.decode()[-500:]}"}
    return {"seconds": round(seconds, 1)} | summarize(output.read_text())


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
        for function, package in set(frames):
            if "(stdlib)" not in package and not any(f"({b})" in function for b in _BOOTSTRAP):
                inclusive[function] += samples

    def shares(counter: Counter[str], n: int) -> list[dict[str, Any]]:
        return [{"name": name, "percent": round(100.0 * count / total, 1)}
                for name, count in counter.most_common(n)] if total else []  # fmt: skip

    return {"samples": total, "by_package": shares(by_package, 12),
            "inclusive": shares(inclusive, top), "self": shares(leaf, top)}  # fmt: skip


def tables(title: str, profile: dict[str, Any]) -> list[dict[str, Any]]:
    """By package, then the top functions inclusive and by their own time."""
    if "error" in profile:
        return [table(f"{title}: py-spy", ["error"], [[profile["error"]]])]
    title = f"{title}, py-spy ({profile['samples']} samples)"
    parts = (("innermost frame by package", "package", "by_package"),
             ("top functions, inclusive", "function (file)", "inclusive"),
             ("top functions by own time", "function (file)", "self"))  # fmt: skip
    return [table(f"{title}: {what}", f"{column}|% of samples{{.1f}}",
                  [[e["name"], e["percent"]] for e in profile[key][:15]])
            for what, column, key in parts]  # fmt: skip
