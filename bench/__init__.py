"""Benchmarks for the workload manager: `python -m bench` (or `make bench`) runs them all.

A benchmark is a module listed in BENCHMARKS with `NAME`, `DESCRIPTION` and
`run(options) -> dict`, stored as-is in bench/results/latest.json; its "tables", "targets"
and "notes" are printed (bench/report.py).
"""

from __future__ import annotations

from dataclasses import dataclass

BENCHMARKS = (
    "bench.pings",
    "bench.memory",
    "bench.sync",
    "bench.registry",
    "bench.jobs",
    "bench.fleet",
)


@dataclass(frozen=True)
class Options:
    """What the command line says; every benchmark gets the same object."""

    duration: float = 10.0  # seconds per measured phase
    warmup: float = 3.0  # seconds of unmeasured load before the measured phases
    quick: bool = False  # smoke-test mode: short phases, fewer repetitions
    pin_cpus: bool = True  # server on one core, load generator on the other(s)
    profile: bool = False  # sample the manager with py-spy during an extra saturation phase
