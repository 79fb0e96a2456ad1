"""The registry benchmark: 10,000 simulated nodes heartbeating every 30 s against one PostgreSQL.

Registers the nodes through AsyncpgRegistry.upsert, then measures the sustained heartbeat
rate (closed loop) and the real load paced at nodes / 30 s (open loop) with pgbench,
running the adapter's own heartbeat statement (registry._HEARTBEAT, prepared), and the
latency of eligible() ("live nodes that can run X"), idle and under that paced load. All
of it runs twice: on EmbeddedPostgres as it starts (fsync=off) and on a second server with
fsync=on.

Two parts still go through the manager's own code, because that path is what they
measure: registration (AsyncpgRegistry.upsert, which also writes the fleet the rest reads)
and the queries (AsyncpgRegistry.eligible() and nodes() end to end: the wire, asyncpg's
decoding and the NodeProfile built per row, next to PostgreSQL's own execution time).
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from app.adapters import registry as registry_sql
from app.adapters.embedded import EmbeddedError, EmbeddedPostgres
from app.adapters.registry import AsyncpgRegistry, RegistryUnavailable
from app.domain.requirements import (
    HardwareRequirements,
    NodeProfile,
    Requirements,
    Tier,
    match_requirements,
)
from app.services import migrating
from bench import Options, proc
from bench.report import latency_ms, mib, num, percent, say, table

NAME = "registry"
DESCRIPTION = "capability registry on PostgreSQL: heartbeat rate and eligible-node query latency"


def _say(message: str) -> None:
    say(NAME, message)


REPO = Path(__file__).resolve().parent.parent
MIGRATIONS = REPO / "migrations"
NODES = 10_000
QUICK_NODES = 1_000
INTERVAL_SECONDS = 30  # every node heartbeats this often: the load to carry is NODES / 30 per s
SEED = 20_250_611
CONNECTIONS = (8, 32)  # closed-loop heartbeat phases
PGBENCH_THREADS = 2
PACED_SIGMAS = 4  # pgbench -R draws Poisson arrivals: the count may fall this many sigma short
REGISTER_CONNECTIONS = 8
REGISTER = "register (upsert)"
QUERY_REPEATS = 200
QUICK_QUERY_REPEATS = 30
QUICK_DURATION = 2.0
TIMEOUT = 5.0  # the manager's default DATABASE_TIMEOUT_SECONDS
SETUP_TIMEOUT = 60.0
EXPLAIN_RUNS = 5
EXPLAIN_LINES = 16
NOISY_OTHER_CPU_PERCENT = 15.0  # above this, say the phase ran on a busy machine

REGIONS = ("eu-west", "eu-central", "us-east", "us-west", "ap-south", None)
REGION_WEIGHTS = (30, 15, 25, 15, 10, 5)
ZONES = ("z1", "z2", "z3", None)
ZONE_WEIGHTS = (40, 30, 20, 10)
TIERS = (Tier.A, Tier.B, Tier.C)
TIER_WEIGHTS = (20, 50, 30)
CAPABILITIES = ("embeddings", "inference", "scraping", "transcoding", "training", "ocr", "storage")
CAPABILITY_ODDS = (0.45, 0.35, 0.3, 0.15, 0.1, 0.2, 0.25)


@dataclass(frozen=True)
class Query:
    label: str
    requirements: Requirements


QUERIES: tuple[Query, ...] = (
    Query("none", Requirements()),
    Query("tier A", Requirements(tier=[Tier.A])),
    Query(
        "tier A + eu-west + embeddings",
        Requirements(tier=[Tier.A], region="eu-west", capabilities=["embeddings"]),
    ),
    Query(
        "gpu + >= 64 GB",
        Requirements(hardware=HardwareRequirements(gpu=True, min_memory_gb=64)),
    ),
    Query(
        "zone z1 + embeddings,inference",
        Requirements(trust_zone="z1", capabilities=["embeddings", "inference"]),
    ),
)
EXPLAINED = QUERIES[-1]  # the one that can use the GIN index on capabilities
NODES_QUERY = "nodes(liveness=online)"
LOAD_COLUMNS = (
    "server|phase|conns|ops|ops/s|x req|worst 1 s|p50 ms|p99 ms|max ms|errors|"
    "client CPU%|server CPU%|other CPU%"
)
QUERY_COLUMNS = "server|load|requirements|rows|p50 ms|p99 ms|max ms|server ms|scans"


def run(options: Options) -> dict[str, Any]:
    count = QUICK_NODES if options.quick else NODES
    duration = min(options.duration, QUICK_DURATION) if options.quick else options.duration
    repeats = QUICK_QUERY_REPEATS if options.quick else QUERY_REPEATS
    profiles = make_profiles(count, SEED)
    setup: dict[str, Any] = {
        "nodes": count,
        "heartbeat_interval_seconds": INTERVAL_SECONDS,
        "required_heartbeats_per_second": round(count / INTERVAL_SECONDS, 1),
        "closed_loop_connections": list(CONNECTIONS),
        "register_connections": REGISTER_CONNECTIONS,
        "duration_seconds": duration,
        "warmup_seconds": options.warmup,
        "query_repeats": repeats,
        "seed": SEED,
        "statement_timeout_seconds": TIMEOUT,
        "client": f"{_pgbench_version()} (heartbeats, -M prepared, {PGBENCH_THREADS} threads); "
        f"asyncpg on the asyncio event loop, Python {sys.version.split()[0]} (register, queries)",
        "cpu_pinning": "none: client and server share every core",
    }
    servers: dict[str, dict[str, Any]] = {}
    raw: dict[str, tuple[list[Phase], list[QueryResult]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp:
        setup["data_filesystem"] = _filesystem(Path(tmp))
        setup["fsync_8k"] = test_fsync(Path(tmp), 1 if options.quick else 2)
        for label, server_class in (("fsync=off", EmbeddedPostgres), ("fsync=on", FsyncOnPostgres)):
            _say(f"{label}: starting PostgreSQL")
            server = server_class(data_dir=Path(tmp) / label.replace("=", "-"))
            server.start()
            try:
                assert server.pid is not None
                measured, phases, queries = asyncio.run(
                    _measure(
                        server.url,
                        server.pid,
                        profiles,
                        options,
                        duration,
                        repeats,
                        label,
                        Path(tmp),
                    )
                )
            finally:
                server.stop()
            servers[label] = measured
            raw[label] = (phases, queries)
    failures = [f"{label}: {f}" for label, s in servers.items() for f in s["failures"]]
    result: dict[str, Any] = {"setup": setup, "servers": servers, "failures": failures}
    result["tables"] = _tables(raw, servers, count)
    result["notes"] = _notes(servers, setup, failures)
    return result


class FsyncOnPostgres(EmbeddedPostgres):
    """EmbeddedPostgres with `-c fsync=on`: a command-line setting beats ALTER SYSTEM."""

    def _launch(self, what: str, argv: list[str], **popen: Any) -> None:
        if "fsync=off" not in argv:
            raise EmbeddedError(f"no fsync=off in the server's command line to replace: {argv}")
        super()._launch(what, ["fsync=on" if a == "fsync=off" else a for a in argv], **popen)


def test_fsync(directory: Path, seconds: int) -> dict[str, Any]:
    """pg_test_fsync (shipped beside the server and pgbench): ops/s and microseconds per
    op of each wal_sync_method for one 8 kB write, on the data directories' file system."""
    done = subprocess.run(
        [str(PG_TEST_FSYNC), "-s", str(seconds), "-f", str(directory / "pg_test_fsync.out")],
        capture_output=True, text=True, check=False, timeout=SETUP_TIMEOUT + 20 * seconds,
    )  # fmt: skip
    section = done.stdout.split("using one 8kB write:", 1)[-1].split("\n\n", 1)[0]
    methods = {
        m[1]: {"per_second": round(float(m[2])), "usecs_per_op": int(m[3])}
        for m in re.finditer(r"^\s+(\w+)\s+([0-9.]+) ops/sec\s+(\d+) usecs/op", section, re.M)
    }
    if not methods:
        raise RuntimeError(f"pg_test_fsync printed no results: {done.stdout[-300:]}{done.stderr}")
    return {"tool": "pg_test_fsync", "seconds_per_test": seconds, "one_8k_write": methods}


# --- the simulated fleet -----------------------------------------------------------------


def make_profiles(count: int, seed: int) -> list[NodeProfile]:
    """Nodes with varied tier, region, trust zone, hardware and capabilities; deterministic."""
    rng = random.Random(seed)
    profiles = []
    for i in range(count):
        gpu = rng.random() < 0.15
        hardware: dict[str, Any] = {
            "gpu": gpu,
            "memory_gb": rng.choice((8, 16, 32, 64, 128) if gpu else (2, 4, 8, 16, 32, 64)),
            "cpu_count": rng.choice((2, 4, 8, 16, 32)),
            "arch": rng.choice(("x86_64", "x86_64", "x86_64", "aarch64")),
        }
        if rng.random() < 0.02:  # nodes whose fingerprint failed register without hardware
            hardware = {}
        capabilities = {
            c for c, odds in zip(CAPABILITIES, CAPABILITY_ODDS, strict=True) if rng.random() < odds
        }
        if hardware.get("gpu"):
            capabilities.add("gpu")  # as the heartbeat service derives it
        profiles.append(
            NodeProfile(
                node_id=f"node-{i:05d}",
                tier=rng.choices(TIERS, TIER_WEIGHTS)[0],
                region=rng.choices(REGIONS, REGION_WEIGHTS)[0],
                trust_zone=rng.choices(ZONES, ZONE_WEIGHTS)[0],
                hardware=hardware,
                capabilities=sorted(capabilities),
            )
        )
    return profiles


# --- measurements ------------------------------------------------------------------------


@dataclass
class Phase:
    """Latencies and counts of one load phase."""

    name: str
    connections: int
    target_rate: float | None = None
    latencies_ns: list[int] = field(default_factory=list)
    per_second: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    missing: int = 0  # heartbeat() returned False: the node had no row
    sent: int = 0
    wall_seconds: float = 0.0
    client_cpu_seconds: float = 0.0
    server_cpu_seconds: float = 0.0
    other_cpu_seconds: float = 0.0  # the machine's busy CPU time minus client and server
    steal_seconds: float = 0.0
    start_ns: int = field(default_factory=time.perf_counter_ns)

    def record(self, began_ns: int, ok: bool = True) -> None:
        done = time.perf_counter_ns()
        self.latencies_ns.append(done - began_ns)
        second = (done - self.start_ns) // 1_000_000_000
        self.per_second[second] = self.per_second.get(second, 0) + 1
        if not ok:
            self.missing += 1

    def error(self, exc: BaseException | str) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(
                exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            )

    @property
    def completed(self) -> int:
        return len(self.latencies_ns)

    @property
    def rate(self) -> float:
        return self.completed / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def worst_second(self) -> int | None:
        """The fewest completions in any whole second of the phase (partial ones left out)."""
        full = int(self.wall_seconds)
        return min(self.per_second.get(s, 0) for s in range(full)) if full >= 1 else None

    def summary(self, required_rate: float) -> dict[str, Any]:
        lat = sorted(self.latencies_ns)
        out: dict[str, Any] = {
            "phase": self.name,
            "connections": self.connections,
            "completed": self.completed,
            "wall_seconds": round(self.wall_seconds, 3),
            "per_second": round(self.rate, 1),
            "times_required": round(self.rate / required_rate, 2),
            "worst_second": self.worst_second(),
            "latency_ms": latency_ms(lat),
            "errors": self.errors,
            "first_errors": self.first_errors,
            "missing_rows": self.missing,
            "client_cpu_percent": percent(self.client_cpu_seconds, self.wall_seconds),
            "server_cpu_percent": percent(self.server_cpu_seconds, self.wall_seconds),
            "other_cpu_percent": percent(self.other_cpu_seconds, self.wall_seconds),
            "steal_percent": percent(self.steal_seconds, self.wall_seconds),
        }
        if self.target_rate is not None:
            out["target_rate"] = round(self.target_rate, 1)
            out["sent"] = self.sent
            out["latency_from"] = "scheduled send time"
        return out


class GcWatch:
    """Python's garbage-collector pauses in this process while it is entered."""

    def __init__(self) -> None:
        self.pauses_ns: dict[int, list[int]] = {0: [], 1: [], 2: []}
        self._began = 0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter_ns()
        else:
            self.pauses_ns[info["generation"]].append(time.perf_counter_ns() - self._began)

    def __enter__(self) -> GcWatch:
        gc.collect()
        gc.freeze()  # what exists now (the simulated fleet, the expectations) is never rescanned
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)
        gc.unfreeze()

    def summary(self) -> dict[str, Any]:
        return {
            f"gen{g}": {
                "collections": len(p),
                "total_ms": round(sum(p) / 1e6, 1),
                "max_ms": round(max(p) / 1e6, 1) if p else None,
            }
            for g, p in self.pauses_ns.items()
        }


class CpuMeter:
    """CPU seconds of the client (this process, or with `children` the pgbench it waited
    for), of the PostgreSQL server's processes (bench.proc) and of the rest of the machine."""

    def __init__(self, server_pid: int) -> None:
        self._pid = server_pid
        self._children = False
        self._at: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def _now(self) -> tuple[float, float, float, float]:
        if self._children:
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            client = usage.ru_utime + usage.ru_stime
        else:
            client = time.process_time()
        return (client, proc.cpu_seconds(self._pid, tree=True), *proc.machine_busy())

    def start(self, *, children: bool = False) -> None:
        self._children = children
        self._at = self._now()

    def stop(self, phase: Phase) -> None:
        client, server, busy, steal = (b - a for a, b in zip(self._at, self._now(), strict=True))
        phase.client_cpu_seconds, phase.server_cpu_seconds = client, server
        phase.other_cpu_seconds = max(0.0, busy - client - server)
        phase.steal_seconds = steal


async def _register(
    registry: AsyncpgRegistry, profiles: Sequence[NodeProfile], meter: CpuMeter
) -> Phase:
    phase = Phase(REGISTER, REGISTER_CONNECTIONS)
    todo = iter(profiles)

    async def worker() -> None:
        for profile in todo:  # the workers share one iterator: each profile is sent once
            began = time.perf_counter_ns()
            try:
                await registry.upsert(profile, status="online", interval_seconds=INTERVAL_SECONDS)
            except RegistryUnavailable as exc:
                phase.error(exc)
                continue
            phase.record(began)

    meter.start()
    phase.start_ns = time.perf_counter_ns()
    await asyncio.gather(*(worker() for _ in range(REGISTER_CONNECTIONS)))
    phase.wall_seconds = (time.perf_counter_ns() - phase.start_ns) / 1e9
    meter.stop(phase)
    return phase


def _pgbench_version() -> str:
    done = subprocess.run([str(PGBENCH), "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "pgbench"


PGBENCH = EmbeddedPostgres._bin("pgbench")  # the one shipped with the server's binaries
PG_TEST_FSYNC = EmbeddedPostgres._bin("pg_test_fsync")


def heartbeat_script(count: int) -> str:
    """A pgbench script of the adapter's heartbeat statement for a random node of `count`;
    `\\gset` fails the client when no row came back (the node had no row for this instance)."""
    sql = " ".join(registry_sql._HEARTBEAT.split())
    for parameter, value in (
        ("$1", "'node-' || lpad(:node::text, 5, '0')"),
        ("$2", "'online'"),
        ("$3", ":instance"),
    ):
        if parameter not in sql:
            raise RuntimeError(f"no {parameter} in the adapter's heartbeat statement: {sql}")
        sql = sql.replace(parameter, value)
    return f"\\set node random(0, {count - 1})\n{sql} \\gset\n"


def start_pgbench(
    url: str,
    instance: str,
    count: int,
    workdir: Path,
    *,
    name: str,
    connections: int,
    seconds: int,
    rate: float | None = None,
) -> subprocess.Popen[str]:
    """pgbench running the heartbeat script for `seconds`, closed loop or at `rate`/s (-R:
    Poisson arrivals, latency logged from each transaction's scheduled start), one log line
    per transaction under `workdir`/`name`.*."""
    script = workdir / "heartbeat.sql"
    script.write_text(heartbeat_script(count))
    argv = [str(PGBENCH), "-n", "-M", "prepared", "-f", str(script), "-D", f"instance={instance}",
            "-c", str(connections), "-j", str(min(PGBENCH_THREADS, connections)),
            "-T", str(seconds), "--log", f"--log-prefix={workdir / name}"]  # fmt: skip
    if rate is not None:
        argv += ["-R", f"{rate:.3f}"]
    return subprocess.Popen(
        [*argv, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir
    )


def finish_pgbench(
    proc: subprocess.Popen[str], workdir: Path, *, name: str, connections: int,
    seconds: int, rate: float | None = None,
) -> Phase:  # fmt: skip
    """Wait for pgbench and read its per-transaction logs into a Phase: client_id,
    transaction_no, latency (us), script_no, completion time (s, us)[, schedule lag]."""
    _, stderr = proc.communicate(timeout=seconds + SETUP_TIMEOUT)
    phase = Phase(name, connections, target_rate=rate)
    done: list[tuple[int, int]] = []  # (completed at, latency) in ns
    for log in sorted(workdir.glob(f"{name}.*")):
        for line in log.read_text().splitlines():
            fields = line.split()
            latency = int(fields[2]) * 1000
            done.append((int(fields[4]) * 1_000_000_000 + int(fields[5]) * 1000, latency))
        log.unlink()
    if done:
        phase.start_ns = min(at - latency for at, latency in done)
    for at, latency in done:
        phase.latencies_ns.append(latency)
        second = (at - phase.start_ns) // 1_000_000_000
        phase.per_second[second] = phase.per_second.get(second, 0) + 1
    phase.wall_seconds = float(seconds)
    for line in stderr.splitlines():
        if "aborted" in line or "error" in line.lower():
            phase.error(line.strip())
    if proc.returncode not in (0, 2) or (proc.returncode == 2 and not phase.errors):
        phase.error(f"pgbench exited with {proc.returncode}: {stderr.strip()[-300:]}")
    phase.sent = phase.completed + phase.errors
    return phase


def _pgbench_phase(
    url: str, instance: str, count: int, workdir: Path, meter: CpuMeter, *,
    name: str, connections: int, seconds: int, rate: float | None = None,
) -> Phase:  # fmt: skip
    meter.start(children=True)
    proc = start_pgbench(url, instance, count, workdir, name=_log_name(name, connections),
                         connections=connections, seconds=seconds, rate=rate)  # fmt: skip
    phase = finish_pgbench(proc, workdir, name=_log_name(name, connections),
                           connections=connections, seconds=seconds, rate=rate)  # fmt: skip
    phase.name = name
    meter.stop(phase)
    return phase


def _log_name(name: str, connections: int) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{name} {connections}")


def paced_short(phase: Phase) -> bool:
    """Fewer beats than a Poisson schedule at the target rate gives but for bad luck."""
    if phase.target_rate is None:
        return False
    expected = phase.target_rate * phase.wall_seconds
    return phase.completed < expected - PACED_SIGMAS * math.sqrt(expected)


@dataclass
class QueryResult:
    label: str
    load: str
    latencies_ns: list[int]
    rows: int
    expected: int
    same_nodes: bool  # the node ids returned are exactly the expected ones
    server_ms: float | None = None
    scans: str = "-"  # the plan's scan nodes, idle

    def summary(self) -> dict[str, Any]:
        return {
            "query": self.label,
            "load": self.load,
            "repeats": len(self.latencies_ns),
            "rows": self.rows,
            "expected_rows": self.expected,
            "same_nodes": self.same_nodes,
            "latency_ms": latency_ms(sorted(self.latencies_ns)),
            "server_execution_ms": self.server_ms,
            "scans": self.scans,
        }


async def _queries(
    registry: AsyncpgRegistry,
    profiles: Sequence[NodeProfile],
    *,
    repeats: int,
    load: str,
    refresh: bool,
) -> list[QueryResult]:
    """Each requirement set `repeats` times through eligible(), then nodes(liveness=online).

    With `refresh`, every row's last_heartbeat is moved to now() before each set, so all
    nodes are live (idle, nothing else keeps them so); under the paced load they stay live."""
    results = []
    everyone = {p.node_id for p in profiles}
    for query in QUERIES:
        if refresh:
            await _refresh(registry)
        expected = {p.node_id for p in profiles if not match_requirements(query.requirements, p)}
        latencies: list[int] = []
        found: set[str] = set()
        counts: set[int] = set()
        for i in range(repeats):
            began = time.perf_counter_ns()
            nodes = await registry.eligible(query.requirements)
            latencies.append(time.perf_counter_ns() - began)
            counts.add(len(nodes))
            if i == 0:
                found = {n.node_id for n in nodes}
        rows = min(counts) if len(counts) == 1 else -1
        results.append(
            QueryResult(query.label, load, latencies, rows, len(expected), found == expected)
        )
    if refresh:
        await _refresh(registry)
    latencies = []
    counts = set()
    found = set()
    for i in range(repeats):
        began = time.perf_counter_ns()
        listed = await registry.nodes(liveness="online", limit=NODES)
        latencies.append(time.perf_counter_ns() - began)
        counts.add(len(listed))
        if i == 0:
            found = {str(n["node_id"]) for n in listed}
    rows = min(counts) if len(counts) == 1 else -1
    results.append(
        QueryResult(NODES_QUERY, load, latencies, rows, len(everyone), found == everyone)
    )
    return results


async def _refresh(registry: AsyncpgRegistry) -> None:
    await registry.pool.execute(
        "UPDATE worker_capabilities SET last_heartbeat = now(), status = 'online'",
        timeout=SETUP_TIMEOUT,
    )


def _eligible_args(requirements: Requirements) -> list[Any]:
    """The bind parameters AsyncpgRegistry.eligible sends, in order."""
    hw = requirements.hardware
    tiers = [t.value for t in requirements.tier] if requirements.tier is not None else None
    caps = requirements.capabilities or None
    return [
        tiers,
        requirements.region,
        requirements.trust_zone,
        caps,
        hw.gpu,
        hw.min_memory_gb,
        hw.min_cpu_count,
        None,
    ]


_EXECUTION = re.compile(r"Execution Time: ([0-9.]+) ms")


async def _explain(registry: AsyncpgRegistry, sql: str, args: Sequence[Any], how: str) -> list[str]:
    async with registry.pool.acquire() as conn:
        rows = await conn.fetch(f"EXPLAIN ({how}) {sql}", *args, timeout=SETUP_TIMEOUT)
    return [str(r[0]) for r in rows]


_SCAN = re.compile(r"(Seq Scan|Bitmap Index Scan|Index Only Scan|Index Scan)(?: using (\S+))?")
_SCAN_NAMES = {"Seq Scan": "seq", "Bitmap Index Scan": "bitmap", "Index Only Scan": "index-only",
               "Index Scan": "index"}  # fmt: skip


def _scans(plan: Sequence[str]) -> str:
    """The plan's scans in short: "seq", "bitmap capabilities", "index tier"."""
    found = []
    for line in plan:
        if match := _SCAN.search(line):
            index = match[2] or (line.split(" on ", 1)[1].split()[0] if "Bitmap" in line else "")
            found.append(
                f"{_SCAN_NAMES[match[1]]} {index.removeprefix('idx_worker_capabilities_')}".strip()
            )
    return " + ".join(found) or "-"


async def _server_ms(
    registry: AsyncpgRegistry, sql: str, args: Sequence[Any]
) -> tuple[float | None, str]:
    """Median execution time inside PostgreSQL (EXPLAIN ANALYZE without per-node timing),
    and the scans of the last plan."""
    times = []
    plan: list[str] = []
    for _ in range(EXPLAIN_RUNS):
        plan = await _explain(registry, sql, args, "ANALYZE, TIMING OFF")
        for line in plan:
            if match := _EXECUTION.search(line):
                times.append(float(match[1]))
    return (round(statistics.median(times), 3) if times else None), _scans(plan)


async def _plan_choices(registry: AsyncpgRegistry) -> dict[str, Any]:
    """Generic vs custom plans of the adapter's own prepared statements, on its connection."""
    async with registry.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement NOT LIKE 'EXPLAIN%'"
        )
    out: dict[str, Any] = {}
    for row in rows:
        statement = str(row["statement"])
        key = (
            "eligible"
            if "eligible_workers(" in statement
            else "nodes"
            if "worker_liveness_now" in statement
            else None
        )
        if key is not None:
            out[key] = {"generic_plans": row["generic_plans"], "custom_plans": row["custom_plans"]}
    return out


async def _table_stats(registry: AsyncpgRegistry) -> dict[str, Any]:
    async with registry.pool.acquire() as conn:
        await conn.execute("SELECT pg_stat_force_next_flush()")
        row = await conn.fetchrow(
            "SELECT n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, autovacuum_count, "
            "autoanalyze_count, pg_table_size(relid) AS table_bytes, "
            "pg_indexes_size(relid) AS index_bytes "
            "FROM pg_stat_user_tables WHERE relname = 'worker_capabilities'"
        )
        indexes = await conn.fetch(
            "SELECT indexrelname, pg_relation_size(indexrelid) AS bytes "
            "FROM pg_stat_user_indexes WHERE relname = 'worker_capabilities' ORDER BY 1"
        )
    stats = dict(row) if row is not None else {}
    stats["index_bytes_each"] = {str(r["indexrelname"]): int(r["bytes"]) for r in indexes}
    return stats


async def _settings(registry: AsyncpgRegistry) -> dict[str, str]:
    async with registry.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT name, setting, source FROM pg_settings WHERE name = ANY($1::text[])",
            [
                "fsync",
                "synchronous_commit",
                "wal_sync_method",
                "full_page_writes",
                "shared_buffers",
                "max_connections",
                "plan_cache_mode",
                "autovacuum",
            ],
        )
        version = await conn.fetchval("SHOW server_version")
    out = {str(r["name"]): f"{r['setting']} ({r['source']})" for r in rows}
    out["server_version"] = str(version)
    return out


async def _measure(
    url: str,
    server_pid: int,
    profiles: Sequence[NodeProfile],
    options: Options,
    duration: float,
    repeats: int,
    label: str,
    workdir: Path,
) -> tuple[dict[str, Any], list[Phase], list[QueryResult]]:
    """Everything on one server; the JSON summary plus the raw phases for the tables."""
    failures: list[str] = []
    required = len(profiles) / INTERVAL_SECONDS
    meter = CpuMeter(server_pid)
    beats = AsyncpgRegistry(url, timeout=TIMEOUT, max_connections=max(CONNECTIONS))
    # One connection for queries and bookkeeping: its prepared statements can be inspected.
    reader = AsyncpgRegistry(url, timeout=SETUP_TIMEOUT, max_connections=1)
    await beats.open()
    await reader.open()
    try:
        settings = await _settings(reader)
        want_fsync = label.split("=", 1)[1]
        if not settings["fsync"].startswith(want_fsync + " "):
            failures.append(f"server runs with fsync {settings['fsync']}, wanted {want_fsync}")
        applied = await migrating.migrate(reader, MIGRATIONS)
        files = len(list(MIGRATIONS.glob("*.sql")))
        if len(applied) != files:
            failures.append(f"{len(applied)} migrations applied to a fresh database, {files} files")

        _say(f"{label}: registering {len(profiles)} nodes")
        register = await _register(beats, profiles, meter)
        registered = await reader.pool.fetchval("SELECT count(*) FROM worker_capabilities")
        if registered != len(profiles) or register.errors:
            failures.append(
                f"registration: {registered} rows for {len(profiles)} nodes, "
                f"{register.errors} errors {register.first_errors}"
            )
        await reader.pool.execute("ANALYZE worker_capabilities")
        after_register = await _table_stats(reader)

        _say(f"{label}: warm-up {options.warmup:g} s, then heartbeats (pgbench)")
        count, instance, seconds = len(profiles), beats.instance, max(1, round(duration))

        def pgbench(name: str, connections: int, seconds: int, rate: float | None = None) -> Any:
            return asyncio.to_thread(
                _pgbench_phase, url, instance, count, workdir, meter, name=name,
                connections=connections, seconds=seconds, rate=rate,
            )  # fmt: skip

        await pgbench("warm-up", max(CONNECTIONS), max(1, round(options.warmup)))
        heartbeats: list[Phase] = [
            await pgbench("heartbeat, closed loop", connections, seconds)
            for connections in CONNECTIONS
        ]
        paced_name = f"heartbeat, paced {required:.0f}/s"
        heartbeats.append(await pgbench(paced_name, max(CONNECTIONS), seconds, required))

        _say(f"{label}: queries, idle")
        began = time.monotonic()
        with GcWatch() as idle_gc:
            idle = await _queries(reader, profiles, repeats=repeats, load="idle", refresh=True)
        idle_seconds = time.monotonic() - began
        await _refresh(reader)
        explain_args = _eligible_args(EXPLAINED.requirements)
        plan = await _explain(reader, registry_sql._ELIGIBLE, explain_args, "ANALYZE, BUFFERS")
        for result in idle:
            if result.label == NODES_QUERY:
                sql, args = registry_sql._NODES, [None, "online", None, NODES]
            else:
                query = next(q for q in QUERIES if q.label == result.label)
                sql, args = registry_sql._ELIGIBLE, _eligible_args(query.requirements)
            result.server_ms, result.scans = await _server_ms(reader, sql, args)
        plans = await _plan_choices(reader)

        _say(f"{label}: queries under the paced heartbeat load")
        await _refresh(reader)  # every node live for 2 intervals from here, beats or not
        # the paced load outlasts the queries: twice what they took idle, at least `duration`
        loaded_seconds = max(seconds, math.ceil(2 * idle_seconds) + 2)
        name = f"{paced_name} + queries"
        log = _log_name(name, max(CONNECTIONS))
        with GcWatch() as loaded_gc:
            meter.start(children=True)
            proc = await asyncio.to_thread(
                start_pgbench, url, instance, count, workdir, name=log,
                connections=max(CONNECTIONS), seconds=loaded_seconds, rate=required,
            )  # fmt: skip
            loaded = await _queries(
                reader, profiles, repeats=repeats, load=f"{required:.0f} beats/s", refresh=False
            )
            if proc.poll() is not None:
                failures.append("the queries under load outlasted the paced pgbench run")
            paced = await asyncio.to_thread(
                finish_pgbench, proc, workdir, name=log, connections=max(CONNECTIONS),
                seconds=loaded_seconds, rate=required,
            )  # fmt: skip
            paced.name = name
            meter.stop(paced)
        heartbeats.append(paced)
        final = await _table_stats(reader)
    finally:
        await reader.close()
        await beats.close()

    for phase in [register, *heartbeats]:
        if phase.errors or phase.missing:
            failures.append(
                f"{phase.name} ({phase.connections} conns): {phase.errors} errors, "
                f"{phase.missing} heartbeats found no row {phase.first_errors}"
            )
        if paced_short(phase):
            failures.append(
                f"{phase.name}: achieved {phase.rate:.1f}/s of {phase.target_rate}/s paced"
            )
    for result in [*idle, *loaded]:
        if result.rows != result.expected or not result.same_nodes or result.rows <= 0:
            failures.append(
                f"{result.label} ({result.load}): {result.rows} rows, expected "
                f"{result.expected}{'' if result.same_nodes else ', different nodes'}"
            )
    return (
        {
            "settings": settings,
            "register": register.summary(required),
            "heartbeats": [p.summary(required) for p in heartbeats],
            "queries": [r.summary() for r in [*idle, *loaded]],
            "explain": {"query": EXPLAINED.label, "plan": plan},
            "plan_choices": plans,
            "query_gc_pauses": {"idle": idle_gc.summary(), "loaded": loaded_gc.summary()},
            "table_after_register": after_register,
            "table_at_end": final,
            "failures": failures,
        },
        [register, *heartbeats],
        [*idle, *loaded],
    )


# --- report --------------------------------------------------------------------------------


def _filesystem(path: Path) -> str:
    resolved = str(path.resolve())
    best: Any = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") + "/"
        if (resolved + "/").startswith(mount) and (
            best is None or len(part.mountpoint) > len(best.mountpoint)
        ):
            best = part
    return "unknown" if best is None else f"{best.fstype} ({best.device} on {best.mountpoint})"


def _row_stats(phase: Phase, required: float) -> list[Any]:
    lat = sorted(phase.latencies_ns)
    return [
        phase.connections, phase.completed, num(phase.rate, 0),
        "-" if phase.name == REGISTER else num(phase.rate / required, 1),
        "-" if (w := phase.worst_second()) is None else w,
        *(num(v) for v in latency_ms(lat).values()), phase.errors + phase.missing,
        *(num(percent(cpu, phase.wall_seconds), 0) for cpu in (
            phase.client_cpu_seconds, phase.server_cpu_seconds, phase.other_cpu_seconds)),
    ]  # fmt: skip


def _tables(
    raw: dict[str, tuple[list[Phase], list[QueryResult]]],
    servers: dict[str, dict[str, Any]],
    count: int,
) -> list[dict[str, Any]]:
    required = count / INTERVAL_SECONDS
    loads = [
        [label, p.name, *_row_stats(p, required)] for label, (ps, _) in raw.items() for p in ps
    ]
    queries = []
    for label, (_, results) in raw.items():
        for r in results:
            rows = str(r.rows) + ("" if r.rows == r.expected and r.same_nodes
                                  else f" (expected {r.expected})")  # fmt: skip
            lat = latency_ms(sorted(r.latencies_ns))
            queries.append([label, r.load, r.label, rows, *(num(v) for v in lat.values()),
                            num(r.server_ms), r.scans if r.load == "idle" else ""])  # fmt: skip
    per_server = []
    for label, server in servers.items():
        start, end = server["table_after_register"], server["table_at_end"]
        updates = (end.get("n_tup_upd") or 0) - (start.get("n_tup_upd") or 0)
        hot = (end.get("n_tup_hot_upd") or 0) - (start.get("n_tup_hot_upd") or 0)
        idle = [q for q in server["queries"] if q["load"] == "idle"]
        gin = [q["query"] for q in idle if "capabilities" in q["scans"]]
        plans = server["plan_choices"].get("eligible", {})
        none = next(q for q in idle if q["query"] == QUERIES[0].label)
        gc2 = server["query_gc_pauses"]["idle"]["gen2"]
        per_server.append([
            label, f"{updates:,} ({percent(hot, updates):.0f} % HOT)",
            f"{mib(start.get('table_bytes', 0))} -> {mib(end.get('table_bytes', 0))}",
            f"{mib(start.get('index_bytes', 0))} -> {mib(end.get('index_bytes', 0))}",
            f"{end.get('n_dead_tup', 0):,}", end.get("autovacuum_count", 0),
            ", ".join(gin) or "none",
            f"{plans.get('custom_plans', '?')} / {plans.get('generic_plans', '?')}",
            f"{num(none['latency_ms']['p50'])} / {num(none['server_execution_ms'])}",
            f"{gc2['collections']}, {gc2['total_ms']} ms, max {gc2['max_ms']} ms",
        ])  # fmt: skip
    return [
        table(f"Registration and heartbeats: {count:,} nodes, one beat each per "
              f"{INTERVAL_SECONDS} s = {required:.0f}/s required", LOAD_COLUMNS, loads),
        table(f"'Live nodes that can run X' at {count:,} nodes: AsyncpgRegistry.eligible()",
              QUERY_COLUMNS, queries),
        table("worker_capabilities after registration -> at the end; the idle queries",
              "server|row updates|table MiB|indexes MiB|dead rows|autovacuums|GIN index in "
              "plan of|eligible plans custom / generic|'none' p50 ms client / server|full GC "
              "(idle queries)", per_server),
    ]  # fmt: skip


def _notes(
    servers: dict[str, dict[str, Any]], setup: dict[str, Any], failures: list[str]
) -> list[str]:
    required = setup["required_heartbeats_per_second"]
    notes = [f"FAILED: {f}" for f in failures] or [
        "verified: every upsert landed, no heartbeat errored or missed its row, the paced "
        "phases kept their rate, and every query returned exactly the nodes the Python "
        "matcher (match_requirements) picks"
    ]
    noisy = [
        f"{label} {p['phase']} ({p['connections']} conns): other {p['other_cpu_percent']:.0f} %, "
        f"steal {p['steal_percent']:.0f} %"
        for label, server in servers.items()
        for p in [server["register"], *server["heartbeats"]]
        if "+ queries" not in p["phase"]
        and (p["other_cpu_percent"] > NOISY_OTHER_CPU_PERCENT or p["steal_percent"] > 5)
    ]
    if noisy:
        notes.append("NOISY: something else used the CPU during " + "; ".join(noisy))
    for label, server in servers.items():
        best = max((p for p in server["heartbeats"] if "target_rate" not in p),
                   key=lambda p: p["per_second"])  # fmt: skip
        paced = "; ".join(
            f"{p['phase']}: p50 {num(p['latency_ms']['p50'])} / p99 {num(p['latency_ms']['p99'])}"
            f" / max {num(p['latency_ms']['max'])} ms"
            for p in server["heartbeats"] if "target_rate" in p
        )  # fmt: skip
        notes.append(
            f"{label}: sustained {best['per_second']:.0f} heartbeats/s with "
            f"{best['connections']} connections = {best['times_required']:.1f}x the "
            f"{required:.0f}/s that {setup['nodes']:,} nodes at one beat per "
            f"{INTERVAL_SECONDS} s need; {paced} (latency from the scheduled time)"
        )
    sync = setup["fsync_8k"]["one_8k_write"]
    off = servers.get("fsync=off", {}).get("settings", {})
    on = servers.get("fsync=on", {}).get("settings", {})
    notes.append(
        "fsync: EmbeddedPostgres starts the server with `-c fsync=off` (pg_settings: fsync = "
        f"{off.get('fsync', '?')}); the fsync=on rows come from a second server on the same "
        f"binaries with `-c fsync=on` (fsync = {on.get('fsync', '?')}, synchronous_commit = "
        f"{on.get('synchronous_commit', '?')}, wal_sync_method = "
        f"{on.get('wal_sync_method', '?')}); data directories on {setup['data_filesystem']}, "
        "where pg_test_fsync gives for one 8 kB write: "
        + ", ".join(f"{m} {v['per_second']:,}/s ({v['usecs_per_op']} us)" for m, v in sync.items())
        + ". Production runs with fsync on: plan with those rows."
    )
    notes.append(
        f"client and PostgreSQL share the {len(os.sched_getaffinity(0))} cores, unpinned: "
        "client CPU% and server CPU% (100 = one core) show where the time went; other CPU% is "
        "the rest of the machine's busy time (for the '+ queries' rows, mostly this process's "
        "queries). Heartbeats are pgbench (-M prepared, -j 2) running the adapter's own UPDATE "
        f"for a random node, closed loop from {'/'.join(map(str, CONNECTIONS))} connections, "
        "paced at nodes/30 per second (-R, Poisson arrivals) from a process of their own; "
        f"the real fleet holds at least {setup['nodes']:,} connections against max_connections "
        f"= {off.get('max_connections', '?')} here: a pooler (PgBouncer) is needed at that size"
    )
    first = next(iter(servers.values()))
    plan: list[str] = first["explain"]["plan"]
    inlined = not any("Function Scan" in line for line in plan)
    notes.append(
        f"EXPLAIN (ANALYZE, BUFFERS) of the adapter's eligible query for '{EXPLAINED.label}', "
        f"idle, {next(iter(servers))}: eligible_workers() and worker_liveness() "
        f"{'are inlined into the query' if inlined else 'are NOT inlined (Function Scan)'}; "
        "top lines:\n    " + "\n    ".join(line[:160] for line in plan[:EXPLAIN_LINES])
    )
    notes.append(
        "query latency is AsyncpgRegistry.eligible() end to end (nodes() for the last row); "
        "'server ms' is the execution time inside PostgreSQL (EXPLAIN ANALYZE, TIMING OFF, "
        f"median of {EXPLAIN_RUNS}, idle); each requirement set ran {setup['query_repeats']} "
        "times from one connection, idle after moving every last_heartbeat to now(), and "
        "again under the paced heartbeat load; a generic plan cannot use the GIN index"
    )
    return notes
