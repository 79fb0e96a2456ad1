"""Facts about the machine and the software a run measured, stored with every result."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

PACKAGES = ("fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn", "uvloop", "httptools")


def cpu_model() -> str:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_revision(repo: Path) -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, timeout=10,
                              capture_output=True, text=True, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def facts(repo: Path) -> dict[str, Any]:
    memory, freq = psutil.virtual_memory(), psutil.cpu_freq()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count_logical": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "cpu_mhz": round(freq.current) if freq else None,
        "memory_total_bytes": memory.total,
        "memory_available_bytes": memory.available,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "git_revision": _git_revision(repo),
        "packages": {name: _version(name) for name in PACKAGES},
    }


def headline(machine: dict[str, Any]) -> str:
    return (
        f"{machine['date']}  {machine['cpu_model']}, {machine['cpu_count_logical']} cores, "
        f"{machine['memory_total_bytes'] / 2**30:.1f} GiB, Python {machine['python']}, "
        f"load {machine['load_average_1m']}, git {machine['git_revision']}"
    )
