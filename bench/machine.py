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


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def facts(repo: Path) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = [x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                         text=True, timeout=10)  # fmt: skip
    memory, freq = psutil.virtual_memory(), psutil.cpu_freq()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_model": model[0] if model else platform.processor() or "unknown",
        "cpu_count_logical": os.cpu_count(), "cpu_count_physical": psutil.cpu_count(False),
        "cpu_mhz": round(freq.current) if freq else None, "memory_total_bytes": memory.total,
        "memory_available_bytes": memory.available,
        "load_average_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "git_revision": git.stdout.strip() or None if git.returncode == 0 else None,
        "packages": {name: _version(name) for name in PACKAGES},
    }  # fmt: skip


def headline(machine: dict[str, Any]) -> str:
    return (
        f"{machine['date']}  {machine['cpu_model']}, {machine['cpu_count_logical']} cores, "
        f"{machine['memory_total_bytes'] / 2**30:.1f} GiB, Python {machine['python']}, "
        f"load {machine['load_average_1m']}, git {machine['git_revision']}"
    )
