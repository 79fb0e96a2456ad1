"""The ping benchmark: `POST /v1/workloads/{name}/health`, manager against a bare-ASGI floor.

Both servers run under uvicorn with the same options, one after the other, each pinned to
one core with the load generator on the other: a warm-up, a saturation phase (wrk, closed
loop, the 50 workloads in turn with their own ping tokens, bench/load/pings.lua), a
fixed-rate phase (oha -q -w --latency-correction: latency from each request's scheduled
send time, one workload since oha sends one set of headers) and RSS idle after start and
after the load. CPU outside both: the machine's busy CPU less the server's and the load
generator's. Also: what importing costs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from app.domain.tokens import ping_token
from bench import Options, proc, sampling, tools
from bench.imports import costs
from bench.report import MIB, Json, mib, mib_over, noisy, percent, say, table
from bench.servers import HOST, REPO, ServerSpec, base_env, manager_spec, running

NAME = "pings"
DESCRIPTION = "POST /v1/workloads/{name}/health: the manager against a bare ASGI floor"
_say = functools.partial(say, NAME)

WRK_SCRIPT = Path(__file__).resolve().parent / "load" / "pings.lua"
WORKLOADS = tuple(f"bench-workload-{i:02d}" for i in range(50))
BODY = '{"status":"healthy","version":"1.2.0"}'
SECRET = "bench-ping-token-secret"  # only ever sent to 127.0.0.1
CONNECTIONS, RATE = 50, 1000.0  # keep-alive connections; the fixed rate, req/s
TARGET_THROUGHPUT_RATIO, TARGET_P99_MS = 0.8, 20.0
NOISY_OUTSIDE_CPU_PERCENT = 15.0  # above this, say the phase ran on a busy machine
# RSS of a fresh interpreter after each statement: what each layer of the stack costs.
RSS_STEPS = (
    ("python, nothing imported", "pass"), ("import uvicorn", "import uvicorn"),
    ("uvicorn + uvloop + httptools protocol",
     "import uvicorn, uvloop, uvicorn.protocols.http.httptools_impl"),
    ("import fastapi", "import fastapi"), ("import app.main", "import app.main"),
    ("app.main.create_app()", "import app.main; app.main.create_app()"),
)  # fmt: skip


def run(options: Options) -> Json:
    cores = sorted(os.sched_getaffinity(0))
    server_cpus = client_cpus = None
    if options.pin_cpus and len(cores) >= 2:
        server_cpus, client_cpus = {cores[0]}, set(cores[1:])
    with tempfile.TemporaryDirectory(prefix="bench-pings-") as tmp:
        workdir = Path(tmp)
        env = base_env(HOST=HOST, EMBEDDED_SERVICES="false", REPORT_ENABLED="false",
                       DATA_DIR=str(workdir / "data"), LOG_LEVEL="WARNING",
                       PING_TOKEN_SECRET=SECRET)  # fmt: skip
        _say("import costs: -X importtime and RSS per import, in fresh interpreters")
        imports = costs("app.main", RSS_STEPS, env=env, cwd=workdir, runs=1 if options.quick else 3)
        floor = ServerSpec("floor", (sys.executable, "-m", "bench.floor_app", "--host", HOST),
                           base_env(), REPO, "/", frozenset({404}))  # fmt: skip
        affinity = os.sched_getaffinity(0)
        try:
            if client_cpus:
                os.sched_setaffinity(0, client_cpus)
            servers = {s.label: _measure(s, options, server_cpus, workdir)
                       for s in (floor, manager_spec(env, workdir))}  # fmt: skip
        finally:
            os.sched_setaffinity(0, affinity)
    wrk = " ".join(tools.version("wrk", "-v").split()[:2])
    setup = {
        "server_cpus": sorted(server_cpus or []) or None,
        "client_cpus": sorted(client_cpus or []) or None,
        "client": f"{wrk} (saturation, one thread), {tools.version('oha', '--version')} (fixed "
        "rate, one workload)",
    }  # fmt: skip
    floor_rps = servers["floor"]["saturation"]["requests_per_second"]
    ratio = servers["manager"]["saturation"]["requests_per_second"] / floor_rps if floor_rps else 0
    fixed = servers["manager"]["fixed_rate"]
    p99 = fixed["latency_ms"]["p99"]
    targets = {
        "throughput_ratio": {"measured": round(ratio, 3), "met": ratio >= TARGET_THROUGHPUT_RATIO,
                             "target": f">= {TARGET_THROUGHPUT_RATIO}x floor"},
        "p99_at_fixed_rate_ms": {"measured": p99, "target": f"< {TARGET_P99_MS:g} ms",
                                 "met": p99 is not None and p99 < TARGET_P99_MS
                                 and fixed["errors"] == fixed["aborted"] == 0},
        "idle_rss_mib": {"measured": round(servers["manager"]["idle"]["rss_bytes"] / MIB, 1),
                         "target": "as low as possible", "met": None},
    }  # fmt: skip
    tables, notes = _tables(servers, imports), _notes(setup, servers, imports)
    return {"setup": setup, "servers": servers, "imports": imports, "targets": targets,
            "tables": tables, "notes": notes}  # fmt: skip


def _measure(spec: ServerSpec, options: Options, cpus: set[int] | None, workdir: Path) -> Json:
    _say(f"{spec.label}: warm-up {options.warmup:g} s, saturation {options.duration:g} s, "
         f"{RATE:g} req/s for {options.duration:g} s")  # fmt: skip
    with running(spec, cpus=cpus, log=workdir / f"{spec.label}.log") as server:
        pid, port, seconds = server.pid, server.port, options.duration

        def memory() -> dict[str, int]:
            time.sleep(1.0)  # quiet before an RSS reading
            return {"rss_bytes": proc.status(pid)["VmRSS"], "uss_bytes": proc.uss(pid)}

        out: Json = {"idle": memory(), "process": {
            "pid": pid, "threads": proc.status(pid)["Threads"],
            "affinity": sorted(os.sched_getaffinity(pid)),
            "loaded": server.loaded_extensions("uvloop", "httptools")}}  # fmt: skip
        out["warmup"] = _closed_loop(port, options.warmup)
        out["saturation"] = _with_cpu(pid, lambda: _closed_loop(port, seconds))
        time.sleep(1.0)
        out["fixed_rate"] = _with_cpu(pid, lambda: _fixed_rate(port, seconds))
        out["after_load"] = memory()
        if options.profile and spec.label == "manager":  # an extra, unmeasured saturation
            _say("manager: profiling under load with py-spy")
            seconds, output = max(2.0, min(options.duration, 10.0)), workdir / "pyspy.txt"
            try:
                sampler = sampling.start(pid, seconds, output)
            except FileNotFoundError as exc:
                out["profile"] = {"error": str(exc)}
            else:
                try:
                    _closed_loop(port, seconds + 1.0)
                finally:
                    out["profile"] = sampling.finish(sampler, output, seconds)
        out["log_tail"] = server.log()
    return out


def _phase(mode: str, ran: tools.Ran, wall: float, completed: int, status_errors: int,
           transport_errors: int, **extra: Any) -> Json:  # fmt: skip
    return {
        "mode": mode, "connections": CONNECTIONS, "wall_seconds": round(wall, 3),
        "completed": completed, "requests_per_second": round(completed / wall, 1),
        "errors": status_errors + transport_errors, "status_errors": status_errors,
        "transport_errors": transport_errors,
        "client_cpu_percent": round(100.0 * ran.cpu_seconds / wall, 1), **extra,
    }  # fmt: skip


def _closed_loop(port: int, seconds: float) -> Json:
    """wrk, one thread: every connection sends again as soon as its response arrives."""
    tokens = [f"{name}={ping_token(SECRET, name)}" for name in WORKLOADS]
    ran = tools.run(
        [tools.find("wrk"), "-t1", f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s",
         "-s", str(WRK_SCRIPT), f"http://{HOST}:{port}", "--", BODY, *tokens],
        timeout=seconds + 60,
    )  # fmt: skip
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    transport = sum(out[k] for k in ("connect", "read", "write", "timeout"))
    latency = {k: round(v / 1000, 3) for k, v in out["latency_us"].items()}
    return _phase("closed-loop (wrk)", ran, out["duration_us"] / 1e6, out["completed"],
                  out["status_errors"], transport, latency_ms=latency)  # fmt: skip


def _fixed_rate(port: int, seconds: float) -> Json:
    """oha at RATE req/s, latency from each request's scheduled send time."""
    name = WORKLOADS[0]
    ran = tools.run(
        [tools.find("oha"), "--no-tui", "--output-format", "json", "-z", f"{seconds:g}s",
         "-w", "-q", f"{RATE:g}", "--latency-correction", "-c", str(CONNECTIONS),
         "-m", "POST", "-H", f"Authorization: Bearer {ping_token(SECRET, name)}",
         "-H", "Content-Type: application/json", "-d", BODY,
         f"http://{HOST}:{port}/v1/workloads/{name}/health"],
        timeout=seconds + 60,
    )  # fmt: skip
    out = json.loads(ran.stdout)
    statuses = {str(k): int(v) for k, v in sorted(out["statusCodeDistribution"].items())}
    failures = {str(k): int(v) for k, v in out["errorDistribution"].items()}
    aborted = failures.pop("aborted due to deadline", 0)
    completed, pct = sum(statuses.values()), out["latencyPercentiles"]
    latency = {k: None if pct.get(k) is None else round(1000 * pct[k], 3)
               for k in ("p50", "p90", "p99", "p99.9")}  # fmt: skip
    latency["max"] = round(1000 * out["summary"]["slowest"], 3)
    return _phase("fixed rate (oha --latency-correction)", ran, out["summary"]["total"],
                  completed, completed - statuses.get("204", 0), sum(failures.values()),
                  statuses=statuses, target_rate=RATE, aborted=aborted,
                  latency_ms=latency)  # fmt: skip


def _with_cpu(pid: int, phase: Callable[[], Json]) -> Json:
    """The phase's summary, with the server's CPU and the CPU spent outside server and client."""
    meter = proc.Meter(server=lambda: proc.cpu_seconds(pid), busy=lambda: proc.machine_busy()[0])
    summary = phase()
    spent, wall = meter.spent(), summary["wall_seconds"]
    outside = spent["busy"] - spent["server"] - summary["client_cpu_percent"] * wall / 100.0
    summary["server_cpu_percent"] = percent(spent["server"], wall)
    summary["outside_cpu_percent"] = percent(max(0.0, outside), wall)
    return summary


def _errors(phase: Mapping[str, Any]) -> str:
    text = f"{phase['status_errors']} / {phase['transport_errors']}"
    text += f" / {phase['aborted']}" if "aborted" in phase else ""
    if set(phase.get("statuses", {})) - {"204"}:
        text += " (" + ", ".join(f"{k}: {v}" for k, v in phase["statuses"].items()) + ")"
    return text


# (label, path in a server's result, format, show manager/floor)
_ROWS: tuple[tuple[str, str, str | Callable[[Any], str], bool], ...] = (
    ("saturation: throughput (req/s)", "saturation.requests_per_second", ",.0f", True),
    ("saturation: latency p50 (ms)", "saturation.latency_ms.p50", ".2f", True),
    ("saturation: latency p99 (ms)", "saturation.latency_ms.p99", ".2f", True),
    ("saturation: latency max (ms)", "saturation.latency_ms.max", ".2f", False),
    ("saturation: errors (HTTP >= 400 / transport)", "saturation", _errors, False),
    ("saturation: server CPU (% of its core)", "saturation.server_cpu_percent", ".0f", False),
    ("saturation: load generator CPU (% of its core)", "saturation.client_cpu_percent", ".0f",
     False),
    ("saturation: CPU outside both (% of a core)", "saturation.outside_cpu_percent", ".0f", False),
    (f"at {RATE:g} req/s: achieved (req/s)", "fixed_rate.requests_per_second", ",.0f", False),
    (f"at {RATE:g} req/s: latency p50 (ms)", "fixed_rate.latency_ms.p50", ".2f", True),
    (f"at {RATE:g} req/s: latency p99 (ms)", "fixed_rate.latency_ms.p99", ".2f", True),
    (f"at {RATE:g} req/s: latency max (ms)", "fixed_rate.latency_ms.max", ".2f", False),
    (f"at {RATE:g} req/s: errors (non-204 / transport / aborted)", "fixed_rate", _errors, False),
    (f"at {RATE:g} req/s: server CPU (% of its core)", "fixed_rate.server_cpu_percent", ".0f",
     False),
    (f"at {RATE:g} req/s: CPU outside both (% of a core)", "fixed_rate.outside_cpu_percent",
     ".0f", False),
    ("RSS, idle after start (MiB)", "idle.rss_bytes", mib, True),
    ("USS, idle after start (MiB)", "idle.uss_bytes", mib, True),
    ("RSS after the load (MiB)", "after_load.rss_bytes", mib, True),
    ("threads", "process.threads", str, False),
)  # fmt: skip


def _tables(servers: Mapping[str, Any], imports: Mapping[str, Any]) -> list[Json]:
    floor, manager = servers["floor"], servers["manager"]
    rows = []
    for label, path, fmt, ratio in _ROWS:
        f, m = (functools.reduce(lambda d, k: d[k], path.split("."), s) for s in (floor, manager))
        shown = [fmt(v) if callable(fmt) else format(v, fmt) if v is not None else "-"
                 for v in (f, m)]  # fmt: skip
        rows.append([label, *shown, f"{m / f:.2f}x" if ratio and m is not None and f else ""])
    bare = imports["rss_steps"][0]["rss_bytes"]
    alone = {a["package"]: a["rss_bytes"] for a in imports["rss_package_alone"]}
    steps = [(s["label"], s["rss_bytes"]) for s in imports["rss_steps"]] + [
        ("floor server, idle after start", floor["idle"]["rss_bytes"]),
        ("manager server, idle after start", manager["idle"]["rss_bytes"])]  # fmt: skip
    return [
        table("pings: POST /v1/workloads/{name}/health, floor (bare ASGI) vs manager",
              "metric|floor|manager|mgr/floor", rows),
        table(f"import app.main: {imports['total_ms']:.0f} ms, {imports['modules']} modules; "
              "top 10 modules by cumulative time",
              "module|cumulative ms{.1f}|self ms{.1f}|imported by",
              [["  " * e["depth"] + e["module"], e["cumulative_ms"], e["self_ms"], e["parent"]]
               for e in imports["top_modules"]]),
        table("third-party packages that import app.main pulls in, by cumulative time",
              "package|cumulative ms{.1f}|own ms{.1f}|modules|first imported by|RSS alone, MiB "
              "over bare python",
              [[p["package"], p["cumulative_ms"], p["self_ms"], p["modules"], p["via"],
                mib_over(alone[p["package"]], bare)] for p in imports["top_packages"]]),
        table("RSS: a fresh interpreter after each step, and the servers",
              "step|RSS MiB|MiB over bare python",
              [[label, mib(value), mib_over(value, bare)] for label, value in steps]),
        *(sampling.tables("manager under saturation", manager["profile"])
          if "profile" in manager else []),
    ]  # fmt: skip


def _notes(setup: Json, servers: Mapping[str, Any], imports: Mapping[str, Any]) -> list[str]:
    fs, stacks = servers["floor"]["saturation"], []
    for label, s in servers.items():
        stacks.append(f"{label} {'+'.join(k for k, v in s['process']['loaded'].items() if v)}")
    pinning = (f"each server on core {setup['server_cpus']}, load generator on "
               f"{setup['client_cpus']}" if setup["server_cpus"] else "off")  # fmt: skip
    if fs["client_cpu_percent"] >= 90:
        verdict = "the load generator is the bottleneck: read the floor's numbers as a lower bound"
    elif fs["server_cpu_percent"] >= 90:
        verdict = "the server, not the load generator, is the bottleneck"
    else:
        verdict = "neither was saturated: other work on the machine, or too few connections"
    uvicorn, idle = imports["rss_steps"][1]["rss_bytes"], servers["manager"]["idle"]["rss_bytes"]
    return [
        f"{len(WORKLOADS)} workloads, {CONNECTIONS} connections; clients: {setup['client']}; "
        f"loaded: {', '.join(stacks)} (none: asyncio+h11); CPU pinning: {pinning}.",
        f"load generator: {fs['client_cpu_percent']:.0f}% of its core while the floor served "
        f"{fs['requests_per_second']:,.0f} req/s at {fs['server_cpu_percent']:.0f}% of its "
        f"own: {verdict}.",
        f"idle RSS: manager {mib(idle)} MiB, {mib_over(idle, uvicorn)} MiB over a bare "
        f"`python -c 'import uvicorn'` ({mib(uvicorn)} MiB).",
        *noisy({f"{label} {phase}": servers[label][phase]["outside_cpu_percent"]
                for label in servers for phase in ("saturation", "fixed_rate")},
               NOISY_OUTSIDE_CPU_PERCENT),
    ]  # fmt: skip
