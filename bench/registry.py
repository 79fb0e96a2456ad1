"""The registry benchmark: 10,000 simulated nodes heartbeating every 30 s against one PostgreSQL.

Registers the nodes through AsyncpgRegistry.upsert (which writes the fleet the rest reads),
then pgbench runs the adapter's own heartbeat statement (registry._HEARTBEAT, prepared, -j 2)
for a random node: closed loop (the sustained rate) and paced at nodes / 30 s (-R, Poisson
arrivals, latency from each scheduled start). eligible() ("live nodes that can run X") and
nodes() are timed end to end through the adapter (the wire, asyncpg's decoding, a
NodeProfile per row), idle after moving every last_heartbeat to now() and under the paced
load, beside PostgreSQL's own execution time (EXPLAIN ANALYZE, TIMING OFF, median of
EXPLAIN_RUNS, idle); a generic plan cannot use the GIN index. All of it twice: on
EmbeddedPostgres as it starts (fsync=off) and on a second server with fsync=on.
Client and server share the cores, unpinned: CPU% is per process (100 = one core), other
CPU% the rest of the machine's busy time (for '+ queries', mostly this process's queries).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from app.adapters import registry as registry_sql
from app.adapters.embedded import EmbeddedError, EmbeddedPostgres
from app.adapters.registry import AsyncpgRegistry, RegistryUnavailable
from app.domain.requirements import HardwareRequirements as Hardware
from app.domain.requirements import NodeProfile, Requirements, Tier, match_requirements
from app.services import migrating
from bench import Options, proc
from bench.report import cell, latency_ms, mib, noisy, percent, say, table

NAME = "registry"
DESCRIPTION = "capability registry on PostgreSQL: heartbeat rate and eligible-node query latency"
_say = functools.partial(say, NAME)

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
PGBENCH = EmbeddedPostgres._bin("pgbench")  # the one shipped with the server's binaries
PG_TEST_FSYNC = EmbeddedPostgres._bin("pg_test_fsync")
NODES, QUICK_NODES = 10_000, 1_000
INTERVAL_SECONDS = 30  # every node heartbeats this often: the load to carry is NODES / 30 per s
SEED = 20_250_611
CONNECTIONS = (8, 32)  # closed-loop heartbeat phases
PGBENCH_THREADS = 2
PACED_SIGMAS = 4  # pgbench -R draws Poisson arrivals: the count may fall this many sigma short
REGISTER_CONNECTIONS = 8
REGISTER = "register (upsert)"
QUERY_REPEATS, QUICK_QUERY_REPEATS = 200, 30
QUICK_DURATION = 2.0
TIMEOUT = 5.0  # the manager's default DATABASE_TIMEOUT_SECONDS
SETUP_TIMEOUT = 60.0
EXPLAIN_RUNS = 5
EXPLAIN_LINES = 16
NOISY_OTHER_CPU_PERCENT = 15.0  # above this, say the phase ran on a busy machine
SETTINGS = ("fsync", "synchronous_commit", "wal_sync_method", "full_page_writes",
            "shared_buffers", "max_connections", "plan_cache_mode", "autovacuum")  # fmt: skip

REGIONS = ("eu-west", "eu-central", "us-east", "us-west", "ap-south", None)
REGION_WEIGHTS = (30, 15, 25, 15, 10, 5)
ZONES = ("z1", "z2", "z3", None)
ZONE_WEIGHTS = (40, 30, 20, 10)
TIERS = (Tier.A, Tier.B, Tier.C)
TIER_WEIGHTS = (20, 50, 30)
CAPABILITIES = ("embeddings", "inference", "scraping", "transcoding", "training", "ocr", "storage")
CAPABILITY_ODDS = (0.45, 0.35, 0.3, 0.15, 0.1, 0.2, 0.25)

QUERIES: dict[str, Requirements] = {
    "none": Requirements(),
    "tier A": Requirements(tier=[Tier.A]),
    "tier A + eu-west + embeddings": Requirements(
        tier=[Tier.A], region="eu-west", capabilities=["embeddings"]
    ),
    "gpu + >= 64 GB": Requirements(hardware=Hardware(gpu=True, min_memory_gb=64)),
    "zone z1 + embeddings,inference": Requirements(
        trust_zone="z1", capabilities=["embeddings", "inference"]
    ),
}
EXPLAINED = "zone z1 + embeddings,inference"  # the one that can use the GIN index
NODES_QUERY = "nodes(liveness=online)"


def run(options: Options) -> dict[str, Any]:
    count = QUICK_NODES if options.quick else NODES
    duration = min(options.duration, QUICK_DURATION) if options.quick else options.duration
    repeats = QUICK_QUERY_REPEATS if options.quick else QUERY_REPEATS
    profiles = make_profiles(count, SEED)
    pgbench = subprocess.run([PGBENCH, "--version"], capture_output=True, text=True, check=False)
    setup: dict[str, Any] = {
        "nodes": count, "heartbeat_interval_seconds": INTERVAL_SECONDS,
        "required_heartbeats_per_second": round(count / INTERVAL_SECONDS, 1),
        "closed_loop_connections": list(CONNECTIONS), "register_connections": REGISTER_CONNECTIONS,
        "duration_seconds": duration, "warmup_seconds": options.warmup, "query_repeats": repeats,
        "seed": SEED, "statement_timeout_seconds": TIMEOUT,
        "client": f"{pgbench.stdout.strip() or 'pgbench'} (heartbeats, -M prepared, "
        f"{PGBENCH_THREADS} threads); asyncpg on the asyncio event loop, Python "
        f"{sys.version.split()[0]} (register, queries)",
        "cpu_pinning": "none: client and server share every core",
    }  # fmt: skip
    servers: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp:
        workdir = Path(tmp)
        setup["data_filesystem"] = _filesystem(workdir)
        setup["fsync_8k"] = test_fsync(workdir, 1 if options.quick else 2)
        for label, server_class in (("fsync=off", EmbeddedPostgres), ("fsync=on", FsyncOnPostgres)):
            _say(f"{label}: starting PostgreSQL")
            server = server_class(data_dir=workdir / label.replace("=", "-"))
            server.start()
            try:
                servers[label] = asyncio.run(_measure(server, label, profiles, setup, workdir))
            finally:
                server.stop()
    failures = [f"{label}: {f}" for label, s in servers.items() for f in s["failures"]]
    result: dict[str, Any] = {"setup": setup, "servers": servers, "failures": failures}
    result["tables"] = _tables(servers, setup)
    result["notes"] = _notes(servers, setup, failures)
    return result


class FsyncOnPostgres(EmbeddedPostgres):
    """EmbeddedPostgres with `-c fsync=on`: a command-line setting beats ALTER SYSTEM."""

    def _launch(self, what: str, argv: list[str], **popen: Any) -> None:
        if "fsync=off" not in argv:
            raise EmbeddedError(f"no fsync=off in the server's command line to replace: {argv}")
        super()._launch(what, ["fsync=on" if a == "fsync=off" else a for a in argv], **popen)


def test_fsync(directory: Path, seconds: int) -> dict[str, Any]:
    """pg_test_fsync (shipped beside the server): ops/s and microseconds per op of each
    wal_sync_method for one 8 kB write, on the data directories' file system."""
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


def _filesystem(path: Path) -> str:
    resolved = str(path.resolve()) + "/"
    mounts = [p for p in psutil.disk_partitions(all=True)
              if resolved.startswith(p.mountpoint.rstrip("/") + "/")]  # fmt: skip
    best = max(mounts, key=lambda p: len(p.mountpoint), default=None)
    return "unknown" if best is None else f"{best.fstype} ({best.device} on {best.mountpoint})"


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
        profiles.append(NodeProfile(
            node_id=f"node-{i:05d}", tier=rng.choices(TIERS, TIER_WEIGHTS)[0],
            region=rng.choices(REGIONS, REGION_WEIGHTS)[0],
            trust_zone=rng.choices(ZONES, ZONE_WEIGHTS)[0], hardware=hardware,
            capabilities=sorted(capabilities),
        ))  # fmt: skip
    return profiles


# --- load phases -------------------------------------------------------------------------


@dataclass
class Phase:
    """Completions, errors and CPU of one load phase."""

    name: str
    connections: int
    target_rate: float | None = None
    done: list[tuple[int, int]] = field(default_factory=list)  # (completed at, latency), ns
    errors: list[str] = field(default_factory=list)
    missing: int = 0  # heartbeat() returned False: the node had no row
    wall_seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # client, server, busy, steal seconds

    def short(self) -> bool:
        """Fewer beats than a Poisson schedule at the target rate gives but for bad luck."""
        if self.target_rate is None:
            return False
        expected = self.target_rate * self.wall_seconds
        return len(self.done) < expected - PACED_SIGMAS * math.sqrt(expected)

    def summary(self, required_rate: float) -> dict[str, Any]:
        start = min((at - latency for at, latency in self.done), default=0)
        per_second = Counter((at - start) // 1_000_000_000 for at, _ in self.done)
        full, rate = int(self.wall_seconds), len(self.done) / max(self.wall_seconds, 1e-9)
        cpu = self.cpu
        out: dict[str, Any] = {
            "phase": self.name, "connections": self.connections, "completed": len(self.done),
            "wall_seconds": round(self.wall_seconds, 3), "per_second": round(rate, 1),
            "times_required": round(rate / required_rate, 2),
            "worst_second": min(per_second[s] for s in range(full)) if full >= 1 else None,
            "latency_ms": latency_ms(sorted(latency for _, latency in self.done)),
            "errors": len(self.errors), "first_errors": self.errors[:5],
            "missing_rows": self.missing,
            "client_cpu_percent": percent(cpu["client"], self.wall_seconds),
            "server_cpu_percent": percent(cpu["server"], self.wall_seconds),
            "other_cpu_percent": percent(
                max(0.0, cpu["busy"] - cpu["client"] - cpu["server"]), self.wall_seconds),
            "steal_percent": percent(cpu["steal"], self.wall_seconds),
        }  # fmt: skip
        if self.target_rate is not None:
            out["target_rate"] = round(self.target_rate, 1)
            out["sent"] = len(self.done) + len(self.errors)
            out["latency_from"] = "scheduled send time"
        return out


def _meter(server_pid: int, *, children: bool) -> proc.Meter:
    """CPU of the client (this process, or the pgbench it waited for), of PostgreSQL's
    processes, and the machine's busy and steal time."""
    return proc.Meter(
        client=proc.children_cpu if children else time.process_time,
        server=lambda: proc.cpu_seconds(server_pid, tree=True),
        busy=lambda: proc.machine_busy()[0], steal=lambda: proc.machine_busy()[1],
    )  # fmt: skip


async def _register(registry: AsyncpgRegistry, profiles: Sequence[NodeProfile], pid: int) -> Phase:
    phase, todo = Phase(REGISTER, REGISTER_CONNECTIONS), iter(profiles)

    async def worker() -> None:
        for profile in todo:  # the workers share one iterator: each profile is sent once
            began = time.perf_counter_ns()
            try:
                await registry.upsert(profile, status="online", interval_seconds=INTERVAL_SECONDS)
            except RegistryUnavailable as exc:
                phase.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            done = time.perf_counter_ns()
            phase.done.append((done, done - began))

    meter, started = _meter(pid, children=False), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(REGISTER_CONNECTIONS)))
    phase.wall_seconds, phase.cpu = time.perf_counter() - started, meter.spent()
    return phase


def heartbeat_script(count: int) -> str:
    """A pgbench script of the adapter's heartbeat statement for a random node of `count`;
    `\\gset` fails the client when no row came back (the node had no row for this instance)."""
    sql = " ".join(registry_sql._HEARTBEAT.split())
    for parameter, value in (("$1", "'node-' || lpad(:node::text, 5, '0')"), ("$2", "'online'"),
                             ("$3", ":instance")):  # fmt: skip
        if parameter not in sql:
            raise RuntimeError(f"no {parameter} in the adapter's heartbeat statement: {sql}")
        sql = sql.replace(parameter, value)
    return f"\\set node random(0, {count - 1})\n{sql} \\gset\n"


@dataclass
class Pgbench:
    """pgbench running the heartbeat script against one server, one phase at a time."""

    url: str
    instance: str
    count: int
    workdir: Path
    pid: int  # the server's

    def start(self, phase: Phase, seconds: int) -> subprocess.Popen[str]:
        """Closed loop, or at phase.target_rate/s; one log line per transaction."""
        script = self.workdir / "heartbeat.sql"
        script.write_text(heartbeat_script(self.count))
        log = re.sub(r"[^a-z0-9]+", "-", f"{phase.name} {phase.connections}")
        argv = [str(PGBENCH), "-n", "-M", "prepared", "-f", str(script), "-D",
                f"instance={self.instance}", "-c", str(phase.connections),
                "-j", str(min(PGBENCH_THREADS, phase.connections)), "-T", str(seconds), "--log",
                f"--log-prefix={self.workdir / log}"]  # fmt: skip
        if phase.target_rate is not None:
            argv += ["-R", f"{phase.target_rate:.3f}"]
        return subprocess.Popen([*argv, self.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=self.workdir)  # fmt: skip

    def finish(self, popen: subprocess.Popen[str], phase: Phase, seconds: int) -> Phase:
        """Wait for pgbench and read its per-transaction logs: client_id, transaction_no,
        latency (us), script_no, completion time (s, us)[, schedule lag]."""
        _, stderr = popen.communicate(timeout=seconds + SETUP_TIMEOUT)
        log = re.sub(r"[^a-z0-9]+", "-", f"{phase.name} {phase.connections}")
        for path in sorted(self.workdir.glob(f"{log}.*")):
            for line in path.read_text().splitlines():
                f = line.split()
                phase.done.append((int(f[4]) * 1_000_000_000 + int(f[5]) * 1000, int(f[2]) * 1000))
            path.unlink()
        phase.wall_seconds = float(seconds)
        phase.errors += [
            x.strip() for x in stderr.splitlines() if "aborted" in x or "error" in x.lower()
        ]
        if popen.returncode not in (0, 2) or (popen.returncode == 2 and not phase.errors):
            phase.errors.append(f"pgbench exited with {popen.returncode}: {stderr.strip()[-300:]}")
        return phase

    def phase(self, name: str, connections: int, seconds: int, rate: float | None = None) -> Phase:
        meter = _meter(self.pid, children=True)
        phase = Phase(name, connections, rate)
        self.finish(self.start(phase, seconds), phase, seconds)
        phase.cpu = meter.spent()
        return phase


# --- queries -----------------------------------------------------------------------------


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
        return {f"gen{g}": {"collections": len(p), "total_ms": round(sum(p) / 1e6, 1),
                            "max_ms": round(max(p) / 1e6, 1) if p else None}
                for g, p in self.pauses_ns.items()}  # fmt: skip


async def _queries(
    registry: AsyncpgRegistry, profiles: Sequence[NodeProfile], repeats: int, load: str
) -> list[dict[str, Any]]:
    """Each requirement set `repeats` times through eligible(), then nodes(liveness=online).
    Idle, every row's last_heartbeat is moved to now() before each set, so all nodes are
    live; under the paced load they stay live."""
    cases: list[tuple[str, Callable[[], Awaitable[Sequence[Any]]], set[str]]] = [
        (label, functools.partial(registry.eligible, r),
         {p.node_id for p in profiles if not match_requirements(r, p)})
        for label, r in QUERIES.items()
    ]  # fmt: skip
    cases.append((NODES_QUERY, functools.partial(registry.nodes, liveness="online", limit=NODES),
                  {p.node_id for p in profiles}))  # fmt: skip
    results = []
    for label, call, expected in cases:
        if load == "idle":
            await _refresh(registry)
        latencies: list[int] = []
        counts: set[int] = set()
        found: set[str] = set()
        for i in range(repeats):
            began = time.perf_counter_ns()
            nodes = await call()
            latencies.append(time.perf_counter_ns() - began)
            counts.add(len(nodes))
            if i == 0:
                found = {
                    n.node_id if isinstance(n, NodeProfile) else str(n["node_id"]) for n in nodes
                }
        results.append({
            "query": label, "load": load, "repeats": repeats,
            "rows": min(counts) if len(counts) == 1 else -1, "expected_rows": len(expected),
            "same_nodes": found == expected, "latency_ms": latency_ms(sorted(latencies)),
            "server_execution_ms": None, "scans": "-",
        })  # fmt: skip
    return results


async def _refresh(registry: AsyncpgRegistry) -> None:
    await registry.pool.execute(
        "UPDATE worker_capabilities SET last_heartbeat = now(), status = 'online'",
        timeout=SETUP_TIMEOUT,
    )


def _bind(label: str) -> tuple[str, list[Any]]:
    """The statement and bind parameters the adapter sends for a query of the table."""
    if label == NODES_QUERY:
        return registry_sql._NODES, [None, "online", None, NODES]
    r = QUERIES[label]
    hw = r.hardware
    tiers = [t.value for t in r.tier] if r.tier is not None else None
    return registry_sql._ELIGIBLE, [tiers, r.region, r.trust_zone, r.capabilities or None,
                                    hw.gpu, hw.min_memory_gb, hw.min_cpu_count, None]  # fmt: skip


async def _fetch(registry: AsyncpgRegistry, sql: str, *args: Any) -> list[Any]:
    async with registry.pool.acquire() as conn:
        return list(await conn.fetch(sql, *args, timeout=SETUP_TIMEOUT))


async def _explain(registry: AsyncpgRegistry, label: str, how: str) -> list[str]:
    sql, args = _bind(label)
    return [str(r[0]) for r in await _fetch(registry, f"EXPLAIN ({how}) {sql}", *args)]


_SCAN = re.compile(r"(Seq Scan|Bitmap Index Scan|Index Only Scan|Index Scan)(?: using (\S+))?")
_SCAN_NAMES = {"Seq Scan": "seq", "Bitmap Index Scan": "bitmap", "Index Only Scan": "index-only",
               "Index Scan": "index"}  # fmt: skip


async def _server_ms(registry: AsyncpgRegistry, label: str) -> tuple[float | None, str]:
    """Median execution time inside PostgreSQL (EXPLAIN ANALYZE without per-node timing),
    and the scans of the last plan in short: "seq", "bitmap capabilities", "index tier"."""
    times, plan = [], []
    for _ in range(EXPLAIN_RUNS):
        plan = await _explain(registry, label, "ANALYZE, TIMING OFF")
        times += [float(m[1]) for x in plan if (m := re.search(r"Execution Time: ([0-9.]+)", x))]
    scans = []
    for line in plan:
        if match := _SCAN.search(line):
            index = match[2] or (line.split(" on ", 1)[1].split()[0] if "Bitmap" in line else "")
            index = index.removeprefix("idx_worker_capabilities_")
            scans.append(f"{_SCAN_NAMES[match[1]]} {index}".strip())
    return (round(statistics.median(times), 3) if times else None), " + ".join(scans) or "-"


async def _plan_choices(registry: AsyncpgRegistry) -> dict[str, Any]:
    """Generic vs custom plans of the adapter's own prepared statements, on its connection."""
    rows = await _fetch(registry, "SELECT statement, generic_plans, custom_plans FROM "
                        "pg_prepared_statements WHERE statement NOT LIKE 'EXPLAIN%'")  # fmt: skip
    keys = {"eligible_workers(": "eligible", "worker_liveness_now": "nodes"}
    return {
        key: {"generic_plans": r["generic_plans"], "custom_plans": r["custom_plans"]}
        for r in rows
        for marker, key in keys.items()
        if marker in str(r["statement"])
    }


async def _table_stats(registry: AsyncpgRegistry) -> dict[str, Any]:
    await _fetch(registry, "SELECT pg_stat_force_next_flush()")
    rows = await _fetch(
        registry, "SELECT n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, autovacuum_count, "
        "autoanalyze_count, pg_table_size(relid) AS table_bytes, pg_indexes_size(relid) AS "
        "index_bytes FROM pg_stat_user_tables WHERE relname = 'worker_capabilities'")  # fmt: skip
    indexes = await _fetch(
        registry, "SELECT indexrelname, pg_relation_size(indexrelid) AS bytes FROM "
        "pg_stat_user_indexes WHERE relname = 'worker_capabilities' ORDER BY 1")  # fmt: skip
    stats = dict(rows[0]) if rows else {}
    stats["index_bytes_each"] = {str(r["indexrelname"]): int(r["bytes"]) for r in indexes}
    return stats


# --- one server --------------------------------------------------------------------------


async def _measure(
    server: EmbeddedPostgres,
    label: str,
    profiles: Sequence[NodeProfile],
    setup: dict[str, Any],
    workdir: Path,
) -> dict[str, Any]:
    """Everything on one server, as its JSON summary."""
    url, pid, repeats = server.url, server.pid, setup["query_repeats"]
    assert pid is not None
    failures: list[str] = []
    required = len(profiles) / INTERVAL_SECONDS
    beats = AsyncpgRegistry(url, timeout=TIMEOUT, max_connections=max(CONNECTIONS))
    # One connection for queries and bookkeeping: its prepared statements can be inspected.
    reader = AsyncpgRegistry(url, timeout=SETUP_TIMEOUT, max_connections=1)
    await beats.open()
    await reader.open()
    try:
        rows = await _fetch(reader, "SELECT name, setting, source FROM pg_settings WHERE "
                            "name = ANY($1::text[])", list(SETTINGS))  # fmt: skip
        settings = {str(r["name"]): f"{r['setting']} ({r['source']})" for r in rows}
        settings["server_version"] = str(await reader.pool.fetchval("SHOW server_version"))
        if not settings["fsync"].startswith(label.split("=", 1)[1] + " "):
            failures.append(f"server runs with fsync {settings['fsync']}, wanted {label}")
        applied = await migrating.migrate(reader, MIGRATIONS)
        if len(applied) != (files := len(list(MIGRATIONS.glob("*.sql")))):
            failures.append(f"{len(applied)} migrations applied to a fresh database, {files} files")

        _say(f"{label}: registering {len(profiles)} nodes")
        register = await _register(beats, profiles, pid)
        registered = await reader.pool.fetchval("SELECT count(*) FROM worker_capabilities")
        if registered != len(profiles):
            failures.append(f"registration: {registered} rows for {len(profiles)} nodes")
        await reader.pool.execute("ANALYZE worker_capabilities")
        after_register = await _table_stats(reader)

        _say(f"{label}: warm-up {setup['warmup_seconds']:g} s, then heartbeats (pgbench)")
        pgbench = Pgbench(url, beats.instance, len(profiles), workdir, pid)
        seconds, wide = max(1, round(setup["duration_seconds"])), max(CONNECTIONS)
        warmup = max(1, round(setup["warmup_seconds"]))
        await asyncio.to_thread(pgbench.phase, "warm-up", wide, warmup)
        phases = [await asyncio.to_thread(pgbench.phase, "heartbeat, closed loop", c, seconds)
                  for c in CONNECTIONS]  # fmt: skip
        paced = f"heartbeat, paced {required:.0f}/s"
        phases.append(await asyncio.to_thread(pgbench.phase, paced, wide, seconds, required))

        _say(f"{label}: queries, idle")
        began = time.monotonic()
        with GcWatch() as idle_gc:
            idle = await _queries(reader, profiles, repeats, "idle")
        idle_seconds = time.monotonic() - began
        await _refresh(reader)
        plan = await _explain(reader, EXPLAINED, "ANALYZE, BUFFERS")
        for result in idle:
            result["server_execution_ms"], result["scans"] = await _server_ms(
                reader, result["query"]
            )
        plans = await _plan_choices(reader)

        _say(f"{label}: queries under the paced heartbeat load")
        await _refresh(reader)  # every node live for 2 intervals from here, beats or not
        # the paced load outlasts the queries: twice what they took idle, at least `duration`
        loaded_seconds = max(seconds, math.ceil(2 * idle_seconds) + 2)
        both = Phase(f"{paced} + queries", wide, required)
        with GcWatch() as loaded_gc:
            meter = _meter(pid, children=True)
            popen = await asyncio.to_thread(pgbench.start, both, loaded_seconds)
            loaded = await _queries(reader, profiles, repeats, f"{required:.0f} beats/s")
            if popen.poll() is not None:
                failures.append("the queries under load outlasted the paced pgbench run")
            await asyncio.to_thread(pgbench.finish, popen, both, loaded_seconds)
            both.cpu = meter.spent()
        phases.append(both)
        final = await _table_stats(reader)
    finally:
        await reader.close()
        await beats.close()

    for phase in [register, *phases]:
        if phase.errors or phase.missing:
            failures.append(
                f"{phase.name} ({phase.connections} conns): {len(phase.errors)} errors, "
                f"{phase.missing} heartbeats found no row {phase.errors[:5]}"
            )
        if phase.short():
            rate = len(phase.done) / phase.wall_seconds
            failures.append(f"{phase.name}: achieved {rate:.1f}/s of {phase.target_rate}/s paced")
    for r in [*idle, *loaded]:
        if r["rows"] != r["expected_rows"] or not r["same_nodes"] or r["rows"] <= 0:
            other = "" if r["same_nodes"] else ", different nodes"
            expected = f"expected {r['expected_rows']}{other}"
            failures.append(f"{r['query']} ({r['load']}): {r['rows']} rows, {expected}")
    return {
        "settings": settings, "register": register.summary(required),
        "heartbeats": [p.summary(required) for p in phases], "queries": [*idle, *loaded],
        "explain": {"query": EXPLAINED, "plan": plan}, "plan_choices": plans,
        "query_gc_pauses": {"idle": idle_gc.summary(), "loaded": loaded_gc.summary()},
        "table_after_register": after_register, "table_at_end": final, "failures": failures,
    }  # fmt: skip


# --- report ------------------------------------------------------------------------------


def _tables(servers: dict[str, dict[str, Any]], setup: dict[str, Any]) -> list[dict[str, Any]]:
    count, required = setup["nodes"], setup["required_heartbeats_per_second"]
    loads = [
        [label, p["phase"], p["connections"], p["completed"], p["per_second"],
         None if p["phase"] == REGISTER else p["times_required"], p["worst_second"],
         *p["latency_ms"].values(), p["errors"] + p["missing_rows"], p["client_cpu_percent"],
         p["server_cpu_percent"], p["other_cpu_percent"], p["steal_percent"]]
        for label, s in servers.items() for p in [s["register"], *s["heartbeats"]]
    ]  # fmt: skip
    queries = [
        [label, q["load"], q["query"], f"{q['rows']}" + ("" if q["rows"] == q["expected_rows"]
         and q["same_nodes"] else f" (expected {q['expected_rows']})"), *q["latency_ms"].values(),
         q["server_execution_ms"], q["scans"] if q["load"] == "idle" else ""]
        for label, s in servers.items() for q in s["queries"]
    ]  # fmt: skip
    per_server = []
    for label, s in servers.items():
        start, end = s["table_after_register"], s["table_at_end"]
        updates = (end.get("n_tup_upd") or 0) - (start.get("n_tup_upd") or 0)
        hot = (end.get("n_tup_hot_upd") or 0) - (start.get("n_tup_hot_upd") or 0)
        idle = [q for q in s["queries"] if q["load"] == "idle"]
        plans = s["plan_choices"].get("eligible", {})
        gc2 = s["query_gc_pauses"]["idle"]["gen2"]
        per_server.append([
            label, f"{updates:,} ({percent(hot, updates):.0f} % HOT)",
            f"{mib(start.get('table_bytes', 0))} -> {mib(end.get('table_bytes', 0))}",
            f"{mib(start.get('index_bytes', 0))} -> {mib(end.get('index_bytes', 0))}",
            end.get("n_dead_tup", 0), end.get("autovacuum_count", 0),
            ", ".join(q["query"] for q in idle if "capabilities" in q["scans"]) or "none",
            f"{plans.get('custom_plans', '?')} / {plans.get('generic_plans', '?')}",
            f"{cell(idle[0]['latency_ms']['p50'], '.2f')} / "
            f"{cell(idle[0]['server_execution_ms'], '.2f')}",
            f"{gc2['collections']}, {gc2['total_ms']} ms, max {gc2['max_ms']} ms",
        ])  # fmt: skip
    first = next(iter(servers.values()))["settings"]
    return [
        table(f"Registration and heartbeats: {count:,} nodes, one beat each per "
              f"{INTERVAL_SECONDS} s = {required:.0f}/s required",
              "server|phase|conns|ops|ops/s{,.0f}|x req{.1f}|worst 1 s|p50 ms{.2f}|p99 ms{.2f}|"
              "max ms{.2f}|errors|client CPU%{.0f}|server CPU%{.0f}|other CPU%{.0f}|steal %{.0f}",
              loads),
        table(f"'Live nodes that can run X' at {count:,} nodes: AsyncpgRegistry.eligible()",
              "server|load|requirements|rows|p50 ms{.2f}|p99 ms{.2f}|max ms{.2f}|server ms{.2f}|"
              "scans", queries),
        table("worker_capabilities after registration -> at the end; the idle queries",
              "server|row updates|table MiB|indexes MiB|dead rows{,}|autovacuums|GIN index in "
              "plan of|eligible plans custom / generic|'none' p50 ms client / server|full GC "
              "(idle queries)", per_server),
        table("pg_settings", ["setting", *servers],
              [[k, *(s["settings"].get(k) for s in servers.values())] for k in first]),
        table(f"pg_test_fsync: one 8 kB write, data directories on {setup['data_filesystem']}",
              "wal_sync_method|ops/s{,}|us/op",
              [[m, v["per_second"], v["usecs_per_op"]]
               for m, v in setup["fsync_8k"]["one_8k_write"].items()]),
    ]  # fmt: skip


def _notes(
    servers: dict[str, dict[str, Any]], setup: dict[str, Any], failures: list[str]
) -> list[str]:
    label, first = next(iter(servers.items()))
    plan: list[str] = first["explain"]["plan"]
    inlined = not any("Function Scan" in line for line in plan)
    return [
        *([f"FAILED: {f}" for f in failures] or [
            "verified: every upsert landed, no heartbeat errored or missed its row, the paced "
            "phases kept their rate, and every query returned exactly the nodes the Python "
            "matcher (match_requirements) picks"]),
        *noisy({f"{name} {p['phase']} ({p['connections']} conns)": p["other_cpu_percent"]
                for name, s in servers.items() for p in [s["register"], *s["heartbeats"]]
                if "+ queries" not in p["phase"]}, NOISY_OTHER_CPU_PERCENT),
        f"the real fleet holds at least {setup['nodes']:,} connections against max_connections "
        f"= {first['settings'].get('max_connections', '?')} here: a pooler (PgBouncer) is "
        "needed at that size; production runs with fsync on: plan with the fsync=on rows",
        f"EXPLAIN (ANALYZE, BUFFERS) of the adapter's eligible query for '{EXPLAINED}', idle, "
        f"{label}: eligible_workers() and worker_liveness() "
        f"{'are inlined into the query' if inlined else 'are NOT inlined (Function Scan)'}; "
        "top lines:\n    " + "\n    ".join(line[:160] for line in plan[:EXPLAIN_LINES]),
    ]  # fmt: skip
