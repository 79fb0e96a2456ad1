"""The registry benchmark: 10,000 simulated nodes heartbeating every 30 s against one PostgreSQL.

Nodes register through AsyncpgRegistry.upsert; pgbench runs the adapter's heartbeat statement
closed loop and paced at nodes / 30 s; eligible() and nodes() are timed idle and under the
paced load, beside PostgreSQL's own execution time. On EmbeddedPostgres (fsync=off) and with
fsync=on. CPU% is per process (100 = one core); other CPU% is the rest of the machine.
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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from app.adapters import registry as sql
from app.adapters.embedded import EmbeddedError, EmbeddedPostgres
from app.adapters.registry import AsyncpgRegistry, RegistryUnavailable
from app.domain.requirements import HardwareRequirements as Hardware
from app.domain.requirements import NodeProfile, Requirements, Tier, match_requirements
from app.services import migrating
from bench import Options, proc
from bench.report import Json, cell, latency_ms, mib, noisy, percent, say, table

NAME = "registry"
DESCRIPTION = "capability registry on PostgreSQL: heartbeat rate and eligible-node query latency"
_say = functools.partial(say, NAME)

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
PGBENCH, PG_TEST_FSYNC = EmbeddedPostgres._bin("pgbench"), EmbeddedPostgres._bin("pg_test_fsync")
INTERVAL_SECONDS = 30  # every node heartbeats this often: the load to carry is nodes / 30 per s
CONNECTIONS = (8, 32)  # closed-loop heartbeat phases; the registration uses 8
PACED_SIGMAS = 4  # pgbench -R draws Poisson arrivals: the count may fall this many sigma short
REGISTER, SEED, TIMEOUT = "register (upsert)", 20_250_611, 5.0  # the manager's DB timeout
NOISY_OTHER_CPU_PERCENT = 15.0  # above this, say the phase ran on a busy machine
SETTINGS = ["fsync", "synchronous_commit", "wal_sync_method", "full_page_writes",
            "shared_buffers", "max_connections", "plan_cache_mode", "autovacuum"]  # fmt: skip
CAPABILITIES = {"embeddings": 0.45, "inference": 0.35, "scraping": 0.3, "transcoding": 0.15,
                "training": 0.1, "ocr": 0.2, "storage": 0.25}  # fmt: skip
QUERIES: dict[str, Requirements] = {
    "none": Requirements(), "tier A": Requirements(tier=[Tier.A]),
    "tier A + eu-west + embeddings": Requirements(tier=[Tier.A], region="eu-west",
                                                  capabilities=["embeddings"]),
    "gpu + >= 64 GB": Requirements(hardware=Hardware(gpu=True, min_memory_gb=64)),
    "zone z1 + embeddings,inference": Requirements(trust_zone="z1",
                                                   capabilities=["embeddings", "inference"]),
}  # fmt: skip
EXPLAINED = "zone z1 + embeddings,inference"  # the one that can use the GIN index
NODES_QUERY = "nodes(liveness=online)"


def run(options: Options) -> Json:
    count = 1_000 if options.quick else 10_000
    pgbench = subprocess.run([PGBENCH, "--version"], capture_output=True, text=True).stdout
    setup: Json = {
        "nodes": count,
        "required_heartbeats_per_second": round(count / INTERVAL_SECONDS, 1),
        "client": f"{pgbench.strip() or 'pgbench'}; asyncpg, Python {sys.version.split()[0]}",
    }
    profiles, servers = make_profiles(count, SEED), {}
    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp:
        workdir = Path(tmp)
        where = f"{workdir.resolve()}/"
        mounts = [p for p in psutil.disk_partitions(all=True)
                  if where.startswith(p.mountpoint.rstrip("/") + "/")]  # fmt: skip
        best = max(mounts, key=lambda p: len(p.mountpoint))
        setup["data_filesystem"] = f"{best.fstype} ({best.device} on {best.mountpoint})"
        setup["fsync_8k"] = test_fsync(workdir, 1 if options.quick else 2)
        for label, server_class in (("fsync=off", EmbeddedPostgres), ("fsync=on", FsyncOnPostgres)):
            _say(f"{label}: starting PostgreSQL")
            server = server_class(data_dir=workdir / label.replace("=", "-"))
            server.start()
            try:
                servers[label] = asyncio.run(_measure(server, label, profiles, options, workdir))
            finally:
                server.stop()
    failures = [f"{label}: {f}" for label, s in servers.items() for f in s["failures"]]
    tables, notes = _tables(servers, setup), _notes(servers, setup, failures)
    return {"setup": setup, "servers": servers, "failures": failures, "tables": tables,
            "notes": notes}  # fmt: skip


class FsyncOnPostgres(EmbeddedPostgres):
    """EmbeddedPostgres with `-c fsync=on`: a command-line setting beats ALTER SYSTEM."""

    def _launch(self, what: str, argv: list[str], **popen: Any) -> None:
        if "fsync=off" not in argv:
            raise EmbeddedError(f"no fsync=off in the server's command line to replace: {argv}")
        super()._launch(what, ["fsync=on" if a == "fsync=off" else a for a in argv], **popen)


def test_fsync(directory: Path, seconds: int) -> Json:
    """pg_test_fsync: ops/s and us/op of each wal_sync_method for one 8 kB write."""
    done = subprocess.run(
        [str(PG_TEST_FSYNC), "-s", str(seconds), "-f", str(directory / "pg_test_fsync.out")],
        capture_output=True, text=True, timeout=60 + 20 * seconds)  # fmt: skip
    section = done.stdout.split("using one 8kB write:", 1)[-1].split("\n\n", 1)[0]
    pattern = r"^\s+(\w+)\s+([0-9.]+) ops/sec\s+(\d+) usecs/op"
    methods = {m[1]: {"per_second": round(float(m[2])), "usecs_per_op": int(m[3])}
               for m in re.finditer(pattern, section, re.M)}  # fmt: skip
    if not methods:
        raise RuntimeError(f"pg_test_fsync printed no results: {done.stdout[-300:]}{done.stderr}")
    return {"tool": "pg_test_fsync", "seconds_per_test": seconds, "one_8k_write": methods}


def make_profiles(count: int, seed: int) -> list[NodeProfile]:
    """Nodes with varied tier, region, trust zone, hardware and capabilities; deterministic."""
    rng, profiles = random.Random(seed), []
    for i in range(count):
        gpu = rng.random() < 0.15
        hardware: Json = {
            "gpu": gpu,
            "memory_gb": rng.choice((8, 16, 32, 64, 128) if gpu else (2, 4, 8, 16, 32, 64)),
            "cpu_count": rng.choice((2, 4, 8, 16, 32)),
            "arch": rng.choice(("x86_64", "x86_64", "x86_64", "aarch64")),
        }  # fmt: skip
        if rng.random() < 0.02:  # nodes whose fingerprint failed register without hardware
            hardware = {}
        capabilities = {c for c, odds in CAPABILITIES.items() if rng.random() < odds}
        capabilities |= {"gpu"} if hardware.get("gpu") else set()  # as the heartbeat derives it
        profiles.append(NodeProfile(
            node_id=f"node-{i:05d}", tier=rng.choices((Tier.A, Tier.B, Tier.C), (20, 50, 30))[0],
            region=rng.choices(("eu-west", "eu-central", "us-east", "us-west", "ap-south", None),
                               (30, 15, 25, 15, 10, 5))[0],
            trust_zone=rng.choices(("z1", "z2", "z3", None), (40, 30, 20, 10))[0],
            hardware=hardware, capabilities=sorted(capabilities),
        ))  # fmt: skip
    return profiles


@dataclass
class Phase:
    """Completions, errors and CPU of one load phase."""

    name: str
    connections: int
    target_rate: float | None = None
    done: list[tuple[int, int]] = field(default_factory=list)  # (completed at, latency), ns
    errors: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # client, server, busy, steal seconds

    def short(self) -> bool:
        """Fewer beats than a Poisson schedule at the target rate gives but for bad luck."""
        expected = (self.target_rate or 0) * self.wall_seconds
        done = len(self.done)
        return self.target_rate is not None and done < expected - PACED_SIGMAS * math.sqrt(expected)

    def summary(self, required_rate: float) -> Json:
        start = min((at - latency for at, latency in self.done), default=0)
        per_second = Counter((at - start) // 1_000_000_000 for at, _ in self.done)
        wall, cpu = self.wall_seconds, self.cpu
        rate, full = len(self.done) / max(wall, 1e-9), int(wall)
        out = {
            "phase": self.name, "connections": self.connections, "completed": len(self.done),
            "wall_seconds": round(wall, 3), "per_second": round(rate, 1),
            "times_required": round(rate / required_rate, 2),
            "worst_second": min(per_second[s] for s in range(full)) if full >= 1 else None,
            "latency_ms": latency_ms(sorted(latency for _, latency in self.done)),
            "errors": len(self.errors), "first_errors": self.errors[:5], "missing_rows": 0,
            "client_cpu_percent": percent(cpu["client"], wall),
            "server_cpu_percent": percent(cpu["server"], wall),
            "other_cpu_percent": percent(max(0.0, cpu["busy"] - cpu["client"] - cpu["server"]),
                                         wall),
            "steal_percent": percent(cpu["steal"], wall),
        }  # fmt: skip
        if self.target_rate is not None:
            out |= {"target_rate": round(self.target_rate, 1), "latency_from": "scheduled send "
                    "time", "sent": len(self.done) + len(self.errors)}  # fmt: skip
        return out


def _meter(server_pid: int, *, children: bool) -> proc.Meter:
    """CPU of the client (this process or pgbench), PostgreSQL, the machine (busy, steal)."""
    return proc.Meter(client=proc.children_cpu if children else time.process_time,
                      server=lambda: proc.cpu_seconds(server_pid, tree=True),
                      busy=lambda: proc.machine_busy()[0],
                      steal=lambda: proc.machine_busy()[1])  # fmt: skip


def _pgbench(url: str, instance: str, count: int, workdir: Path, phase: Phase,
             seconds: int) -> subprocess.Popen[str]:  # fmt: skip
    """pgbench: the adapter's heartbeat for a random node, closed loop or at phase.target_rate/s,
    logging each transaction; `\\gset` fails a client whose node had no row."""
    heartbeat = " ".join(sql._HEARTBEAT.split())
    for parameter, value in (("$1", "'node-' || lpad(:node::text, 5, '0')"), ("$2", "'online'"),
                             ("$3", ":instance")):  # fmt: skip
        if parameter not in heartbeat:
            raise RuntimeError(f"no {parameter} in the adapter's heartbeat statement: {heartbeat}")
        heartbeat = heartbeat.replace(parameter, value)
    script = workdir / "heartbeat.sql"
    script.write_text(f"\\set node random(0, {count - 1})\n{heartbeat} \\gset\n")
    rate = ["-R", f"{phase.target_rate:.3f}"] if phase.target_rate else []
    argv = [str(PGBENCH), "-n", "-M", "prepared", "-f", str(script), "-D", f"instance={instance}",
            "-c", str(phase.connections), "-j", str(min(2, phase.connections)), "-T", str(seconds),
            "--log", f"--log-prefix={workdir / _log(phase)}", *rate, url]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=workdir)  # fmt: skip


def _log(phase: Phase) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{phase.name} {phase.connections}")


def _finish(popen: subprocess.Popen[str], workdir: Path, phase: Phase, seconds: int) -> None:
    """Wait for pgbench and read its per-transaction logs into `phase`: latency (us) and
    completion time (s, us) are the 3rd, 5th and 6th columns."""
    _, stderr = popen.communicate(timeout=seconds + 60)
    for path in sorted(workdir.glob(f"{_log(phase)}.*")):
        for f in (line.split() for line in path.read_text().splitlines()):
            phase.done.append((int(f[4]) * 1_000_000_000 + int(f[5]) * 1000, int(f[2]) * 1000))
        path.unlink()
    phase.wall_seconds = float(seconds)
    phase.errors += [
        x.strip() for x in stderr.splitlines() if "aborted" in x or "error" in x.lower()
    ]
    if popen.returncode not in (0, 2) or (popen.returncode == 2 and not phase.errors):
        phase.errors.append(f"pgbench exited with {popen.returncode}: {stderr.strip()[-300:]}")


async def _refresh(registry: AsyncpgRegistry) -> None:
    """Every node live (for 2 intervals from now)."""
    await registry.pool.execute("UPDATE worker_capabilities SET last_heartbeat = now(), "
                                "status = 'online'", timeout=60)  # fmt: skip


@contextmanager
def _gc_pauses() -> Iterator[Json]:
    """Python's garbage-collector pauses in this process meanwhile, by generation. What exists
    at the start (the simulated fleet, the expectations) is frozen, never rescanned."""
    pauses: dict[int, list[int]] = {0: [], 1: [], 2: []}
    began = [0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter_ns()
        else:
            pauses[info["generation"]].append(time.perf_counter_ns() - began[0])

    summary: Json = {}
    gc.collect()
    gc.freeze()
    gc.callbacks.append(callback)
    try:
        yield summary
    finally:
        gc.callbacks.remove(callback)
        gc.unfreeze()
        summary |= {f"gen{g}": {"collections": len(p), "total_ms": round(sum(p) / 1e6, 1),
                                "max_ms": round(max(p) / 1e6, 1) if p else None}
                    for g, p in pauses.items()}  # fmt: skip


async def _queries(registry: AsyncpgRegistry, profiles: Sequence[NodeProfile], repeats: int,
                   load: str) -> list[Json]:  # fmt: skip
    """eligible() per requirement set, then nodes(), `repeats` times; checked by the matcher."""
    cases: list[tuple[str, Callable[[], Awaitable[Sequence[Any]]], set[str]]] = [
        (label, functools.partial(registry.eligible, r),
         {p.node_id for p in profiles if not match_requirements(r, p)})
        for label, r in QUERIES.items()
    ]  # fmt: skip
    nodes = functools.partial(registry.nodes, liveness="online", limit=10_000)
    cases.append((NODES_QUERY, nodes, {p.node_id for p in profiles}))
    results = []
    for label, call, expected in cases:
        if load == "idle":  # nothing else keeps the nodes live
            await _refresh(registry)
        latencies: list[int] = []
        counts: set[int] = set()
        found: set[str] = set()
        for i in range(repeats):
            began = time.perf_counter_ns()
            got = await call()
            latencies.append(time.perf_counter_ns() - began)
            counts.add(len(got))
            if i == 0:
                found = {getattr(n, "node_id", None) or str(n["node_id"]) for n in got}
        results.append({"query": label, "load": load, "repeats": repeats,
                        "rows": min(counts) if len(counts) == 1 else -1,
                        "expected_rows": len(expected), "same_nodes": found == expected,
                        "latency_ms": latency_ms(sorted(latencies)),
                        "server_execution_ms": None, "scans": "-"})  # fmt: skip
    return results


async def _fetch(registry: AsyncpgRegistry, statement: str, *args: Any) -> list[Any]:
    async with registry.pool.acquire() as conn:
        return list(await conn.fetch(statement, *args, timeout=60))


async def _explain(registry: AsyncpgRegistry, label: str, how: str) -> list[str]:
    """EXPLAIN (how) of the statement and bind parameters the adapter sends for a query."""
    args: list[Any]
    statement, args = sql._NODES, [None, "online", None, 10_000]
    if label != NODES_QUERY:
        r, hw = QUERIES[label], QUERIES[label].hardware
        statement, args = sql._ELIGIBLE, [[t.value for t in r.tier] if r.tier else None,
                                          r.region, r.trust_zone, r.capabilities or None, hw.gpu,
                                          hw.min_memory_gb, hw.min_cpu_count, None]  # fmt: skip
    return [str(r[0]) for r in await _fetch(registry, f"EXPLAIN ({how}) {statement}", *args)]


_SCAN = re.compile(r"(Seq Scan|Bitmap Index Scan|Index Only Scan|Index Scan)(?: using (\S+))?")
_SCANS = {"Seq Scan": "seq", "Bitmap Index Scan": "bitmap", "Index Only Scan": "index-only",
          "Index Scan": "index"}  # fmt: skip


async def _server_ms(registry: AsyncpgRegistry, label: str) -> tuple[float | None, str]:
    """Median execution time inside PostgreSQL (EXPLAIN ANALYZE without per-node timing),
    and the scans of the last plan in short: "seq", "bitmap capabilities", "index tier"."""
    times, plan, scans = [], [], []
    for _ in range(5):
        plan = await _explain(registry, label, "ANALYZE, TIMING OFF")
        times += [float(m[1]) for x in plan if (m := re.search(r"Execution Time: ([0-9.]+)", x))]
    for line in plan:
        if match := _SCAN.search(line):
            index = match[2] or (line.split(" on ", 1)[1].split()[0] if "Bitmap" in line else "")
            index = index.removeprefix("idx_worker_capabilities_")
            scans.append(f"{_SCANS[match[1]]} {index}".strip())
    return (round(statistics.median(times), 3) if times else None), " + ".join(scans) or "-"


async def _table_stats(registry: AsyncpgRegistry) -> Json:
    await _fetch(registry, "SELECT pg_stat_force_next_flush()")
    rows = await _fetch(
        registry, "SELECT n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, autovacuum_count, "
        "autoanalyze_count, pg_table_size(relid) AS table_bytes, pg_indexes_size(relid) AS "
        "index_bytes FROM pg_stat_user_tables WHERE relname = 'worker_capabilities'")  # fmt: skip
    indexes = await _fetch(
        registry, "SELECT indexrelname, pg_relation_size(indexrelid) AS bytes FROM "
        "pg_stat_user_indexes WHERE relname = 'worker_capabilities' ORDER BY 1")  # fmt: skip
    return (dict(rows[0]) if rows else {}) | {
        "index_bytes_each": {str(r["indexrelname"]): int(r["bytes"]) for r in indexes}
    }


async def _measure(server: EmbeddedPostgres, label: str, profiles: Sequence[NodeProfile],
                   options: Options, workdir: Path) -> Json:  # fmt: skip
    """Everything on one server, as its JSON summary."""
    url, pid, count = server.url, server.pid or 0, len(profiles)
    repeats = 30 if options.quick else 200
    failures: list[str] = []
    required = count / INTERVAL_SECONDS
    beats = AsyncpgRegistry(url, timeout=TIMEOUT, max_connections=max(CONNECTIONS))
    # One connection for queries and bookkeeping: its prepared statements can be inspected.
    reader = AsyncpgRegistry(url, timeout=60, max_connections=1)
    await beats.open()
    await reader.open()
    try:
        rows = await _fetch(reader, "SELECT name, setting, source FROM pg_settings WHERE "
                            "name = ANY($1::text[])", SETTINGS)  # fmt: skip
        settings = {str(r["name"]): f"{r['setting']} ({r['source']})" for r in rows}
        settings["server_version"] = str(await reader.pool.fetchval("SHOW server_version"))
        if not settings["fsync"].startswith(label.split("=", 1)[1] + " "):
            failures.append(f"server runs with fsync {settings['fsync']}, wanted {label}")
        applied = await migrating.migrate(reader, MIGRATIONS)
        if len(applied) != (files := len(list(MIGRATIONS.glob("*.sql")))):
            failures.append(f"{len(applied)} migrations applied to a fresh database, {files} files")

        _say(f"{label}: registering {count} nodes, then heartbeats (pgbench)")
        register, todo = Phase(REGISTER, CONNECTIONS[0]), iter(profiles)

        async def upsert() -> None:
            for profile in todo:  # the workers share one iterator: each profile is sent once
                began = time.perf_counter_ns()
                try:
                    await beats.upsert(profile, status="online", interval_seconds=INTERVAL_SECONDS)
                except RegistryUnavailable as exc:
                    register.errors.append(f"{type(exc).__name__}: {exc}")
                else:
                    done = time.perf_counter_ns()
                    register.done.append((done, done - began))

        meter, started = _meter(pid, children=False), time.perf_counter()
        await asyncio.gather(*(upsert() for _ in range(CONNECTIONS[0])))
        register.wall_seconds, register.cpu = time.perf_counter() - started, meter.spent()
        registered = await reader.pool.fetchval("SELECT count(*) FROM worker_capabilities")
        if registered != count:
            failures.append(f"registration: {registered} rows for {count} nodes")
        await reader.pool.execute("ANALYZE worker_capabilities")
        after_register = await _table_stats(reader)

        def pgbench(name: str, connections: int, seconds: int, rate: float | None = None) -> Phase:
            phase, meter = Phase(name, connections, rate), _meter(pid, children=True)
            popen = _pgbench(url, beats.instance, count, workdir, phase, seconds)
            _finish(popen, workdir, phase, seconds)
            phase.cpu = meter.spent()
            return phase

        seconds, wide = max(1, round(options.duration)), max(CONNECTIONS)
        paced = f"heartbeat, paced {required:.0f}/s"
        await asyncio.to_thread(pgbench, "warm-up", wide, max(1, round(options.warmup)))
        phases = [await asyncio.to_thread(pgbench, "heartbeat, closed loop", c, seconds)
                  for c in CONNECTIONS]  # fmt: skip
        phases.append(await asyncio.to_thread(pgbench, paced, wide, seconds, required))

        _say(f"{label}: queries, idle, then under the paced heartbeat load")
        began = time.monotonic()
        with _gc_pauses() as idle_gc:
            idle = await _queries(reader, profiles, repeats, "idle")
        idle_seconds = time.monotonic() - began
        await _refresh(reader)
        plan = await _explain(reader, EXPLAINED, "ANALYZE, BUFFERS")
        for q in idle:
            q["server_execution_ms"], q["scans"] = await _server_ms(reader, q["query"])
        prepared = await _fetch(
            reader,
            "SELECT statement, generic_plans, custom_plans FROM "
            "pg_prepared_statements WHERE statement NOT LIKE 'EXPLAIN%'",
        )
        plans = {key: {"generic_plans": r["generic_plans"], "custom_plans": r["custom_plans"]}
                 for r in prepared for marker, key in (("eligible_workers(", "eligible"),
                 ("worker_liveness_now", "nodes")) if marker in str(r["statement"])}  # fmt: skip
        await _refresh(reader)
        # the paced load outlasts the queries: twice what they took idle, at least `duration`
        both, loaded_seconds = Phase(f"{paced} + queries", wide, required), max(
            seconds, math.ceil(2 * idle_seconds) + 2)  # fmt: skip
        with _gc_pauses() as loaded_gc:
            meter = _meter(pid, children=True)
            popen = await asyncio.to_thread(
                _pgbench, url, beats.instance, count, workdir, both, loaded_seconds)  # fmt: skip
            loaded = await _queries(reader, profiles, repeats, f"{required:.0f} beats/s")
            if popen.poll() is not None:
                failures.append("the queries under load outlasted the paced pgbench run")
            await asyncio.to_thread(_finish, popen, workdir, both, loaded_seconds)
            both.cpu = meter.spent()
        phases.append(both)
        final = await _table_stats(reader)
    finally:
        await reader.close()
        await beats.close()
    failures += [f"{p.name} ({p.connections} conns): {len(p.errors)} errors {p.errors[:5]}"
                 for p in [register, *phases] if p.errors]  # fmt: skip
    failures += [f"{p.name}: achieved {len(p.done) / p.wall_seconds:.1f}/s of {p.target_rate}/s "
                 "paced" for p in phases if p.short()]  # fmt: skip
    failures += [f"{r['query']} ({r['load']}): {r['rows']} rows, expected {r['expected_rows']}"
                 f"{'' if r['same_nodes'] else ', different nodes'}" for r in [*idle, *loaded]
                 if not (r["rows"] == r["expected_rows"] > 0 and r["same_nodes"])]  # fmt: skip
    return {
        "settings": settings, "register": register.summary(required),
        "heartbeats": [p.summary(required) for p in phases], "queries": [*idle, *loaded],
        "explain": {"query": EXPLAINED, "plan": plan}, "plan_choices": plans,
        "query_gc_pauses": {"idle": idle_gc, "loaded": loaded_gc},
        "table_after_register": after_register, "table_at_end": final, "failures": failures,
    }  # fmt: skip


def _tables(servers: dict[str, Json], setup: Json) -> list[Json]:
    count, required = setup["nodes"], setup["required_heartbeats_per_second"]
    loads = [[label, p["phase"], p["connections"], p["completed"], p["per_second"],
              None if p["phase"] == REGISTER else p["times_required"], p["worst_second"],
              *p["latency_ms"].values(), p["errors"] + p["missing_rows"], p["client_cpu_percent"],
              p["server_cpu_percent"], p["other_cpu_percent"], p["steal_percent"]]
             for label, s in servers.items()
             for p in [s["register"], *s["heartbeats"]]]  # fmt: skip
    queries = [[label, q["load"], q["query"], f"{q['rows']}" + ("" if q["rows"] ==
                q["expected_rows"] and q["same_nodes"] else f" (expected {q['expected_rows']})"),
                *q["latency_ms"].values(), q["server_execution_ms"],
                q["scans"] if q["load"] == "idle" else ""]
               for label, s in servers.items() for q in s["queries"]]  # fmt: skip
    per_server = []
    for label, s in servers.items():
        start, end = s["table_after_register"], s["table_at_end"]
        updates, hot = (
            (end.get(k) or 0) - (start.get(k) or 0) for k in ("n_tup_upd", "n_tup_hot_upd")
        )
        idle = [q for q in s["queries"] if q["load"] == "idle"]
        plans, gc2 = s["plan_choices"].get("eligible", {}), s["query_gc_pauses"]["idle"]["gen2"]
        per_server.append([
            label, f"{updates:,} ({percent(hot, updates):.0f} % HOT)",
            *(f"{mib(start.get(k, 0))} -> {mib(end.get(k, 0))}"
              for k in ("table_bytes", "index_bytes")),
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
              "wal_sync_method|ops/s{,}|us/op", [[m, v["per_second"], v["usecs_per_op"]]
              for m, v in setup["fsync_8k"]["one_8k_write"].items()]),
    ]  # fmt: skip


def _notes(servers: dict[str, Json], setup: Json, failures: list[str]) -> list[str]:
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
        "top lines:\n    " + "\n    ".join(line[:160] for line in plan[:16]),
    ]  # fmt: skip
