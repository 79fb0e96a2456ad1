"""`python -m bench`: run the benchmarks in bench.BENCHMARKS, print tables, save JSON.

Results, with the machine's facts and the options used, go to bench/results/latest.json.
A missed target is reported, never an error; the exit code is non-zero only when a
benchmark could not run at all.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

from bench import BENCHMARKS, Benchmark, Options
from bench.machine import facts, headline
from bench.report import show

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: Sequence[str] | None) -> tuple[Options, list[str], Path]:
    names = {p.rsplit(".", 1)[-1]: p for p in BENCHMARKS}
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    add = parser.add_argument
    add("--only", choices=list(names), action="append", help="run only this (repeatable)")
    add("--duration", type=float, help="seconds per measured phase (default 10)")
    add("--quick", action="store_true", help="short phases: a smoke test")
    add("--connections", type=int, help="keep-alive connections (default 50)")
    add("--rate", type=float, help="fixed-rate phase, req/s (default 1000)")
    add("--profile", action="store_true", help="py-spy the manager under load (pip install py-spy)")
    add("--no-pin", action="store_true", help="do not pin processes to cores")
    add("--output", type=Path, default=RESULTS / "latest.json", help="JSON file")
    args = parser.parse_args(argv)
    options = Options(quick=args.quick, pin_cpus=not args.no_pin, profile=args.profile)
    if args.quick:
        options = replace(options, duration=2.0, warmup=1.0)
    if args.duration is not None:
        if not 0.1 <= args.duration <= 600:
            parser.error("--duration must be between 0.1 and 600 seconds")
        options = replace(
            options, duration=args.duration, warmup=min(options.warmup, args.duration)
        )
    if args.connections is not None:
        options = replace(options, connections=max(1, args.connections))
    if args.rate is not None:
        options = replace(options, rate=max(1.0, args.rate))
    return (
        options,
        [p for n, p in names.items() if args.only is None or n in args.only],
        args.output,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options, selected, output = parse_args(argv)
    machine = facts(RESULTS.parent.parent)
    print(headline(machine))
    results: dict[str, Any] = {"machine": machine, "options": asdict(options), "benchmarks": {}}
    failed = False
    for path in selected:
        module = cast(Benchmark, importlib.import_module(path))
        print(f"\n== {module.NAME}: {module.DESCRIPTION}", flush=True)
        started = time.monotonic()
        try:
            result = module.run(options)
        except Exception as exc:  # report and go on with the next benchmark
            failed = True
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["elapsed_seconds"] = round(time.monotonic() - started, 1)
        results["benchmarks"][module.NAME] = result
        show(result)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nresults: {output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
