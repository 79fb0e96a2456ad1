"""Facts about the machine and the software a run measured, stored with every result.

CPU model, cores, memory, load, Python, the HTTP stack's package versions and the git revision.
"""

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
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_revision(repo: Path) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def facts(repo: Path) -> dict[str, Any]:
    memory = psutil.virtual_memory()
    freq = psutil.cpu_freq()
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
