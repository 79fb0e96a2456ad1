"""`python -m bench`: run the benchmarks in bench.BENCHMARKS, print tables, save JSON.

Results, with the machine's facts and the options used, go to bench/results/latest.json. A
missed target is reported, never an error; the exit code is non-zero only when a benchmark
could not run at all.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench import BENCHMARKS, Options
from bench.machine import facts, headline
from bench.report import Json, show

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: Sequence[str] | None = None) -> int:
    names = {p.rsplit(".", 1)[-1]: p for p in BENCHMARKS}
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--only", choices=list(names), action="append", help="run only this")
    parser.add_argument("--quick", action="store_true", help="short phases: a smoke test")
    parser.add_argument("--profile", action="store_true", help="py-spy the manager under load")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--output", type=Path, default=RESULTS / "latest.json", help="JSON file")
    args = parser.parse_args(argv)
    options = Options(quick=args.quick, pin_cpus=not args.no_pin, profile=args.profile)
    if args.quick:
        options = Options(2.0, 1.0, True, options.pin_cpus, options.profile)
    machine = facts(RESULTS.parent.parent)
    print(headline(machine))
    results: Json = {"machine": machine, "options": asdict(options), "benchmarks": {}}
    failed = False
    for name, path in names.items():
        if args.only and name not in args.only:
            continue
        module = importlib.import_module(path)
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
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nresults: {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
