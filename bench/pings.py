"""The ping benchmark: `POST /v1/workloads/{name}/health`, manager against a bare-ASGI floor.

Both servers run as child processes under uvicorn with the same options, one after the
other, each pinned to one core with the load generator on the other. Each gets a warm-up,
a saturation phase (wrk: keep-alive connections, closed loop, the 50 workloads in turn
with their own ping tokens, bench/load/pings.lua), a fixed-rate phase (oha -q with
--latency-correction: latency from each request's scheduled send time) and RSS readings
when idle after start and after the load. Also: what importing costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from app.domain.tokens import ping_token
from bench import Options, proc, sampling, tools
from bench.imports import ImportEntry, importtime, package_costs, rss_after, top_modules
from bench.report import MIB, mib, mib_over, percent, say, table, yes
from bench.servers import HOST, ServerProcess, ServerSpec, free_port, running

NAME = "pings"
DESCRIPTION = "POST /v1/workloads/{name}/health: the manager against a bare ASGI floor"


def _say(message: str) -> None:
    say(NAME, message)


REPO = Path(__file__).resolve().parent.parent
WRK_SCRIPT = Path(__file__).resolve().parent / "load" / "pings.lua"
WORKLOADS = tuple(f"bench-workload-{i:02d}" for i in range(50))
BODY = b'{"status":"healthy","version":"1.2.0"}'
PING_TOKEN_SECRET = "bench-ping-token-secret"  # only ever sent to 127.0.0.1
SETTLE_SECONDS = 1.0  # quiet time before an RSS reading
TARGET_THROUGHPUT_RATIO = 0.8
TARGET_P99_MS = 20.0
NOISY_OUTSIDE_CPU_PERCENT = 15.0  # above this, say the phase ran on a busy machine
TOOL_TIMEOUT = 60.0  # seconds a load tool may run past its phase

# RSS of a fresh interpreter after each statement: what each layer of the stack costs.
RSS_STEPS: tuple[tuple[str, str], ...] = (
    ("python, nothing imported", "pass"),
    ("import uvicorn", "import uvicorn"),
    (
        "uvicorn + uvloop + httptools protocol",
        "import uvicorn, uvloop, uvicorn.protocols.http.httptools_impl",
    ),
    ("import fastapi", "import fastapi"),
    ("import app.main", "import app.main"),
    ("app.main.create_app()", "import app.main; app.main.create_app()"),
)


def run(options: Options) -> dict[str, Any]:
    available = sorted(os.sched_getaffinity(0))
    server_cpus: set[int] | None = None
    client_cpus: set[int] | None = None
    if options.pin_cpus and len(available) >= 2:
        server_cpus, client_cpus = {available[0]}, set(available[1:])
    with tempfile.TemporaryDirectory(prefix="bench-pings-") as tmp:
        workdir = Path(tmp)
        (workdir / "data").mkdir()
        env = _manager_env(workdir)
        imports = _import_costs(env, workdir, runs=1 if options.quick else 3)
        original_affinity = os.sched_getaffinity(0)
        try:
            if client_cpus:
                os.sched_setaffinity(0, client_cpus)
            servers = {
                "floor": _measure(_floor_spec, options, server_cpus, workdir),
                "manager": _measure(
                    lambda port: _manager_spec(port, env, workdir),
                    options,
                    server_cpus,
                    workdir,
                    with_profile=options.profile,
                ),
            }
        finally:
            os.sched_setaffinity(0, original_affinity)
    setup = {
        "workloads": len(WORKLOADS),
        "body": BODY.decode(),
        "auth": "bearer ping token per workload (PING_TOKEN_SECRET set on the manager)",
        "connections": options.connections,
        "duration_seconds": options.duration,
        "warmup_seconds": options.warmup,
        "fixed_rate": options.rate,
        "server_cpus": sorted(server_cpus) if server_cpus else None,
        "client_cpus": sorted(client_cpus) if client_cpus else None,
        "client": f"{_short(tools.version('wrk', '-v'))} (saturation, one thread), "
        f"{tools.version('oha', '--version')} (fixed rate, one workload: oha sends one set of "
        "headers and the ping token is per workload)",
        "server_options": "uvicorn.run(app, log_config=None, access_log=False, "
        "server_header=False, timeout_graceful_shutdown=20), loop/http 'auto', one process",
    }
    result: dict[str, Any] = {"setup": setup, "servers": servers, "imports": imports}
    result["targets"] = _targets(servers)
    result["tables"] = _tables(servers, imports, result["targets"], options)
    result["notes"] = _notes(setup, servers, imports)
    return result


# --- servers -----------------------------------------------------------------------------


def _base_env() -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"}
    if "HOME" in os.environ:
        env["HOME"] = os.environ["HOME"]
    return env


def _manager_env(workdir: Path) -> dict[str, str]:
    return _base_env() | {
        "HOST": HOST,
        "EMBEDDED_SERVICES": "false",
        "REPORT_ENABLED": "false",
        "DATA_DIR": str(workdir / "data"),
        "LOG_LEVEL": "WARNING",
        "PING_TOKEN_SECRET": PING_TOKEN_SECRET,
    }


def _manager_spec(port: int, env: Mapping[str, str], workdir: Path) -> ServerSpec:
    return ServerSpec(
        label="manager",
        argv=(sys.executable, "-m", "app", "serve"),
        env={**env, "PORT": str(port)},
        cwd=workdir,  # not the repo: a developer's .env must not change what is measured
        ready_path="/readyz",
    )


def _floor_spec(port: int) -> ServerSpec:
    return ServerSpec(
        label="floor",
        argv=(sys.executable, "-m", "bench.floor_app", "--host", HOST, "--port", str(port)),
        env=_base_env(),
        cwd=REPO,
        ready_path="/",
        ready_statuses=frozenset({404}),
    )


def _token_args() -> list[str]:
    """NAME=TOKEN for every workload: what bench/load/pings.lua sends."""
    return [f"{name}={ping_token(PING_TOKEN_SECRET, name)}" for name in WORKLOADS]


def _seconds(value: float) -> str:
    return f"{max(1, round(value))}s"  # wrk takes whole seconds


def _short(version: str) -> str:
    return " ".join(version.split()[:2])


def _closed_loop(port: int, connections: int, seconds: float) -> dict[str, Any]:
    """wrk, one thread: every connection sends again as soon as its response arrives."""
    ran = tools.run(
        [tools.find("wrk"), "-t1", f"-c{connections}", f"-d{_seconds(seconds)}",
         "-s", str(WRK_SCRIPT), f"http://{HOST}:{port}", "--", BODY.decode(), *_token_args()],
        timeout=seconds + TOOL_TIMEOUT,
    )  # fmt: skip
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    wall = out["duration_us"] / 1e6
    transport = sum(out[k] for k in ("connect", "read", "write", "timeout"))
    return {
        "mode": "closed-loop (wrk)",
        "connections": connections,
        "wall_seconds": round(wall, 3),
        "completed": out["completed"],
        "requests_per_second": round(out["completed"] / wall, 1),
        "errors": out["status_errors"] + transport,
        "status_errors": out["status_errors"],
        "transport_errors": transport,
        "client_cpu_percent": round(100.0 * ran.cpu_seconds / wall, 1),
        "latency_ms": {k: round(v / 1000, 3) for k, v in out["latency_us"].items()},
    }


def _fixed_rate(port: int, connections: int, rate: float, seconds: float) -> dict[str, Any]:
    """oha at `rate` req/s, latency from each request's scheduled send time."""
    name = WORKLOADS[0]
    ran = tools.run(
        [tools.find("oha"), "--no-tui", "--output-format", "json", "-z", f"{seconds:g}s",
         "-w", "-q", f"{rate:g}", "--latency-correction", "-c", str(connections),
         "-m", "POST", "-H", f"Authorization: Bearer {ping_token(PING_TOKEN_SECRET, name)}",
         "-H", "Content-Type: application/json", "-d", BODY.decode(),
         f"http://{HOST}:{port}/v1/workloads/{name}/health"],
        timeout=seconds + TOOL_TIMEOUT,
    )  # fmt: skip
    out = json.loads(ran.stdout)
    wall = out["summary"]["total"]
    statuses = {str(k): int(v) for k, v in sorted(out["statusCodeDistribution"].items())}
    failures = {str(k): int(v) for k, v in out["errorDistribution"].items()}
    aborted = failures.pop("aborted due to deadline", 0)
    completed = sum(statuses.values())
    status_errors = completed - statuses.get("204", 0)
    pct = out["latencyPercentiles"]
    return {
        "mode": "fixed rate (oha --latency-correction)",
        "connections": connections,
        "wall_seconds": round(wall, 3),
        "completed": completed,
        "requests_per_second": round(completed / wall, 1),
        "errors": status_errors + sum(failures.values()),
        "status_errors": status_errors,
        "transport_errors": sum(failures.values()),
        "statuses": statuses,
        "client_cpu_percent": round(100.0 * ran.cpu_seconds / wall, 1),
        "latency_ms": {
            k: None if pct.get(k) is None else round(1000 * pct[k], 3)
            for k in ("p50", "p90", "p99", "p99.9")
        }
        | {"max": round(1000 * out["summary"]["slowest"], 3)},
        "target_rate": rate,
        "aborted": aborted,
    }


def _measure(
    spec_for: Callable[[int], ServerSpec],
    options: Options,
    cpus: set[int] | None,
    workdir: Path,
    *,
    with_profile: bool = False,
) -> dict[str, Any]:
    port = free_port()
    spec: ServerSpec = spec_for(port)
    _say(f"{spec.label}: starting on port {port}")
    with running(spec, port=port, cpus=cpus, log=workdir / f"{spec.label}.log") as server:
        time.sleep(SETTLE_SECONDS)
        idle = _memory(server.pid)
        info = {
            "pid": server.pid,
            "threads": proc.status(server.pid)["Threads"],
            "affinity": sorted(os.sched_getaffinity(server.pid)),
            "loaded": server.loaded_extensions("uvloop", "httptools"),
        }
        phases = _drive(server, options)
        time.sleep(SETTLE_SECONDS)
        after = _memory(server.pid)
        if with_profile:
            _say(f"{spec.label}: profiling under load with py-spy")
            phases["profile"] = _profile(server, options, workdir)
        log_tail = server.log()
    return {"process": info, "idle": idle, "after_load": after, **phases, "log_tail": log_tail}


def _memory(pid: int) -> dict[str, int]:
    return {"rss_bytes": proc.status(pid)["VmRSS"], "uss_bytes": proc.uss(pid)}


def _profile(server: ServerProcess, options: Options, workdir: Path) -> dict[str, Any]:
    """An extra, unmeasured saturation phase with py-spy sampling the server."""
    seconds = max(2.0, min(options.duration, 10.0))
    output = workdir / f"{server.spec.label}.pyspy.txt"
    try:
        sampler = sampling.start(server.pid, seconds, output)
    except FileNotFoundError as exc:
        return {"error": str(exc)}
    try:
        _closed_loop(server.port, options.connections, seconds + 1.0)
    finally:
        try:
            _, stderr = sampler.communicate(timeout=seconds + 30.0)
        except subprocess.TimeoutExpired:
            sampler.kill()
            _, stderr = sampler.communicate()
    if sampler.returncode != 0 or not output.exists():
        return {"error": f"py-spy exited with {sampler.returncode}: {stderr.decode()[-500:]}"}
    return sampling.summarize(output.read_text())


def _drive(server: ServerProcess, options: Options) -> dict[str, Any]:
    label, port, conns = server.spec.label, server.port, options.connections
    _say(f"{label}: warm-up {options.warmup:g} s, saturation {options.duration:g} s, "
         f"{options.rate:g} req/s for {options.duration:g} s")  # fmt: skip
    warm = _closed_loop(port, conns, options.warmup)
    saturation = _with_server_cpu(server, lambda: _closed_loop(port, conns, options.duration))
    time.sleep(SETTLE_SECONDS)
    fixed = _with_server_cpu(
        server, lambda: _fixed_rate(port, conns, options.rate, options.duration)
    )
    return {"warmup": warm, "saturation": saturation, "fixed_rate": fixed}


def _with_server_cpu(server: ServerProcess, phase: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The phase's summary, with the server's CPU and the CPU spent outside server and client."""
    cpu0, (busy0, _) = proc.cpu_seconds(server.pid), proc.machine_busy()
    summary = phase()
    cpu1, (busy1, _) = proc.cpu_seconds(server.pid), proc.machine_busy()
    wall = summary["wall_seconds"]
    summary["server_cpu_percent"] = percent(cpu1 - cpu0, wall)
    client = summary["client_cpu_percent"] * wall / 100.0
    summary["outside_cpu_percent"] = percent(
        max(0.0, (busy1 - busy0) - (cpu1 - cpu0) - client), wall
    )
    return summary


# --- imports -----------------------------------------------------------------------------


def _import_costs(env: Mapping[str, str], workdir: Path, runs: int) -> dict[str, Any]:
    _say("import costs: -X importtime and RSS per import, in fresh interpreters")
    entries = importtime("app.main", env=env, cwd=workdir, runs=runs)
    stdlib = sys.stdlib_module_names
    packages = [p for p in package_costs(entries) if p.package not in stdlib | {"app"}]
    rss = [
        {
            "label": label,
            "statement": statement,
            "rss_bytes": rss_after(statement, env=env, cwd=workdir),
        }
        for label, statement in RSS_STEPS
    ]
    alone = [
        {"package": p.package, "rss_bytes": rss_after(f"import {p.package}", env=env, cwd=workdir)}
        for p in packages[:12]
    ]
    return {
        "total_ms": round(sum(e.self_us for e in entries) / 1000, 1),
        "modules": len(entries),
        "top_modules": [_entry(e) for e in top_modules(entries, 10)],
        "top_packages": [
            {
                "package": p.package,
                "cumulative_ms": round(p.cumulative_us / 1000, 1),
                "self_ms": round(p.self_us / 1000, 1),
                "modules": p.modules,
                "via": p.via,
            }
            for p in packages[:12]
        ],
        "rss_steps": rss,
        "rss_package_alone": alone,
    }


def _entry(entry: ImportEntry) -> dict[str, Any]:
    return {
        "module": entry.name,
        "cumulative_ms": round(entry.cumulative_us / 1000, 1),
        "self_ms": round(entry.self_us / 1000, 1),
        "depth": entry.depth,
        "parent": entry.parent,
    }


# --- report ------------------------------------------------------------------------------


def _targets(servers: Mapping[str, Any]) -> dict[str, Any]:
    floor, manager = servers["floor"], servers["manager"]
    floor_rps = floor["saturation"]["requests_per_second"]
    ratio = manager["saturation"]["requests_per_second"] / floor_rps if floor_rps else 0.0
    fixed = manager["fixed_rate"]
    p99 = fixed["latency_ms"]["p99"]
    return {
        "throughput_ratio": {
            "measured": round(ratio, 3),
            "target": f">= {TARGET_THROUGHPUT_RATIO}x floor",
            "met": ratio >= TARGET_THROUGHPUT_RATIO,
        },
        "p99_at_fixed_rate_ms": {
            "measured": p99,
            "target": f"< {TARGET_P99_MS:g} ms",
            "met": p99 is not None
            and p99 < TARGET_P99_MS
            and fixed["errors"] == 0
            and fixed["aborted"] == 0,
        },
        "idle_rss_mib": {
            "measured": round(manager["idle"]["rss_bytes"] / MIB, 1),
            "target": "as low as possible",
            "met": None,
        },
    }


def _get(data: Mapping[str, Any], path: str) -> Any:
    for key in path.split("."):
        data = data[key]
    return data


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _rate(value: float) -> str:
    return f"{value:,.0f}"


def _pct(value: float) -> str:
    return f"{value:.0f}"


def _errors(phase: Mapping[str, Any]) -> str:
    text = f"{phase['status_errors']} / {phase['transport_errors']}"
    if "aborted" in phase:
        text += f" / {phase['aborted']}"
    if set(phase.get("statuses", {})) - {"204"}:
        text += " (" + ", ".join(f"{k}: {v}" for k, v in phase["statuses"].items()) + ")"
    return text


# (label, path in a server's result, format, show manager/floor, key in targets)
_MAIN_ROWS: tuple[tuple[str, str, Callable[[Any], str], bool, str | None], ...] = (
    ("saturation: throughput (req/s)", "saturation.requests_per_second", _rate, True,
     "throughput_ratio"),
    ("saturation: latency p50 (ms)", "saturation.latency_ms.p50", _ms, True, None),
    ("saturation: latency p99 (ms)", "saturation.latency_ms.p99", _ms, True, None),
    ("saturation: latency max (ms)", "saturation.latency_ms.max", _ms, False, None),
    ("saturation: errors (HTTP >= 400 / transport)", "saturation", _errors, False, None),
    ("saturation: server CPU (% of its core)", "saturation.server_cpu_percent", _pct, False, None),
    ("saturation: load generator CPU (% of its core)", "saturation.client_cpu_percent", _pct,
     False, None),
    ("saturation: CPU outside both (% of a core)", "saturation.outside_cpu_percent", _pct, False,
     None),
    ("{rate}: achieved (req/s)", "fixed_rate.requests_per_second", _rate, False, None),
    ("{rate}: latency p50 (ms)", "fixed_rate.latency_ms.p50", _ms, True, None),
    ("{rate}: latency p99 (ms)", "fixed_rate.latency_ms.p99", _ms, True, "p99_at_fixed_rate_ms"),
    ("{rate}: latency max (ms)", "fixed_rate.latency_ms.max", _ms, False, None),
    ("{rate}: errors (non-204 / transport / aborted)", "fixed_rate", _errors, False, None),
    ("{rate}: server CPU (% of its core)", "fixed_rate.server_cpu_percent", _pct, False, None),
    ("{rate}: CPU outside both (% of a core)", "fixed_rate.outside_cpu_percent", _pct, False,
     None),
    ("RSS, idle after start (MiB)", "idle.rss_bytes", mib, True, "idle_rss_mib"),
    ("USS, idle after start (MiB)", "idle.uss_bytes", mib, True, None),
    ("RSS after the load (MiB)", "after_load.rss_bytes", mib, True, None),
    ("threads", "process.threads", str, False, None),
)  # fmt: skip


def _tables(
    servers: Mapping[str, Any],
    imports: Mapping[str, Any],
    targets: Mapping[str, Any],
    options: Options,
) -> list[dict[str, Any]]:
    floor, manager = servers["floor"], servers["manager"]
    rows = []
    for label, path, fmt, ratio, target_key in _MAIN_ROWS:
        f, m = _get(floor, path), _get(manager, path)
        target = targets[target_key] if target_key else None
        rows.append(
            [
                label.format(rate=f"at {options.rate:g} req/s"),
                fmt(f),
                fmt(m),
                f"{m / f:.2f}x" if ratio and m is not None and f else "",
                target["target"] if target else "",
                yes(target["met"]) if target else "",
            ]
        )
    tables = [
        table("pings: POST /v1/workloads/{name}/health, floor (bare ASGI) vs manager",
              "metric|floor|manager|mgr/floor|target|met", rows)
    ]  # fmt: skip
    tables += _import_tables(imports, floor, manager)
    if "profile" in manager:
        tables += _profile_tables(manager["profile"])
    return tables


def _import_tables(
    imports: Mapping[str, Any], floor: Mapping[str, Any], manager: Mapping[str, Any]
) -> list[dict[str, Any]]:
    bare = imports["rss_steps"][0]["rss_bytes"]
    alone = {a["package"]: a["rss_bytes"] for a in imports["rss_package_alone"]}
    steps = [(s["label"], s["rss_bytes"]) for s in imports["rss_steps"]] + [
        ("floor server, idle after start", floor["idle"]["rss_bytes"]),
        ("manager server, idle after start", manager["idle"]["rss_bytes"]),
    ]
    return [
        table(f"import app.main: {imports['total_ms']:.0f} ms, {imports['modules']} modules; "
              "top 10 modules by cumulative time", "module|cumulative ms|self ms|imported by",
              [["  " * e["depth"] + e["module"], f"{e['cumulative_ms']:.1f}",
                f"{e['self_ms']:.1f}", e["parent"] or "-"] for e in imports["top_modules"]]),
        table("third-party packages that import app.main pulls in, by cumulative time",
              "package|cumulative ms|own ms|modules|first imported by|RSS alone, MiB over "
              "bare python",
              [[p["package"], f"{p['cumulative_ms']:.1f}", f"{p['self_ms']:.1f}", p["modules"],
                p["via"] or "-", mib_over(alone[p["package"]], bare) if p["package"] in alone
                else ""] for p in imports["top_packages"]]),
        table("RSS: a fresh interpreter after each step, and the servers",
              "step|RSS MiB|MiB over bare python",
              [[label, mib(value), mib_over(value, bare)] for label, value in steps]),
    ]  # fmt: skip


def _profile_tables(profile: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "error" in profile:
        return [table("manager profile", ["error"], [[profile["error"]]])]
    title = f"manager under saturation, py-spy ({profile['samples']} samples)"
    return [
        table(f"{title}: share of samples by innermost frame's package", "package|%",
              [[p["name"], f"{p['percent']:.1f}"] for p in profile["by_package"]]),
        table(f"{title}: top functions by own time (innermost frame)", "function (file)|%",
              [[p["name"], f"{p['percent']:.1f}"] for p in profile["self"][:15]]),
    ]  # fmt: skip


def _notes(
    setup: Mapping[str, Any], servers: Mapping[str, Any], imports: Mapping[str, Any]
) -> list[str]:
    floor, manager, fs = servers["floor"], servers["manager"], servers["floor"]["saturation"]
    stacks = ", ".join(f"{label} {_stack(s)}" for label, s in servers.items())
    pinning = (
        f"each server on core {setup['server_cpus']}, load generator on {setup['client_cpus']}"
        if setup["server_cpus"] else "off; the servers and the load generator share every core"
    )  # fmt: skip
    if fs["client_cpu_percent"] >= 90:
        verdict = "the load generator is the bottleneck: read the floor's numbers as a lower bound"
    elif fs["server_cpu_percent"] >= 90:
        verdict = "the server, not the load generator, is the bottleneck"
    else:
        verdict = "neither was saturated: other work on the machine, or too few connections"
    uvicorn = next(s["rss_bytes"] for s in imports["rss_steps"] if s["label"] == "import uvicorn")
    idle = manager["idle"]["rss_bytes"]
    notes = [
        f"{setup['workloads']} workloads, body {setup['body']}, {setup['auth']}; "
        f"{setup['connections']} keep-alive connections; {setup['duration_seconds']:g} s per "
        f"measured phase after {setup['warmup_seconds']:g} s of warm-up; servers: "
        f"{setup['server_options']}; seen loaded: {stacks}; CPU pinning: {pinning}.",
        f"load generator capacity ({setup['client']}): {fs['client_cpu_percent']:.0f}% of its "
        f"core while the floor served {fs['requests_per_second']:,.0f} req/s at "
        f"{fs['server_cpu_percent']:.0f}% of its own: {verdict}.",
        "fixed rate: oha -q with --latency-correction (latency from each request's scheduled "
        "send time), in-flight requests waited for (-w). CPU outside both = the machine's "
        "busy CPU minus the server's and the load generator's (/proc): softirq and noise.",
        f"idle RSS: manager {mib(idle)} MiB, {mib_over(idle, uvicorn)} MiB over a bare "
        f"`python -c 'import uvicorn'` ({mib(uvicorn)} MiB); the floor "
        f"{mib(floor['idle']['rss_bytes'])} MiB.",
    ]
    noisy = [
        f"{label} {phase} {servers[label][phase]['outside_cpu_percent']:.0f}%"
        for label in ("floor", "manager")
        for phase in ("saturation", "fixed_rate")
        if servers[label][phase]["outside_cpu_percent"] > NOISY_OUTSIDE_CPU_PERCENT
    ]
    if noisy:
        notes.append("NOISY RUN: other work used the machine during " + ", ".join(noisy)
                     + " (CPU outside both, % of a core): rerun on a quiet machine.")  # fmt: skip
    if "profile" in manager:
        notes.append("py-spy sees only the running coroutine's frames: shares by innermost frame.")
    return notes


def _stack(server: Mapping[str, Any]) -> str:
    loaded = [name for name, present in server["process"]["loaded"].items() if present]
    return "+".join(loaded) or "asyncio+h11"
