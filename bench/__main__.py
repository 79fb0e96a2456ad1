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
REPO = Path(__file__).resolve().parent.parent


def _load(path: str) -> Benchmark:
    return cast(Benchmark, importlib.import_module(path))


def _name(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def parse_args(argv: Sequence[str] | None) -> tuple[Options, list[str], Path]:
    names = [_name(p) for p in BENCHMARKS]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--only", choices=names, action="append", help="run only this (repeatable)")
    parser.add_argument("--duration", type=float, help="seconds per measured phase (default 10)")
    parser.add_argument("--quick", action="store_true", help="short phases: a smoke test")
    parser.add_argument("--connections", type=int, help="keep-alive connections (default 50)")
    parser.add_argument("--rate", type=float, help="fixed-rate phase, req/s (default 1000)")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the manager under load (pip install py-spy)"
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--output", type=Path, default=RESULTS / "latest.json", help="JSON file")
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
    selected = [p for p in BENCHMARKS if args.only is None or _name(p) in args.only]
    return options, selected, args.output


def main(argv: Sequence[str] | None = None) -> int:
    options, selected, output = parse_args(argv)
    machine = facts(REPO)
    print(headline(machine))
    results: dict[str, Any] = {"machine": machine, "options": asdict(options), "benchmarks": {}}
    failed = False
    for path in selected:
        name = _name(path)
        module = _load(path)
        print(f"\n== {name}: {module.DESCRIPTION}", flush=True)
        started = time.monotonic()
        try:
            result = module.run(options)
        except Exception as exc:  # report and go on with the next benchmark
            failed = True
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["elapsed_seconds"] = round(time.monotonic() - started, 1)
        results["benchmarks"][name] = result
        show(result)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nresults: {output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
