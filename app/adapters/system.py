"""Node resource readings through psutil (CPU, memory, disk, load)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from app.domain.reports import SystemSample


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


def process_rss_bytes() -> int:
    rss: int = psutil.Process().memory_info().rss
    return rss
