"""Where a process's CPU goes under load: py-spy samples, by package and by function.

Optional (`python -m bench --profile`): py-spy is not a project dependency (`pip install
py-spy`). It samples without pausing the process but still costs CPU, so it gets a load
phase of its own, never measured. It sees only the running coroutine's frames: read the
shares by innermost frame.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench.report import Json, table

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")
_SITE = re.compile(r"^.*/(?:site|dist)-packages/")
# Frames under every sample (process start-up down to the event loop): not worth listing.
_BOOTSTRAP = ("uvicorn/main.py", "uvicorn/server.py", "uvicorn/_compat.py", "app/__main__.py",
              "app/cli.py")  # fmt: skip


def start(pid: int, seconds: float, output: Path) -> subprocess.Popen[bytes]:
    """Start sampling `pid` for `seconds`; FileNotFoundError when py-spy is not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    if not (exe := str(beside) if beside.exists() else shutil.which("py-spy")):
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate",
         "250", "--format", "raw", "--output", str(output), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def finish(sampler: subprocess.Popen[bytes], output: Path, seconds: float) -> Json:
    """Wait for py-spy (polling: a thread waiting on it would be sampled), then sum up."""
    deadline = time.monotonic() + seconds + 30.0
    while sampler.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    sampler.kill()
    _, stderr = sampler.communicate()
    if sampler.returncode != 0 or not output.exists():
        return {"error": f"py-spy exited with {sampler.returncode}: {stderr.decode()[-500:]}"}
    return {"seconds": round(seconds, 1)} | summarize(output.read_text())


def _where(frame: str) -> tuple[str, str]:
    """(function (file), package) for one py-spy frame; stdlib packages are marked."""
    if (match := _FRAME.match(frame)) is None:
        return frame or "(no Python frame)", frame or "(no Python frame)"
    file = _SITE.sub("", match["file"])
    top = file.lstrip("/").split("/", 1)[0].removesuffix(".py")
    if file.startswith("<"):  # "<frozen runpy>"
        top = file.strip("<>").removeprefix("frozen ")
    stdlib = file.startswith("<") or top in sys.stdlib_module_names
    return f"{match['func']} ({file})", f"{top} (stdlib)" if stdlib else top


def summarize(raw: str) -> Json:
    """Shares of samples by innermost package, by function inclusive and by innermost function."""
    counters: dict[str, Counter[str]] = {k: Counter() for k in ("by_package", "inclusive", "self")}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = [_where(f) for f in stack.split(";")]
            counters["by_package"][frames[-1][1]] += int(count)
            counters["self"][frames[-1][0]] += int(count)
            for function, package in set(frames):
                if "(stdlib)" not in package and not any(f"({b})" in function for b in _BOOTSTRAP):
                    counters["inclusive"][function] += int(count)
    total = counters["by_package"].total()
    return {"samples": total} | {
        key: [{"name": name, "percent": round(100.0 * n / total, 1)}
              for name, n in counter.most_common(12 if key == "by_package" else 25)]
        for key, counter in counters.items()
    }  # fmt: skip


def tables(title: str, profile: Json) -> list[Json]:
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
