"""The fleet benchmark: N simulated nodes on the manager's own code against one PostgreSQL
behind PgBouncer and a three-server JetStream cluster, all on loopback.

Each simulated node (bench/fleet_nodes.py) is the manager's registry adapter and heartbeat
service on its scheduler (with its jitter and start-up spread), and its NATS connection
(the bus, with its reconnect policy) with the worker's fetcher long-polling the tier's
three durable consumers; many nodes share a process, the fleet is split over
FLEET_PROCESSES processes. For each N of FLEET_NODES (default 150,1500; the full run is
FLEET_NODES=150,1500,5000,15000) on fresh servers:

1. the ramp: every node registered and pulling from its three streams;
2. a steady window: PostgreSQL's server connections (pg_stat_activity), PgBouncer's pools
   (SHOW POOLS every 5 s, SHOW STATS before and after), the heartbeats' wall p50/p99,
   the pull requests counted at the fetchers and credited to each consumer's leader,
   the client messages each nats-server counted (/connz), the pull requests waiting at
   the leaders (/jsz), and each nats-server's RSS per client connection;
3. heartbeat headroom: pgbench running the adapter's heartbeat statement through
   PgBouncer closed loop at 16, 64, 256, ... clients (while the fleet beats) until p99
   passes 1 s, or FLEET_HEADROOM_MAX_CLIENTS;
4. two reconnect storms: the nats-server with most of the fleet SIGKILLed, restarted
   FLEET_STORM_DOWN_SECONDS later; the time until every node that was on it is connected
   and subscribed again, and its attempts; once with the manager's full-jitter policy,
   once with a fixed 1 s wait (nats-py's kind of policy) swapped into the same code;
5. plain connections held by `nats bench sub` (FLEET_HOLD_CONNECTIONS, Go clients, not
   nodes) on the server with the fewest: its RSS per connection where Python would not
   get that far.

Results: the JSON (bench's usual), and bench/results/fleet.txt (the tables).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import multiprocessing
import os
import re
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import asyncpg

from app.adapters import registry as sql
from app.adapters.bus import JetStreamBus
from app.adapters.embedded import EmbeddedPostgres
from app.adapters.registry import AsyncpgRegistry
from app.domain.jobs import STREAMS, consumer_name
from app.domain.nats_servers import NatsServers
from app.domain.requirements import NodeProfile, Tier
from app.services import migrating
from app.services.streams import init_streams
from app.settings import Settings
from bench import Options, proc, tools
from bench.fleet_nodes import TIERS, NodesSpec, raise_open_files, serve
from bench.registry import PGBENCH, Phase, _finish, _log
from bench.report import Json, latency_ms, render, say, table
from standins.pgbouncer import PgBouncer
from tests.support.nats_cluster import Member, NatsCluster, has_meta_leader

NAME = "fleet"
DESCRIPTION = (
    "N simulated nodes on the manager's registry, heartbeat, scheduler and NATS worker code "
    "against PostgreSQL behind PgBouncer and a 3-server JetStream cluster: connections, "
    "pools, heartbeat p50/p99 and headroom, idle pulls, memory per connection, reconnect storms"
)
_say = functools.partial(say, NAME)

RESULTS = Path(__file__).resolve().parent / "results"
DATABASE = "fleet"
INTERVAL: float = Settings.model_fields["heartbeat_interval_seconds"].default
HEADROOM_P99_MS = 1000.0  # the closed loop stops once the heartbeat's p99 passes this
FIXED_WAIT = 1.0  # the storm without jitter: this wait before every attempt
POOL_EVERY = 5.0  # seconds between PgBouncer samples in the steady window
STORM_POLL = 0.25


def _env(name: str, default: str) -> str:
    return os.environ.get(name, "").strip() or default


@dataclass(frozen=True)
class Knobs:
    """What the environment sets (FLEET_*), with the defaults for a run on this machine."""

    nodes: tuple[int, ...]
    processes: int | None  # None: one per NODES_PER_PROCESS
    nodes_per_process: int
    steady_seconds: float
    startup_spread: float
    storm_down_seconds: float
    hold_connections: int
    headroom_max_clients: int
    headroom_seconds: float
    nice: int  # the simulated nodes' processes run this much nicer than the servers
    simulated_max: int  # the most nodes run on the manager's code; the rest are stand-ins

    @classmethod
    def read(cls, quick: bool) -> Knobs:
        processes = _env("FLEET_PROCESSES", "")
        return cls(
            nodes=tuple(int(n) for n in _env("FLEET_NODES", "150,1500").split(",")),
            processes=int(processes) if processes else None,
            nodes_per_process=int(_env("FLEET_NODES_PER_PROCESS", "2500")),
            steady_seconds=float(_env("FLEET_STEADY_SECONDS", "35" if quick else "60")),
            startup_spread=float(_env("FLEET_STARTUP_SPREAD", "5" if quick else "30")),
            storm_down_seconds=float(_env("FLEET_STORM_DOWN_SECONDS", "5")),
            hold_connections=int(_env("FLEET_HOLD_CONNECTIONS", "1500")),
            headroom_max_clients=int(_env("FLEET_HEADROOM_MAX_CLIENTS", "1024")),
            headroom_seconds=float(_env("FLEET_HEADROOM_SECONDS", "2" if quick else "5")),
            nice=int(_env("FLEET_NICE", "0")),
            simulated_max=int(_env("FLEET_SIMULATED_MAX", "1500")),
        )

    def split(self, n: int) -> tuple[int, int]:
        """A fleet of `n`: how many nodes run on the manager's code (simulated), how many
        are stand-ins (their heartbeats from pgbench, their connections from `nats
        bench`). FLEET_SIMULATED_MAX=0 simulates every node."""
        simulated = n if self.simulated_max <= 0 else min(n, self.simulated_max)
        return simulated, n - simulated

    def processes_for(self, n: int) -> int:
        """The processes for `n` simulated nodes."""
        return max(1, min(n, self.processes or math.ceil(n / self.nodes_per_process)))


# -- the simulated nodes' processes ---------------------------------------------------------


class Processes:
    """The fleet's processes: each command goes to all, and their answers come back."""

    def __init__(self, specs: Sequence[NodesSpec]) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for spec in specs:
            ours, theirs = context.Pipe()
            process = context.Process(target=serve, args=(theirs, spec), daemon=True,
                                      name=f"fleet-{spec.process}")  # fmt: skip
            process.start()
            self.pipes.append(ours)
            self.procs.append(process)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, command: str, timeout: float = 120.0, **arguments: Any) -> list[Json]:
        for pipe in self.pipes:
            pipe.send((command, arguments))
        replies = []
        for pipe in self.pipes:
            if not pipe.poll(timeout):
                raise TimeoutError(f"a fleet process did not answer {command} in {timeout} s")
            reply = pipe.recv()
            if "error" in reply:
                raise RuntimeError(f"a fleet process failed {command}: {reply['error']}")
            replies.append(reply)
        return replies

    def status(self) -> Json:
        replies = self.call("status")
        servers: Counter[str] = Counter()
        for r in replies:
            servers.update(r["servers"])
        total = {k: sum(r[k] for r in replies) for k in ("registered", "connected", "subscribed",
                                                          "gave_up")}  # fmt: skip
        ended = [e for r in replies for e in r["worker_ended"]]
        return total | {"servers": dict(servers), "worker_ended": ended}

    def logs(self) -> dict[str, int]:
        """The nodes' log records since the last call, counted by what they say."""
        counts: Counter[str] = Counter()
        for reply in self.call("logs"):
            counts.update(reply["logs"])
        return dict(counts.most_common(12))

    def close(self) -> None:
        try:
            self.call("close", timeout=60)
        except (TimeoutError, RuntimeError, OSError, EOFError) as exc:
            _say(f"closing the fleet: {exc}")
        for process in self.procs:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)


# -- the servers ------------------------------------------------------------------------------


def _http(port: int | None, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as answer:
        return json.loads(answer.read())


def _rss(pid: int | None) -> int:
    return proc.status(pid)["VmRSS"] if pid else 0


def _client_messages(member: Member) -> int:
    """Messages the server received from its client connections (/connz), all of them."""
    connz = _http(member.monitor_port, "/connz?limit=1000000")
    return sum(int(c.get("in_msgs", 0)) for c in connz.get("connections") or [])


def _waiting_pulls(member: Member) -> dict[str, int]:
    """Pull requests waiting at the consumers this server leads (/jsz), by consumer."""
    jsz = _http(member.monitor_port, "/jsz?accounts=true&consumers=true")
    found: dict[str, int] = {}
    for account in jsz.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            for consumer in stream.get("consumer_detail") or []:
                if (consumer.get("cluster") or {}).get("leader") == member.name:
                    key = f"{stream['name']}/{consumer['name']}"
                    found[key] = int(consumer.get("num_waiting") or 0)
    return found


async def _consumer_leaders(url: str) -> dict[str, str]:
    """Each tier's durable consumer on each job stream: the server that leads it."""
    import nats

    nc = await nats.connect(url.split(","), connect_timeout=5)
    try:
        js, leaders = nc.jetstream(timeout=10), {}
        for tier in TIERS:
            for stream in STREAMS.values():
                info = await js.consumer_info(stream, consumer_name(tier))
                leaders[f"{tier}/{stream}"] = info.cluster.leader if info.cluster else "?"
        return leaders
    finally:
        await nc.close()


async def _prepare_database(pg: EmbeddedPostgres) -> str:
    """The fleet's database, migrated straight on PostgreSQL (as `migrate` goes past the
    pooler); its URL on PostgreSQL."""
    admin = await asyncpg.connect(pg.url, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await admin.close()
    url = f"{pg.url.rpartition('/')[0]}/{DATABASE}"
    direct = AsyncpgRegistry(url, timeout=60, max_connections=1)
    await direct.open()
    try:
        await migrating.migrate(direct, migrating.migrations_dir(None))
    finally:
        await direct.close()
    return url


async def _init_streams(url: str) -> None:
    settings = Settings(_env_file=None, nats_url=url, nats_stream_replicas=3)
    for _ in range(60):
        if await has_meta_leader(url.split(",")):
            break
        await asyncio.sleep(0.5)
    bus = JetStreamBus(NatsServers.parse(url), name="fleet-setup", timeout=20.0)
    await bus.connect()
    try:
        await init_streams(bus, settings)
    finally:
        await bus.drain()


async def _pg_connections(url: str) -> Json:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE datname = $1 AND pid <> pg_backend_pid()) AS fleet, "
            "count(*) FILTER (WHERE backend_type = 'client backend' AND pid <> pg_backend_pid())"
            " AS clients, current_setting('max_connections')::int AS max FROM pg_stat_activity",
            DATABASE)  # fmt: skip
        return dict(row) if row else {}
    finally:
        await conn.close()


def _pool(bouncer: PgBouncer) -> Json:
    rows = [r for r in bouncer.admin("SHOW POOLS") if r.get("database") == DATABASE]
    if not rows:
        return {}
    r = rows[0]
    keys = ("cl_active", "cl_waiting", "sv_active", "sv_idle", "sv_used", "sv_login")
    values = {k: int(r.get(k, 0) or 0) for k in keys}
    maxwait = float(r.get("maxwait", 0) or 0) + float(r.get("maxwait_us", 0) or 0) / 1e6
    return values | {"maxwait_ms": round(1000 * maxwait, 1)}


def _pool_stats(bouncer: PgBouncer) -> Json:
    rows = [r for r in bouncer.admin("SHOW STATS") if r.get("database") == DATABASE]
    r = rows[0] if rows else {}
    return {k: int(r.get(k, 0) or 0) for k in ("total_xact_count", "total_wait_time",
                                                "total_xact_time")}  # fmt: skip


# -- one fleet size ---------------------------------------------------------------------------


@dataclass
class World:
    n: int  # the fleet: simulated nodes and stand-ins
    knobs: Knobs
    workdir: Path
    pg: EmbeddedPostgres
    bouncer: PgBouncer
    cluster: NatsCluster
    database_url: str  # straight to PostgreSQL
    fleet: Processes | None = None
    standins: StandIns | None = None
    rows: int = 0  # the heartbeat rows registered for pgbench (stand-ins and the headroom)

    @property
    def simulated(self) -> int:
        return self.knobs.split(self.n)[0]

    @property
    def pooled_url(self) -> str:
        return self.bouncer.url(self.database_url)

    def member_by_port(self, port: int) -> Member:
        (found,) = [m for m in self.cluster.members if m.server.port == port]
        return found


@contextmanager
def _servers(workdir: Path, n: int, knobs: Knobs) -> Iterator[World]:
    with ExitStack() as stack:
        pg = EmbeddedPostgres(workdir / "postgres")
        stack.callback(pg.stop)
        pg.start()
        database_url = asyncio.run(_prepare_database(pg))
        # the central file but for its client limit: every node holds one client connection
        # (and the closed loop's clients come on top); 8,000 there is sized for 1,500 nodes
        clients = n + knobs.headroom_max_clients + 200
        bouncer = PgBouncer.before(pg, workdir / "pgbouncer",
                                   max_client_conn=max(clients, 8000))  # fmt: skip
        stack.callback(bouncer.stop)
        bouncer.start()
        cluster = NatsCluster(workdir / "nats", monitor=True)
        stack.callback(cluster.stop)
        cluster.start()
        asyncio.run(_init_streams(cluster.url))
        yield World(n, knobs, workdir, pg, bouncer, cluster, database_url)


def _specs(world: World) -> list[NodesSpec]:
    simulated = world.simulated
    count = world.knobs.processes_for(simulated)
    shares = [simulated // count + (1 if i < simulated % count else 0) for i in range(count)]
    firsts = [sum(shares[:i]) for i in range(count)]
    return [NodesSpec(process=i, first=firsts[i], count=shares[i],
                      database_url=world.pooled_url, nats_url=world.cluster.url,
                      startup_spread=world.knobs.startup_spread, nice=world.knobs.nice)
            for i in range(count)]  # fmt: skip


def _cpu_meter(world: World) -> proc.Meter:
    assert world.fleet is not None
    fleet_pids = world.fleet.pids
    sources: dict[str, Callable[[], float]] = {
        "fleet": lambda: sum(proc.cpu_seconds(p) for p in fleet_pids),
        "postgres": lambda: proc.cpu_seconds(world.pg.pid or 0, tree=True),
        "pgbouncer": lambda: proc.cpu_seconds(world.bouncer.pid or 0),
    }
    for m in world.cluster.members:
        sources[m.name] = functools.partial(lambda s: proc.cpu_seconds(s.pid or 0), m.server)
    if world.standins is not None:
        for name, popen in world.standins.popens.items():
            sources[f"standins_{name}"] = functools.partial(proc.cpu_seconds, popen.pid)
    return proc.Meter(**sources)


def _percent(spent: Json, wall: float) -> Json:
    return {k: round(100 * v / wall, 1) for k, v in spent.items()}


def _ramp(world: World) -> Json:
    fleet = world.fleet
    assert fleet is not None
    began, meter = time.monotonic(), _cpu_meter(world)
    fleet.call("start", timeout=300)
    deadline = began + world.knobs.startup_spread + 120 + world.simulated / 20
    status: Json = {}
    while time.monotonic() < deadline:
        status = fleet.status()
        if status["registered"] == status["subscribed"] == world.simulated:
            break
        if status["worker_ended"]:
            raise RuntimeError(f"simulated nodes' workers ended: {status['worker_ended']}")
        time.sleep(1.0)
    wall = time.monotonic() - began
    _say(f"{world.n} nodes: ramp of the {world.simulated} simulated {wall:.1f} s, {status}")
    return {"seconds": round(wall, 1), "status": status, "node_logs": fleet.logs(),
            "complete": status.get("registered") == status.get("subscribed") == world.simulated,
            "cpu_percent": _percent(meter.spent(), wall)}  # fmt: skip


def _steady(world: World, baseline_rss: dict[str, int], baseline_conns: dict[str, int]) -> Json:
    fleet, members = world.fleet, world.cluster.members
    assert fleet is not None
    seconds = world.knobs.steady_seconds
    leaders = asyncio.run(_consumer_leaders(world.cluster.url))
    fleet.call("take")
    fleet.logs()
    msgs0 = {m.name: _client_messages(m) for m in members}
    stats0, meter, began = _pool_stats(world.bouncer), _cpu_meter(world), time.monotonic()
    pools: list[Json] = []
    pg: list[Json] = []
    while (left := began + seconds - time.monotonic()) > 0:
        pools.append(_pool(world.bouncer))
        pg.append(asyncio.run(_pg_connections(world.database_url)))
        time.sleep(min(POOL_EVERY, left))
    wall = time.monotonic() - began
    taken = fleet.call("take")
    cpu = _percent(meter.spent(), wall)
    stats1 = _pool_stats(world.bouncer)
    msgs1 = {m.name: _client_messages(m) for m in members}
    waiting = {m.name: _waiting_pulls(m) for m in members}
    varz = {m.name: _http(m.monitor_port, "/varz") for m in members}
    rss = {m.name: _rss(m.server.pid) for m in members}
    beats = sorted(b for t in taken for b in t["beats_us"])
    outcomes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    pulls: Counter[str] = Counter()
    for t in taken:
        outcomes.update(t["outcomes"])
        errors.update(t["errors"])
        pulls.update(t["pulls"])
    at_leader: Counter[str] = Counter()
    for consumer, count in pulls.items():
        at_leader[leaders.get(consumer, "?")] += count
    xacts = stats1["total_xact_count"] - stats0["total_xact_count"]
    waited = stats1["total_wait_time"] - stats0["total_wait_time"]
    per_connection = {}
    for m in members:
        added = int(varz[m.name]["connections"]) - baseline_conns[m.name]
        grown = rss[m.name] - baseline_rss[m.name]
        per_connection[m.name] = {
            "clients": added,
            "rss_growth_bytes": grown,
            "bytes_per_client": round(grown / added) if added > 0 else None,
        }
    return {
        "seconds": round(wall, 1),
        "heartbeats": len(beats), "heartbeats_per_second": round(len(beats) / wall, 1),
        "required_per_second": round(world.n / INTERVAL, 1),
        "simulated_required_per_second": round(world.simulated / INTERVAL, 1),
        "standins": world.standins.window(began, began + wall) if world.standins else None,
        "pulls_per_second_whole_fleet_computed": round(
            sum(pulls.values()) / wall * world.n / world.simulated, 1),
        "heartbeat_ms": latency_ms(beats, 1e-3), "outcomes": dict(outcomes),
        "errors": dict(errors.most_common(5)),
        "pulls_per_second": round(sum(pulls.values()) / wall, 2),
        "pulls_by_consumer": dict(pulls),
        "consumer_leaders": leaders,
        "pulls_per_second_at_leader": {k: round(v / wall, 2) for k, v in sorted(at_leader.items())},
        "client_messages_per_second": {m.name: round((msgs1[m.name] - msgs0[m.name]) / wall, 2)
                                       for m in members},
        "waiting_pulls_at_leaders": {k: sum(v.values()) for k, v in waiting.items()},
        "pgbouncer_pools": pools,
        "pgbouncer": {
            "cl_active_max": max((p.get("cl_active", 0) for p in pools), default=None),
            "cl_waiting_max": max((p.get("cl_waiting", 0) for p in pools), default=None),
            "sv_max": max((p.get("sv_active", 0) + p.get("sv_idle", 0) + p.get("sv_used", 0)
                           for p in pools), default=None),
            "sv_active_max": max((p.get("sv_active", 0) for p in pools), default=None),
            "maxwait_ms_max": max((p.get("maxwait_ms", 0) for p in pools), default=None),
            "transactions": xacts, "wait_us_per_transaction": round(waited / xacts, 1)
            if xacts else None,
        },
        "postgres_connections": {"fleet_max": max((p["fleet"] for p in pg), default=None),
                                 "clients_max": max((p["clients"] for p in pg), default=None),
                                 "max_connections": pg[-1]["max"] if pg else None},
        "nats_rss_per_client": per_connection,
        "cpu_percent": cpu,
        "node_logs": fleet.logs(),
    }  # fmt: skip


# -- heartbeat headroom ----------------------------------------------------------------------

HEADROOM_PREFIX, HEADROOM_INSTANCE = "hr-", "fleet-headroom"


async def _headroom_rows(world: World, count: int) -> None:
    """`count` more nodes' rows, registered through the adapter's upsert (straight)."""
    registry = AsyncpgRegistry(world.database_url, timeout=30, max_connections=8,
                               instance=HEADROOM_INSTANCE)  # fmt: skip
    await registry.open()
    try:
        todo = iter(range(count))

        async def upsert() -> None:
            for i in todo:
                profile = NodeProfile(node_id=f"{HEADROOM_PREFIX}{i:05d}", tier=Tier.B,
                                      region="eu-west", hardware={"cpu_count": 8},
                                      capabilities=["embeddings"])  # fmt: skip
                await registry.upsert(profile, status="online", interval_seconds=int(INTERVAL))

        await asyncio.gather(*(upsert() for _ in range(8)))
    finally:
        await registry.close()


def _heartbeat_rows(world: World) -> int:
    """The rows pgbench beats (the stand-ins and the closed loop): one per node of the
    fleet, 1,000 at least, registered once per fleet size."""
    if not world.rows:
        world.rows = max(world.n, 1000)
        asyncio.run(_headroom_rows(world, world.rows))
    return world.rows


def _heartbeat_script(world: World, name: str) -> Path:
    """A pgbench script of the adapter's heartbeat statement for a random row (extended
    protocol, unnamed: what asyncpg sends with its statement cache off); `\\gset` fails a
    client whose row did not move."""
    rows = _heartbeat_rows(world)
    statement = " ".join(sql._HEARTBEAT.split())
    for parameter, value in (("$1", f"'{HEADROOM_PREFIX}' || lpad(:node::text, 5, '0')"),
                             ("$2", "'online'"), ("$3", f"'{HEADROOM_INSTANCE}'")):  # fmt: skip
        if parameter not in statement:
            raise RuntimeError(f"no {parameter} in the adapter's heartbeat: {statement}")
        statement = statement.replace(parameter, value)
    script = world.workdir / name
    script.write_text(f"\\set node random(0, {rows - 1})\n{statement} \\gset\n")
    return script


def _headroom_step(world: World, clients: int, seconds: int) -> Phase:
    """pgbench, closed loop with `clients` connections through PgBouncer, running the
    adapter's heartbeat statement (`_heartbeat_script`)."""
    script = _heartbeat_script(world, "heartbeat.sql")
    phase = Phase("headroom", clients)
    argv = [str(PGBENCH), "-n", "-M", "extended", "-f", str(script), "-c", str(clients),
            "-j", "2", "-T", str(seconds), "--log", f"--log-prefix={world.workdir / _log(phase)}",
            world.pooled_url]  # fmt: skip
    meter = proc.Meter(
        client=proc.children_cpu,
        server=lambda: proc.cpu_seconds(world.pg.pid or 0, tree=True)
        + proc.cpu_seconds(world.bouncer.pid or 0),
        busy=lambda: proc.machine_busy()[0], steal=lambda: proc.machine_busy()[1],
    )  # fmt: skip
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=world.workdir)  # fmt: skip
    _finish(popen, world.workdir, phase, seconds)
    phase.cpu = meter.spent()
    return phase


def _fine(step: Json) -> bool:
    """A closed-loop step within the bound: beats done, none failed, p99 <= 1 s."""
    p99 = step["latency_ms"]["p99"]
    return (
        bool(step["per_second"])
        and not step["errors"]
        and p99 is not None
        and (p99 <= HEADROOM_P99_MS)
    )


def _headroom(world: World) -> Json:
    fleet = world.fleet
    assert fleet is not None
    rows = _heartbeat_rows(world)
    seconds = max(1, round(world.knobs.headroom_seconds))
    steps, clients = [], 16
    fleet.call("take")
    began = time.monotonic()
    while clients <= world.knobs.headroom_max_clients:
        phase = _headroom_step(world, clients, seconds)
        p = phase.summary(world.n / INTERVAL)
        pool = _pool(world.bouncer)
        step = {
            "clients": clients,
            "per_second": p["per_second"],
            "latency_ms": p["latency_ms"],
            "errors": p["errors"],
            "first_errors": p["first_errors"],
            "cl_waiting": pool.get("cl_waiting"),
            "maxwait_ms": pool.get("maxwait_ms"),
            "pgbench_cpu_percent": p["client_cpu_percent"],
            "postgres_pgbouncer_cpu_percent": p["server_cpu_percent"],
            "other_cpu_percent": p["other_cpu_percent"],  # the machine's rest: nodes, NATS
        }
        _say(f"{world.n} nodes: headroom at {clients} clients: {step}")
        steps.append(step)
        if not _fine(step):
            break
        clients *= 4
    taken = fleet.call("take")
    beats = sorted(b for t in taken for b in t["beats_us"])
    fine = [s for s in steps if _fine(s)]
    best = max(fine, key=lambda s: s["per_second"], default=None)
    need = world.n / INTERVAL
    return {
        "rows": rows, "seconds_per_step": seconds, "steps": steps,
        "passed_1s": any(s not in fine for s in steps),
        "best": best, "required_per_second": round(need, 1),
        "times_required": round(best["per_second"] / need, 1) if best else None,
        "fleet_heartbeat_ms_meanwhile": latency_ms(beats, 1e-3),
        "fleet_outcomes_meanwhile": dict(sum((Counter(t["outcomes"]) for t in taken),
                                             Counter())),
        "standins_meanwhile": world.standins.window(began, time.monotonic())
        if world.standins else None,
    }  # fmt: skip


# -- stand-ins: the nodes beyond FLEET_SIMULATED_MAX -----------------------------------------


def _number(pattern: str, line: str) -> float | None:
    found = re.search(pattern, line)
    return float(found.group(1)) if found else None


@dataclass(frozen=True)
class Progress:
    """One of pgbench's progress lines (`-P`), when it was read."""

    at: float  # monotonic
    tps: float
    latency_ms: float | None
    failed: int
    lag_ms: float | None

    @classmethod
    def parse(cls, line: str, at: float) -> Progress | None:
        tps = _number(r"([\d.]+) tps", line)
        if not line.startswith("progress:") or tps is None:
            return None
        return cls(at=at, tps=tps, latency_ms=_number(r"lat ([\d.]+) ms", line),
                   failed=int(_number(r"(\d+) failed", line) or 0),
                   lag_ms=_number(r"lag ([\d.]+) ms", line))  # fmt: skip


def _window(progress: Sequence[Progress], began: float, ended: float) -> Json:
    """pgbench's progress lines read between `began` and `ended`: the mean rate, the
    latency and lag (means of its 5 s means; the worst of them) and the failures."""
    lines = [p for p in progress if began < p.at <= ended]
    if not lines:
        return {"lines": 0}
    latencies = [p.latency_ms for p in lines if p.latency_ms is not None]
    lags = [p.lag_ms for p in lines if p.lag_ms is not None]
    return {
        "lines": len(lines), "per_second": round(statistics.fmean(p.tps for p in lines), 1),
        "latency_ms_mean": round(statistics.fmean(latencies), 2) if latencies else None,
        "latency_ms_worst_5s": max(latencies, default=None),
        "lag_ms_worst_5s": max(lags, default=None), "failed": sum(p.failed for p in lines),
    }  # fmt: skip


def _total_connections(world: World) -> int:
    """Client connections on every server of the cluster now (a server that is down: 0)."""
    total = 0
    for member in world.cluster.members:
        try:
            total += int(_http(member.monitor_port, "/varz")["connections"])
        except (OSError, ValueError, KeyError):
            continue
    return total


class StandIns:
    """The nodes of a fleet beyond FLEET_SIMULATED_MAX, held by maintained load tools where
    this machine's cores run out for Python clients. Each one's heartbeat is pgbench
    running the adapter's heartbeat statement through PgBouncer on a client connection of
    its own, paced to one per node every 30 s (`-R`, Poisson arrivals); each one's NATS
    connection is a `nats bench sub` client (Go, nats.go's own reconnects) on one of the
    three servers. They carry the fleet's load on PostgreSQL and PgBouncer and its client
    connections on the servers; they make no pull requests (the fleet's idle pulls are
    computed from the simulated nodes' measured rate)."""

    def __init__(self, world: World, count: int) -> None:
        self.world, self.count = world, count
        self.progress: list[Progress] = []
        self.said: dict[str, list[str]] = {"pgbench": [], "nats": []}
        self.popens: dict[str, subprocess.Popen[str]] = {}

    def _read(self, name: str, popen: subprocess.Popen[str]) -> None:
        assert popen.stderr is not None
        for line in popen.stderr:
            found = Progress.parse(line.strip(), time.monotonic())
            if found is not None:
                self.progress.append(found)
            else:
                self.said[name] = [*self.said[name][-19:], line.strip()[:300]]

    def _spawn(self, name: str, argv: list[str]) -> None:
        popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, cwd=self.world.workdir)  # fmt: skip
        self.popens[name] = popen
        threading.Thread(target=self._read, args=(name, popen), daemon=True).start()

    def start(self) -> Json:
        """Both tools started; returns once every stand-in's NATS connection is up and
        pgbench is beating (all its connections made), with the seconds each took."""
        world, count = self.world, self.count
        script = _heartbeat_script(world, "standins.sql")
        connections0, began = _total_connections(world), time.monotonic()
        self._spawn("nats", [tools.find("nats"), "--no-context", "--server", world.cluster.url,
                             "bench", "sub", "fleet.standins", "--clients", str(count),
                             "--msgs", "1000000000", "--no-progress"])  # fmt: skip
        self._spawn("pgbench", [str(PGBENCH), "-n", "-M", "extended", "-f", str(script),
                                "-c", str(count), "-j", "2", "-R", f"{count / INTERVAL:.2f}",
                                "-T", "86400", "-P", "5", world.pooled_url])  # fmt: skip
        deadline = began + 300 + count / 50
        connected_after = beating_after = None
        while time.monotonic() < deadline and (connected_after is None or beating_after is None):
            for name, popen in self.popens.items():
                if popen.poll() is not None:
                    raise RuntimeError(f"stand-ins: {name} exited {popen.returncode}: "
                                       f"{self.said[name][-3:]}")  # fmt: skip
            if connected_after is None and _total_connections(world) >= connections0 + count:
                connected_after = round(time.monotonic() - began, 1)
            if beating_after is None and self.progress:
                beating_after = round(time.monotonic() - began, 1)
            time.sleep(0.5)
        if connected_after is None or beating_after is None:
            raise RuntimeError(
                f"stand-ins not up in {deadline - began:.0f} s: NATS connections "
                f"{_total_connections(world) - connections0} of {count}, "
                f"pgbench {'beating' if self.progress else 'connecting'}"
            )
        _say(f"{world.n} nodes: {count} stand-ins up: NATS in {connected_after} s, "
             f"pgbench beating after {beating_after} s")  # fmt: skip
        return {"count": count, "rate_per_second": round(count / INTERVAL, 2),
                "nats_connected_seconds": connected_after,
                "pgbench_beating_seconds": beating_after,
                "tools": {"nats": tools.version("nats", "--version")}}  # fmt: skip

    def window(self, began: float, ended: float) -> Json:
        return _window(self.progress, began, ended) | {
            "alive": {name: popen.poll() is None for name, popen in self.popens.items()}
        }

    def stop(self) -> Json:
        for popen in self.popens.values():
            popen.terminate()
        for popen in self.popens.values():
            try:
                popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        return {name: lines[-5:] for name, lines in self.said.items()}


# -- reconnect storms ------------------------------------------------------------------------


def _healthy(member: Member, deadline: float) -> float | None:
    """Seconds until the server's /healthz says it is current (JetStream caught up)."""
    began = time.monotonic()
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{member.monitor_port}/healthz", timeout=5
            ) as answer:
                if answer.status == 200:
                    return round(time.monotonic() - began, 2)
        except OSError:
            pass
        time.sleep(0.2)
    return None


def _storm(world: World, label: str, fixed_wait: float | None) -> Json:
    fleet = world.fleet
    assert fleet is not None
    fleet.call("policy", fixed_wait=fixed_wait)
    try:
        marked = fleet.status()
        fleet.logs()
        fleet.call("mark")
        port, on_it = max(((int(p), c) for p, c in marked["servers"].items() if p != "None"),
                          key=lambda pc: pc[1])  # fmt: skip
        victim = world.member_by_port(port)
        _say(f"{world.n} nodes: storm {label}: SIGKILL {victim.name} ({on_it} nodes on it)")
        connections = _total_connections(world)  # simulated nodes and stand-ins
        on_victim = int(_http(victim.monitor_port, "/varz")["connections"])
        connections_back: float | None = None
        killed = time.monotonic()
        world.cluster.kill(victim.name)
        restarted: float | None = None
        down = world.knobs.storm_down_seconds
        deadline = killed + down + 120
        rows: list[Json] = []
        while time.monotonic() < deadline:
            time.sleep(STORM_POLL)
            if restarted is None and time.monotonic() - killed >= down:
                world.cluster.restart(victim.name)
                restarted = time.monotonic()
            if connections_back is None and _total_connections(world) >= connections:
                connections_back = round(time.monotonic() - killed, 2)  # on any server
            if restarted is None or connections_back is None:
                continue
            status = fleet.status()
            if status["connected"] == status["subscribed"] == world.simulated or status["gave_up"]:
                rows = [r for reply in fleet.call("storm", server=port) for r in reply["nodes"]]
                if all(r["resubscribed_at"] is not None for r in rows) or status["gave_up"]:
                    break
        rows = rows or [r for reply in fleet.call("storm", server=port) for r in reply["nodes"]]
        current = _healthy(victim, time.monotonic() + 60)
        after = fleet.status()
        after["logs"] = fleet.logs()
    finally:
        fleet.call("unmark")
        fleet.call("policy", fixed_wait=None)
    summary = _storm_summary(label, fixed_wait, victim.name, on_it, killed, restarted, rows,
                             after, current, world)  # fmt: skip
    return summary | {
        "connections": connections,
        "connections_on_killed": on_victim,
        "all_connections_back_seconds": connections_back,
    }


def _storm_summary(label: str, fixed_wait: float | None, victim: str, on_it: int,
                   killed: float, restarted: float | None, rows: list[Json], after: Json,
                   current: float | None, world: World) -> Json:  # fmt: skip
    back = sorted(r["back_at"] - killed for r in rows if r["back_at"] is not None)
    subscribed = sorted(r["resubscribed_at"] - killed for r in rows
                        if r["resubscribed_at"] is not None)  # fmt: skip
    bins = Counter(math.floor(b * 10) for b in back)  # 100 ms from the kill
    busiest = max(bins.values(), default=0)
    attempts = Counter(len(r["waits"]) for r in rows)
    waits = [w for r in rows for w in r["waits"]]
    ports = {str(m.server.port): m.name for m in world.cluster.members}
    moved = Counter(ports.get(str(r["back_to"]), str(r["back_to"])) for r in rows)
    return {
        "policy": label, "fixed_wait": fixed_wait, "killed": victim, "nodes_on_it": on_it,
        "records": len(rows), "back": len(back), "resubscribed": len(subscribed),
        "down_seconds": round((restarted or killed) - killed, 2),
        "all_back_seconds": round(back[-1], 3) if len(back) == len(rows) and back else None,
        "all_resubscribed_seconds": round(subscribed[-1], 3)
        if len(subscribed) == len(rows) and subscribed else None,
        "back_ms": latency_ms(back, 1000), "first_back_seconds": round(back[0], 3) if back
        else None,
        "busiest_100ms_share": round(busiest / len(back), 3) if back else None,
        "busiest_100ms_at_seconds": max(bins, key=lambda b: bins[b]) / 10 if bins else None,
        "attempts_histogram": {str(k): v for k, v in sorted(attempts.items())},
        "wait_mean_seconds": round(statistics.fmean(waits), 3) if waits else None,
        "moved_to": dict(moved), "gave_up": after["gave_up"],
        "fleet_after": {k: after[k] for k in ("connected", "subscribed", "servers")},
        "victim_current_after_restart_seconds": current,
        "node_logs": after["logs"],
    }  # fmt: skip


# -- plain connections held by nats bench ----------------------------------------------------


def _hold(world: World) -> Json:
    """`nats bench sub` with K clients on the server with the fewest connections: its RSS
    before and once all K are connected, per connection."""
    k = world.knobs.hold_connections
    if k <= 0:
        return {"skipped": "FLEET_HOLD_CONNECTIONS=0"}
    members = world.cluster.members
    counts = {m.name: int(_http(m.monitor_port, "/varz")["connections"]) for m in members}
    member = min(members, key=lambda m: counts[m.name])
    before = _rss(member.server.pid)
    argv = [
        tools.find("nats"),
        "--no-context",
        "--server",
        member.url,
        "bench",
        "sub",
        "fleet.hold",
        "--clients",
        str(k),
        "--msgs",
        "1000000000",
        "--no-progress",
    ]
    popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        deadline, held = time.monotonic() + 120, 0
        while time.monotonic() < deadline and popen.poll() is None:
            held = int(_http(member.monitor_port, "/varz")["connections"]) - counts[member.name]
            if held >= k:
                break
            time.sleep(0.5)
        time.sleep(2.0)  # the clients' subscriptions and first pings settle
        after = _rss(member.server.pid)
        held = int(_http(member.monitor_port, "/varz")["connections"]) - counts[member.name]
    finally:
        popen.terminate()
        try:
            _, stderr = popen.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            popen.kill()
            _, stderr = popen.communicate()
    return {"server": member.name, "clients": k, "held": held, "rss_before": before,
            "rss_after": after, "bytes_per_connection": round((after - before) / held)
            if held > 0 else None, "tool": tools.version("nats", "--version"),
            "stderr": (stderr or "")[-300:] if held < k else ""}  # fmt: skip


# -- the run ---------------------------------------------------------------------------------


def _measure(n: int, knobs: Knobs) -> Json:
    with tempfile.TemporaryDirectory(prefix=f"bench-fleet-{n}-") as tmp:
        _say(f"{n} nodes: starting PostgreSQL, PgBouncer and three nats-servers")
        with _servers(Path(tmp), n, knobs) as world:
            members = world.cluster.members
            time.sleep(1.0)
            baseline_rss = {m.name: _rss(m.server.pid) for m in members}
            baseline_conns = {m.name: int(_http(m.monitor_port, "/varz")["connections"])
                              for m in members}  # fmt: skip
            specs = _specs(world)
            world.fleet = fleet = Processes(specs)
            fleet.status()  # every process has imported what it runs
            fleet_rss0 = sum(_rss(p) for p in fleet.pids)
            result: Json = {"nodes": n, "simulated": world.simulated,
                            "standins": {"count": knobs.split(n)[1]}, "processes": len(specs),
                            "nodes_per_process": [s.count for s in specs],
                            "settings": asdict(specs[0]) | {"first": None, "count": None,
                                                            "process": None}}  # fmt: skip
            try:
                _say(f"{n} nodes: the ramp ({len(specs)} processes)")
                result["ramp"] = _ramp(world)
                result["fleet_rss_per_node"] = round(
                    (sum(_rss(p) for p in fleet.pids) - fleet_rss0) / world.simulated)  # fmt: skip
                _, count = knobs.split(n)
                if count:
                    _say(f"{n} nodes: {count} stand-ins (pgbench, nats bench)")
                    world.standins = StandIns(world, count)
                    result["standins"] = world.standins.start()
                _say(f"{n} nodes: the steady window ({knobs.steady_seconds:.0f} s)")
                result["steady"] = _steady(world, baseline_rss, baseline_conns)
                _say(f"{n} nodes: heartbeat headroom through PgBouncer (pgbench)")
                result["headroom"] = _headroom(world)
                result["storms"] = [
                    _storm(world, "full jitter (the manager's)", None),
                    _storm(world, f"fixed {FIXED_WAIT:g} s", FIXED_WAIT),
                ]
                _say(f"{n} nodes: {knobs.hold_connections} plain connections (nats bench)")
                result["hold"] = _hold(world)
            finally:
                if world.standins is not None:
                    result.setdefault("standins", {})["said"] = world.standins.stop()
                fleet.close()
    return result


def run(options: Options) -> Json:
    knobs = Knobs.read(options.quick)
    soft, hard = raise_open_files()
    setup: Json = {
        "knobs": asdict(knobs), "open_files": {"soft": soft, "hard": hard},
        "fs_file_max": int(Path("/proc/sys/fs/file-max").read_text()),
        "pgbouncer": subprocess.run(["pgbouncer", "--version"], capture_output=True,
                                    text=True).stdout.splitlines()[0:1],
        "pgbench": subprocess.run([PGBENCH, "--version"], capture_output=True,
                                  text=True).stdout.strip(),
        "load_average_1m_before": round(os.getloadavg()[0], 2),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    fleets: Json = {}
    for n in knobs.nodes:
        need = 2 * n + 200  # a pool connection and a NATS connection per node, and room
        simulated, standins = knobs.split(n)
        per_process = 2 * math.ceil(simulated / knobs.processes_for(simulated)) + 200
        if per_process > soft or standins + 200 > soft:
            fleets[str(n)] = {
                "nodes": n,
                "error": f"{max(per_process, standins + 200)} files per process needed, the "
                f"open-file limit is {soft}: raise FLEET_PROCESSES or lower FLEET_SIMULATED_MAX",
            }
            continue
        _say(f"{n} nodes ({need} client sockets in all)")
        try:
            fleets[str(n)] = _measure(n, knobs)
        except Exception as exc:  # the next size still runs; the failure is reported
            _say(f"{n} nodes FAILED: {type(exc).__name__}: {exc}")
            fleets[str(n)] = {"nodes": n, "error": f"{type(exc).__name__}: {exc}"}
    result: Json = {"setup": setup, "fleets": fleets}
    result["tables"] = _tables(fleets)
    result["notes"] = _notes(setup, fleets)
    _write_text(result)
    return result


# -- the report ------------------------------------------------------------------------------


def _ms(latency: Json | None) -> str:
    if not latency or latency.get("p50") is None:
        return "-"
    return f"{latency['p50']:.1f} / {latency['p99']:.1f} (max {latency['max']:.0f})"


def _kib(value: float | None) -> str:
    return "-" if value is None else f"{value / 1024:.1f}"


def _rows(f: Json) -> list[tuple[str, str]]:
    if "error" in f:
        return [("error", f["error"])]
    ramp, s, h = f["ramp"], f["steady"], f["headroom"]
    pb, pg = s["pgbouncer"], s["postgres_connections"]
    best = h["best"] or {}
    per_client = s["nats_rss_per_client"]
    simulated, si = f.get("simulated", f["nodes"]), f.get("standins") or {}
    st = s.get("standins") or {}
    status = ramp["status"]
    rows = [
        ("nodes simulated on the manager's code / stand-ins (pgbench, nats bench)",
         f"{simulated} / {si.get('count', 0)}"),
        ("processes x simulated nodes", f"{f['processes']} x {max(f['nodes_per_process'])}"),
        ("ramp: all simulated registered and pulling (s)",
         f"{ramp['seconds']}" + ("" if ramp["complete"] else
                                 f" INCOMPLETE: {status.get('registered')} registered, "
                                 f"{status.get('subscribed')} pulling")),
        ("stand-ins up: NATS connections / pgbench beating (s)",
         f"{si.get('nats_connected_seconds', '-')} / {si.get('pgbench_beating_seconds', '-')}"),
        ("ramp CPU % (fleet / pg / pgbouncer / nats n0,n1,n2)", " / ".join(
            str(ramp["cpu_percent"].get(k)) for k in ("fleet", "postgres", "pgbouncer"))
         + " / " + ",".join(str(ramp["cpu_percent"].get(f"n{i}")) for i in range(3))),
        ("PostgreSQL server connections (fleet db, max)",
         f"{pg['fleet_max']} (max_connections {pg['max_connections']})"),
        ("PgBouncer clients active / waiting (max)", f"{pb['cl_active_max']} / "
         f"{pb['cl_waiting_max']}"),
        ("PgBouncer server connections (max) / active", f"{pb['sv_max']} / {pb['sv_active_max']}"),
        ("PgBouncer maxwait (ms, max) / wait per xact (us)",
         f"{pb['maxwait_ms_max']} / {pb['wait_us_per_transaction']}"),
        ("heartbeats/s measured: simulated + stand-ins / needed (N / 30 s)",
         f"{s['heartbeats_per_second']} + {st.get('per_second', 0)} / "
         f"{s['required_per_second']}"),
        ("heartbeat p50 / p99 ms (steady, simulated nodes)", _ms(s["heartbeat_ms"])),
        ("stand-ins' heartbeat ms mean / worst 5 s mean (pgbench) / failed",
         f"{st.get('latency_ms_mean', '-')} / {st.get('latency_ms_worst_5s', '-')} / "
         f"{st.get('failed', '-')}"),
        ("heartbeat outcomes (steady)", ", ".join(f"{k}: {v}" for k, v in s["outcomes"].items())),
        ("headroom: most heartbeats/s, p99 <= 1 s (clients)",
         f"{best.get('per_second', '-')} ({best.get('clients', '-')}); p99 > 1 s reached: "
         f"{'yes' if h['passed_1s'] else 'no'}"),
        ("headroom: x the fleet's need", f"{h['times_required']}x"),
        ("fleet heartbeat p50 / p99 ms during the closed loop",
         _ms(h["fleet_heartbeat_ms_meanwhile"])),
        ("idle pulls/s (simulated nodes' fetchers) / whole fleet (computed)",
         f"{s['pulls_per_second']} / {s.get('pulls_per_second_whole_fleet_computed', '-')}"),
        ("idle pulls/s at the consumer leaders", ", ".join(
            f"{k}: {v}" for k, v in s["pulls_per_second_at_leader"].items())),
        ("client msgs/s each nats-server received (/connz)", ", ".join(
            f"{k}: {v}" for k, v in s["client_messages_per_second"].items())),
        ("pull requests waiting at the leaders (/jsz)", ", ".join(
            f"{k}: {v}" for k, v in s["waiting_pulls_at_leaders"].items())),
        ("nats-server RSS per client connection, KiB (clients)", ", ".join(
            f"{k}: {_kib(v['bytes_per_client'])} ({v['clients']})"
            for k, v in per_client.items())),
        ("fleet process RSS per simulated node, KiB", _kib(f["fleet_rss_per_node"])),
        ("steady CPU % (fleet / pg / pgbouncer / stand-ins' pgbench, nats bench)", " / ".join(
            str(s["cpu_percent"].get(k)) for k in ("fleet", "postgres", "pgbouncer",
                                                    "standins_pgbench", "standins_nats"))),
    ]  # fmt: skip
    for storm in f["storms"]:
        tag = "jitter" if storm["fixed_wait"] is None else f"fixed {storm['fixed_wait']:g} s"
        failures = sum(v for k, v in storm["node_logs"].items() if "failed" in k)
        rows += [
            (f"storm, {storm['policy']}: killed (nodes on it)",
             f"{storm['killed']} ({storm['nodes_on_it']}), down {storm['down_seconds']} s"),
            (f"  {tag}: all back / all pulling again after the kill (s)",
             f"{storm['all_back_seconds']} / {storm['all_resubscribed_seconds']}"),
            (f"  {tag}: every client connection back, stand-ins too (s; of them on it)",
             f"{storm.get('all_connections_back_seconds')} ({storm.get('connections')}; "
             f"{storm.get('connections_on_killed')})"),
            (f"  {tag}: back after (ms) p50 / p99 (max)", _ms(storm["back_ms"])),
            (f"  {tag}: busiest 100 ms, share of reconnections",
             f"{storm['busiest_100ms_share']}"),
            (f"  {tag}: attempts per node: nodes", ", ".join(
                f"{k}: {v}" for k, v in storm["attempts_histogram"].items())),
            (f"  {tag}: moved to / gave up", ", ".join(
                f"{k}: {v}" for k, v in storm["moved_to"].items()) + f" / {storm['gave_up']}"),
            (f"  {tag}: failed fetches and subscribes, all nodes (logged)", f"{failures}"),
            (f"  {tag}: killed server current again after its restart (s)",
             f"{storm['victim_current_after_restart_seconds']}"),
        ]  # fmt: skip
    hold = f["hold"]
    if "held" in hold:
        rows.append(
            (
                f"nats bench: {hold['clients']} plain connections on {hold['server']}",
                f"{hold['held']} held, {_kib(hold['bytes_per_connection'])} KiB each",
            )
        )
    return rows


def _tables(fleets: Json) -> list[Json]:
    sizes = list(fleets)
    by_size = {n: dict(_rows(f)) for n, f in fleets.items()}
    labels = list(dict.fromkeys(k for rows in by_size.values() for k in rows))
    summary = table("fleet: simulated nodes on the manager's code, PostgreSQL behind PgBouncer, "
                    "3 nats-servers", ["", *(f"N = {int(n):,}" for n in sizes)],
                    [[k, *(by_size[n].get(k, "-") for n in sizes)] for k in labels])  # fmt: skip
    steps = [
        [
            f"{int(n):,}",
            s["clients"],
            s["per_second"],
            *s["latency_ms"].values(),
            s["errors"],
            s["cl_waiting"],
            s["maxwait_ms"],
            s["pgbench_cpu_percent"],
            s["postgres_pgbouncer_cpu_percent"],
            s.get("other_cpu_percent", "-"),
        ]
        for n, f in fleets.items()
        if "headroom" in f
        for s in f["headroom"]["steps"]
    ]
    headroom = table("heartbeat headroom: pgbench closed loop through PgBouncer, the adapter's "
                     "statement, while the fleet beats",
                     "N|clients|beats/s{,.0f}|p50 ms{.2f}|p99 ms{.2f}|max ms{.1f}|errors|"
                     "cl_waiting after|maxwait ms|pgbench CPU%{.0f}|pg + pgbouncer CPU%{.0f}|"
                     "rest of the machine CPU%",
                     steps)  # fmt: skip
    return [t for t in (summary, headroom) if t["rows"]]


def _notes(setup: Json, fleets: Json) -> list[str]:
    notes = [
        f"open files: soft {setup['open_files']['soft']}, hard {setup['open_files']['hard']} "
        f"(raised to the hard limit); fs.file-max {setup['fs_file_max']}; load average before "
        f"{setup['load_average_1m_before']}",
        "measured: everything in the tables; computed: 'x the fleet's need' (measured rate / "
        "(N / 30 s)), the pulls per leader (the fetchers' counts per consumer, credited "
        "to the server /jsz names as its leader) and the whole fleet's idle pulls (the "
        "simulated nodes' rate x N / simulated)",
        f"stand-ins: above FLEET_SIMULATED_MAX ({setup['knobs']['simulated_max']}) nodes, "
        "the rest of the fleet is held by maintained load tools: each stand-in's heartbeat "
        "is pgbench (-R N/30 s over one client connection each, the adapter's statement "
        "through PgBouncer) and its NATS connection a `nats bench sub` client (nats.go's "
        "own reconnects, in both storms). Their load on PostgreSQL, PgBouncer and the "
        "servers' connections is measured; they make no pull requests. 'every client "
        "connection back' is the cluster's client count (/varz) back to its count before "
        "the kill",
        "the storms: 'back' is the node's bus connected again (to any server), 'pulling' its "
        "three pull subscriptions made again; times from the SIGKILL",
        f"the simulated nodes' processes run at niceness +{setup['knobs']['nice']} "
        "(FLEET_NICE; 0 by default: they share this machine's cores with the servers as "
        "equals, so the servers' figures are from cores they share, the cautious side; "
        "niced, a node waiting for CPU holds a PgBouncer server connection between "
        "asyncpg's two exchanges, which a fleet of nodes on their own machines does not)",
    ]
    for n, f in fleets.items():
        for storm in f.get("storms", []):
            if storm["gave_up"] or storm["all_resubscribed_seconds"] is None:
                notes.append(f"N = {n}: storm {storm['policy']}: NOT complete: "
                             f"{storm['resubscribed']} of {storm['records']} pulling again, "
                             f"{storm['gave_up']} gave up")  # fmt: skip
        if f.get("steady", {}).get("errors"):
            notes.append(f"N = {n}: heartbeat errors: {f['steady']['errors']}")
    return notes


def _write_text(result: Json) -> None:
    setup = result["setup"]
    head = (
        f"fleet benchmark, {setup['date']}; FLEET_NODES="
        f"{','.join(str(n) for n in setup['knobs']['nodes'])}\n"
    )
    body = "\n\n".join(render(t) for t in result["tables"])
    notes = "\n".join(f"* {n}" for n in result["notes"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fleet.txt").write_text(f"{head}\n{body}\n\n{notes}\n")
