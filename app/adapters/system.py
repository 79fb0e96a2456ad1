"""Node resource readings through psutil (CPU, memory, disk, load)."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil

from app.domain.reports import SystemSample

log = logging.getLogger(__name__)


def sample(disk_path: Path = Path("/")) -> SystemSample:
    """One reading; CPU percent is since the previous call (0.0 on the first)."""
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage(str(disk_path))
    load = os.getloadavg()
    return SystemSample(
        cpu_percent=psutil.cpu_percent(interval=None),
        cpu_count=psutil.cpu_count() or 1,
        load_average=(round(load[0], 2), round(load[1], 2), round(load[2], 2)),
        memory_total_bytes=memory.total,
        memory_used_percent=memory.percent,
        disk_total_bytes=disk.total,
        disk_used_percent=disk.percent,
    )


def fingerprint(disk_path: Path) -> dict[str, Any]:
    """The node's hardware as the registry stores it (blocking: run it in a thread)."""
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage(str(disk_path))
    gpus = _nvidia_gpus()
    return {
        "cpu_count": psutil.cpu_count() or 1,
        "cpu_model": _cpu_model(),
        "arch": platform.machine(),
        "memory_gb": round(memory.total / 2**30, 1),
        "disk_gb": round(disk.total / 2**30, 1),
        "os": _os_name(),
        "kernel": platform.release(),
        "gpu": bool(gpus),
        "gpu_count": len(gpus),
        "gpus": gpus,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.system()


def _nvidia_gpus() -> list[dict[str, Any]]:
    """GPUs from `nvidia-smi` when it is installed; none otherwise (or when it fails)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        result = subprocess.run(
            [binary, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        # installed but failing: the node registers without GPUs, and says why
        log.warning("nvidia-smi is installed but failed; registering no GPUs: %s", exc)
        return []
    gpus = []
    for line in result.stdout.strip().splitlines():
        name, _, memory = line.rpartition(",")
        try:
            gpus.append({"name": name.strip(), "memory_gb": round(float(memory) / 1024, 1)})
        except ValueError:
            log.warning("nvidia-smi printed an unreadable line, skipped: %r", line)
            continue
    return gpus
