"""The soak run: `python -m bench.soak`. Does the manager leak under steady, realistic load?

The manager runs against real PostgreSQL, nats-server, the local backend and the control
plane while wrk pings every workload every 5 s, noop jobs flow through JetStream and a few
desired versions change every minute. Leaks are judged between two quiet readings (load
paused after the warm-up, stopped at the end); errors (whole run) must be 0, every acked job
completed in the ledger, the cluster converged. Exit 1: a check failed; 2: a bad setting.

Environment: SOAK_SECONDS (600, warm-up included), SOAK_WARMUP_SECONDS (60), SOAK_WORKLOADS
(100), SOAK_JOB_RATE (10 jobs/s), SOAK_BUMP_SECONDS (60; 0: never), SOAK_OUTPUT
(bench/results/soak.json), SOAK_KEEP_LOG (a path to copy the manager's log to).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil

from app.adapters.bus import JetStreamBus
from app.domain.jobs import STREAMS, consumer_name
from app.domain.nats_servers import NatsServers
from app.domain.tokens import ping_token
from app.services.streams import new_job, publish_job
from bench import cluster, proc, tools
from bench.cluster import Cluster, Snapshot
from bench.machine import facts, headline
from bench.proc import Labels, Metrics
from bench.report import MB, Json, say, show, table
from bench.servers import ServerProcess, base_env, data_servers, manager_spec
from standins.backend import LocalBackend
from standins.sync_world import KEY, desire, key_seed

RESULTS = Path(__file__).resolve().parent / "results"
WRK_SCRIPT = Path(__file__).resolve().parent / "load" / "pings.lua"
NODE, SECRET, PREFIX = "soak-node", "soak-ping-token-secret", "workload_manager"
TASKS = f"{PREFIX}_asyncio_tasks"
QUIET_SECONDS = 6.0  # > uvicorn's 5 s keep-alive: every idle connection is closed by then
QUIET_READS = 10  # task gauge reads, 0.5 s apart, in a quiet reading
TIMEOUT = 5.0  # seconds for a ping or a publish; slower is an error
RSS_GROWTH_TARGET_MB = 5.0
SAMPLE_ROWS = 14  # rows of the resource table; the JSON has every sample
TREND_MIN_SECONDS = 300.0  # a shorter measured phase makes a slope of noise
# The text format: "%H:%M:%S LEVEL   logger: message" (app/logs.py TextFormatter)
_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+)\s+(?P<logger>\S+): (?P<message>.*)$")
_NUMBER = re.compile(r"\d+(\.\d+)?")
_say = functools.partial(say, "soak")


@dataclass(frozen=True)
class Config:
    seconds: float = 600.0
    warmup_seconds: float = 60.0
    workloads: int = 100
    job_rate: float = 10.0
    bump_seconds: float = 60.0
    ping_interval: float = 5.0
    bump_count: int = 5
    sample_seconds: float = 10.0
    sync_interval: float = 10.0
    report_interval: float = 10.0
    quiet_seconds: float = QUIET_SECONDS
    tier: str = "A"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        """Read the SOAK_* variables; ValueError names the one that is wrong."""
        values: Json = {}
        lows = {"seconds": 10, "warmup_seconds": 0, "workloads": 1, "job_rate": 0.1,
                "bump_seconds": 0}  # fmt: skip
        for name, low in lows.items():
            if raw := env.get(key := f"SOAK_{name.upper()}", "").strip():
                try:
                    values[name] = type(getattr(cls, name))(float(raw))
                except ValueError:
                    raise ValueError(f"{key}={raw!r} is not a number") from None
                if values[name] < low:
                    raise ValueError(f"{key}={raw} must be at least {low:g}")
        config = cls(**values)
        if config.workloads > 500:
            raise ValueError("SOAK_WORKLOADS must be at most 500 (MAX_TRACKED_WORKLOADS)")
        if config.seconds - config.warmup_seconds < 2 * config.sample_seconds:
            least = f"by at least {2 * config.sample_seconds:g} s"
            warmup = f"SOAK_WARMUP_SECONDS ({config.warmup_seconds:g})"
            raise ValueError(f"SOAK_SECONDS ({config.seconds:g}) must exceed {warmup} {least}")
        return config


@dataclass
class World:
    """The servers, the load's shared state and what the soak observed of the manager."""

    config: Config
    workdir: Path
    nats_url: str
    pg_url: str
    backend: LocalBackend
    cluster: Cluster
    at_start: Snapshot  # the API server's counts before the manager started
    manager: ServerProcess
    peers: dict[int, str]  # port -> what listens there
    desired: dict[str, str] = field(default_factory=dict)  # name -> version desired now
    running: asyncio.Event = field(default_factory=asyncio.Event)  # the load may run
    over: asyncio.Event = field(default_factory=asyncio.Event)  # the load has stopped
    prefix: str = field(default_factory=lambda: f"soak-{uuid.uuid4().hex[:8]}-")  # job keys
    published: list[str] = field(default_factory=list)  # job keys JetStream acked
    attempted: int = 0  # job publishes
    by_kind: Counter[str] = field(default_factory=Counter)  # job publishes acked
    failures: Counter[str] = field(default_factory=Counter)  # failed publishes by exception
    bumped: int = 0
    phase: str = "warm-up"
    started: float = field(default_factory=time.monotonic)
    samples: list[Json] = field(default_factory=list)
    scrape_failures: Counter[str] = field(default_factory=Counter)

    def desire(self, versions: Mapping[str, str]) -> None:
        """Serve these versions as the desired state; the pings report them (pings.lua)."""
        self.desired.update(versions)
        desire(self.backend, *self.desired.items())
        part = self.workdir / "ping-versions.part"
        part.write_text("".join(f"{n} {v}\n" for n, v in self.desired.items()))
        part.replace(self.workdir / "ping-versions.txt")

    async def tick(self, seconds: float) -> bool:
        """Sleep, then wait while the load is paused; False once it is over."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.over.wait(), timeout=max(seconds, 0.0))
        await self.running.wait()
        return not self.over.is_set()

    async def publish_jobs(self, bus: JetStreamBus) -> None:
        """noop jobs at a steady rate (open loop), the job kinds in turn; keys unique per
        run, so every acked publish must end as one completed ledger row."""
        next_at = time.monotonic()
        for seq in itertools.count():
            if not await self.tick(next_at - time.monotonic()):
                return
            kind, key = list(STREAMS)[seq % len(STREAMS)], f"{self.prefix}{seq:07d}"
            payload = {"seq": seq, "delay_seconds": round(random.uniform(0, 0.02), 4)}
            self.attempted += 1
            try:
                async with asyncio.timeout(TIMEOUT):
                    job = new_job("noop", idempotency_key=key, payload=payload)
                    await publish_job(bus, job, kind=kind, tier=self.config.tier)
            except Exception as exc:  # any failure to get JetStream's ack is a client-side error
                self.failures[type(exc).__name__] += 1
            else:
                self.published.append(key)
                self.by_kind[kind] += 1
            # fallen behind by more than a second (a slow publish): do not burst to catch up
            next_at = max(next_at + 1.0 / self.config.job_rate, time.monotonic() - 1.0)

    async def bump_versions(self) -> None:
        """Every `bump_seconds`, a new minor version for the next `bump_count` workloads."""
        names, count = itertools.cycle(sorted(self.desired)), self.config.bump_count
        while self.config.bump_seconds > 0 and await self.tick(self.config.bump_seconds):
            chosen = {n: self.desired[n].split(".") for n in
                      [next(names) for _ in range(min(count, len(self.desired)))]}  # fmt: skip
            self.desire({n: f"{v[0]}.{int(v[1]) + 1}.0" for n, v in chosen.items()})
            self.bumped += len(chosen)

    def halt(self) -> None:
        self.over.set()
        self.running.set()

    async def scrape(self, client: httpx.AsyncClient) -> Metrics | None:
        try:
            return Metrics((await client.get("/metrics")).raise_for_status().text)
        except httpx.HTTPError as exc:
            self.scrape_failures[type(exc).__name__] += 1
            return None

    def facts(self, m: Metrics) -> Json:
        return {"rss_mb": round((m.value("process_resident_memory_bytes") or 0) / MB, 2),
                "fds": int(m.value("process_open_fds") or 0),
                "threads": proc.status(self.manager.pid)["Threads"]}  # fmt: skip

    async def sample(self, client: httpx.AsyncClient) -> Json:
        m = await self.scrape(client) or Metrics("")
        gauges = {k: None if (v := m.value(name)) is None else int(v) for k, name in (
            ("asyncio_tasks", TASKS), ("jobs_in_flight", f"{PREFIX}_jobs_in_flight"))}  # fmt: skip
        down = [x.get("component", "?") for x, v in m.samples.get(f"{PREFIX}_component_up", [])
                if v == 0]  # fmt: skip
        s = {"t": round(time.monotonic() - self.started, 1), "phase": self.phase, **self.facts(m),
             "cpu_seconds": round(m.value("process_cpu_seconds_total") or 0.0, 2), **gauges,
             "components_down": down, "server_errors": sum(server_errors(m).values())}  # fmt: skip
        self.samples.append(s)
        _say(f"t={s['t']:4.0f}s {s['phase']:<8} RSS {s['rss_mb']:6.1f} MB, tasks "
             f"{s['asyncio_tasks']}, fds {s['fds']}, errors {s['server_errors']}; pings "
             f"accepted {int(m.total(f'{PREFIX}_pings_total'))}")  # fmt: skip
        return s

    async def record(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.sample(client)
            await asyncio.sleep(self.config.sample_seconds)

    async def quiet_reading(self, client: httpx.AsyncClient) -> tuple[Json, Metrics]:
        """The least of the task gauge's reads (a loop that happens to run, or the scrape
        itself, only ever adds), the process facts and its TCP sockets by peer."""
        seen: list[int] = []
        for i in range(QUIET_READS):
            await asyncio.sleep(0.5 if i else 0)
            if (m := await self.scrape(client)) and (tasks := m.value(TASKS)) is not None:
                seen.append(int(tasks))
        if not seen or m is None:
            raise RuntimeError(f"the manager exported no {TASKS} gauge in {QUIET_READS} scrapes")
        sockets: Counter[str] = Counter()
        for conn in psutil.Process(self.manager.pid).net_connections(kind="tcp"):
            port: int | None = getattr(conn.raddr, "port", None)  # () when not connected
            if conn.status == psutil.CONN_LISTEN or port is None:
                sockets["listening"] += 1
            else:  # incoming: pings, or the soak's own scrapes
                incoming = conn.laddr.port == self.manager.port
                sockets["incoming" if incoming else self.peers.get(port, "other")] += 1
        return {"asyncio_tasks_min": min(seen), "asyncio_tasks_seen": seen, **self.facts(m),
                "sockets_by_peer": dict(sorted(sockets.items()))}, m  # fmt: skip


@contextmanager
def started(config: Config) -> Iterator[World]:
    """Every server up and the manager ready; all stopped in reverse order on any exit."""
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        _say(f"starting PostgreSQL, nats-server and the control plane under {workdir}")
        pg, nats = stack.enter_context(data_servers(workdir))
        backend = LocalBackend(NODE, KEY.public_key())
        server = stack.enter_context(backend.serve())
        found = stack.enter_context(cluster.running(workdir))
        env = base_env(  # only this reaches the manager: it runs in the temporary directory
            HOME=str(workdir), DATA_DIR=str(workdir / "data"), EMBEDDED_SERVICES="false",
            LOG_LEVEL="INFO", LOG_FORMAT="text",  # the log scan reads the level column
            NODE_ID=NODE, NODE_TIER=config.tier, MANAGED_NAMESPACE=cluster.NAMESPACE,
            PING_TOKEN_SECRET=SECRET, SYNC_INTERVAL_SECONDS=str(config.sync_interval),
            REPORT_INTERVAL_SECONDS=str(config.report_interval), REPORT_ENABLED="true",
            SYNC_ENABLED="true", WORKER_ENABLED="true",
            # every simulated workload pings from this one address (pods each have their own)
            HTTP_MAX_CONNECTIONS_PER_CLIENT="1000", MAX_DESIRED_WORKLOADS="500",
            DATABASE_URL=pg.url, NATS_URL=nats.url, NODE_SYSTEM_ENDPOINT=server.url,
            NODE_PRIVATE_KEY=key_seed(), KUBECONFIG=str(found.kubeconfig),
        )  # fmt: skip
        (workdir / "data").mkdir()
        manager = ServerProcess(manager_spec(env, workdir), log=workdir / "manager.log")
        peers = {pg.port: "postgres", nats.port: "nats", server.port: "backend",
                 found.plane.api_port: "kube API"}  # fmt: skip
        world = World(config, workdir, nats.url, pg.url, backend, found,
                      found.settled_snapshot(), manager, peers)  # fmt: skip
        world.desire({f"soak-{i:03d}": "1.0.0" for i in range(config.workloads)})
        stack.callback(manager.stop)  # first to go: registered last
        _say(f"starting the manager on port {manager.port}")
        manager.start()
        yield world


async def pings(world: World, seconds: float) -> Json:
    """wrk: one connection per workload, pinging every `ping_interval` on a new connection."""
    tokens = [f"{n}={ping_token(SECRET, n)}" for n in sorted(world.desired)]
    env = os.environ | {"PINGS_DELAY_MS": str(int(world.config.ping_interval * 1000)),
                        "PINGS_VERSIONS": str(world.workdir / "ping-versions.txt"),
                        "PINGS_DEGRADED": "0.02", "PINGS_CLOSE": "1",
                        "PINGS_STATUSES": "1"}  # fmt: skip
    child = await asyncio.create_subprocess_exec(
        tools.find("wrk"), "-t1", f"-c{len(tokens)}", f"-d{max(1, round(seconds))}s",
        f"--timeout={TIMEOUT:g}s", "-s", str(WRK_SCRIPT), f"http://127.0.0.1:{world.manager.port}",
        "--", "-", *tokens, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"wrk exited with {child.returncode}: {err.decode()[-800:]}")
    summary: Json = json.loads(out.decode().strip().splitlines()[-1])
    return summary


async def _drained(bus: JetStreamBus, tier: str, quiet: float) -> tuple[bool, Json]:
    """The job consumers emptied (or 60 s passed), then `quiet` seconds of quiet."""
    deadline = time.monotonic() + 60.0
    while True:
        state = {s: await bus.consumer_state(s, consumer_name(tier)) for s in STREAMS.values()}
        drained = all(s["pending"] == s["ack_pending"] == 0 for s in state.values())
        if drained or time.monotonic() > deadline:
            await asyncio.sleep(quiet)
            return drained, state
        await asyncio.sleep(0.2)


async def _soak(world: World) -> Json:
    config, o = world.config, Json()
    bus = JetStreamBus(NatsServers.parse(world.nats_url), name="soak-publisher", timeout=TIMEOUT)
    await bus.connect()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{world.manager.port}", timeout=10.0)
    try:
        for attempt in range(150):  # the manager creates its streams and consumers at start
            try:
                await _drained(bus, config.tier, 0.0)
                break
            except Exception:
                if attempt == 149:
                    raise
                await asyncio.sleep(0.2)
        _say(f"load on: {config.workloads} workloads, {config.job_rate:g} jobs/s, "
             f"{config.seconds:.0f} s ({config.warmup_seconds:.0f} s warm-up)")  # fmt: skip
        world.started = load_started = time.monotonic()
        world.running.set()
        background = [asyncio.create_task(c) for c in (world.publish_jobs(bus),
                      world.bump_versions(), world.record(client))]  # fmt: skip
        try:
            o["warmup_pings"] = await pings(world, config.warmup_seconds)
            _say("warm-up over: pausing the load for a quiet reading")
            world.phase = "quiet"
            world.running.clear()
            await _drained(bus, config.tier, config.quiet_seconds)
            o["baseline"], o["start_scrape"] = await world.quiet_reading(client)
            world.phase, measured_started = "measured", time.monotonic()
            world.running.set()
            left = load_started + config.seconds - measured_started
            measuring = asyncio.create_task(pings(world, left))
            await asyncio.sleep(min(config.sample_seconds, config.seconds))
            o["load_start_sample"] = await world.sample(client)
            o["pings"] = await measuring
            o["load_end_sample"] = await world.sample(client)
            o["measured_seconds"] = round(time.monotonic() - measured_started, 1)
            _say("load off: stopping the generators")
            world.phase = "drain"
            world.halt()
            await asyncio.gather(*background[:2])
            deadline = time.monotonic() + 3 * config.sync_interval + 15
            while True:  # the syncs make the cluster match the desired versions
                deployed = world.cluster.versions()
                o["not_converged"] = {n: [world.desired.get(n, ""), deployed.get(n, "")]
                                      for n in {*world.desired, *deployed}
                                      if world.desired.get(n) != deployed.get(n)}  # fmt: skip
                if not o["not_converged"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            o["drained"], o["consumers_at_end"] = await _drained(bus, config.tier,
                                                                 config.quiet_seconds)  # fmt: skip
            world.phase = "quiet"
            o["final"], o["end_scrape"] = await world.quiet_reading(client)
        finally:
            world.halt()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        conn = await asyncpg.connect(world.pg_url, timeout=10)
        try:
            sql = "SELECT idempotency_key, status, attempts FROM job_ledger WHERE idempotency_key"
            rows = await conn.fetch(f"{sql} LIKE $1", world.prefix + "%")
        finally:
            await conn.close()
    finally:
        await bus.drain()
        await client.aclose()
    status = {r["idempotency_key"]: r["status"] for r in rows}
    unfinished = Counter(s for s in status.values() if s != "completed")
    lost = [key for key in world.published if status.get(key) != "completed"]
    seen = world.backend.requests
    kube = Cluster.between(world.at_start, world.cluster.settled_snapshot())
    return o | {
        "ledger": {  # every job JetStream acked must be one completed ledger row
            "published": len(world.published), "completed": len(world.published) - len(lost),
            "lost": len(lost), "lost_keys_first": lost[:10],
            "not_completed_by_status": dict(unfinished),
            "claimed_more_than_once": sum(1 for r in rows if r["attempts"] > 1),
            # rows whose publish the soak saw fail (the ack was lost)
            "completed_without_publish_ack": len(set(status) - set(world.published)),
        },
        "samples": world.samples, "versions_bumped": world.bumped,
        "jobs": {"attempted": world.attempted, "published": len(world.published),
                 "publish_failures": dict(world.failures), "by_kind": dict(world.by_kind)},
        "scrape_failures": dict(world.scrape_failures),
        "backend": {"requests": len(seen), "by_status": dict(Counter(str(r.status) for r in seen)),
                    "rejected": len(world.backend.rejected),
                    "errors": sum(1 for r in seen if r.status >= 400),
                    "reports": sum(1 for r in seen if r.route == "health" and r.status == 202),
                    "versions": len(world.backend.versions)},
        # 404: a create first reads the name; 409: an apply conflict is re-planned
        "kube": {"requests": kube.total, "by_status": kube.by("status"), "by_kind": kube.by(),
                 "not_counted": dict(kube.other.most_common()),
                 "errors": sum(n for k, n in kube.counted.items() if k.code not in (404, 409)
                               and k.code >= 400)},
    }  # fmt: skip


def scan_log(path: Path) -> Json:
    """Lines by level, Traceback lines, the first errors, warnings by message (numbers masked)."""
    levels: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    errors: list[str] = []
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for line in lines:
        if match := _LINE.match(line):
            levels[match["level"]] += 1
            if match["level"] == "WARNING":
                warnings[f"{match['logger']}: {_NUMBER.sub('N', match['message'])}"] += 1
        elif not line.startswith("Traceback (most recent call last)"):
            continue
        if (match is None or match["level"] in ("ERROR", "CRITICAL")) and len(errors) < 20:
            errors.append(line)
    tracebacks = sum(1 for line in lines if line.startswith("Traceback (most recent call last)"))
    return {"lines": len(lines), "by_level": dict(levels),
            "error_lines": levels["ERROR"] + levels["CRITICAL"], "tracebacks": tracebacks,
            "first_errors": errors,
            "warnings_by_message": dict(warnings.most_common(20))}  # fmt: skip


def _outcome(*names: str, bad: bool = False) -> Callable[[Labels], bool]:
    """The samples that count as errors: an outcome not among `names` (`bad`: among them)."""
    return lambda labels: (labels.get("outcome") in names) == bad


# Server-side error counters: (what, counter, which samples). Every one must stay at 0;
# a skipped (the cluster lock held elsewhere) or cancelled (shutdown) run attempted nothing.
ERROR_COUNTERS: tuple[tuple[str, str, Callable[[Labels], bool] | None], ...] = (
    ("scheduled loop runs failed, raised or unavailable", "scheduled_runs_total",
     _outcome("failed", "error", "unavailable", bad=True)),
    ("job deliveries not completed", "jobs_total", _outcome("completed")),
    ("sync actions failed", "sync_actions_total", _outcome("failed", bad=True)),
    ("pings rejected", "ping_rejections_total", None),
    ("alerts dropped", "alerts_total", _outcome("dropped", bad=True)),
)  # fmt: skip
# What the manager says it did: its counters by their labels, for the traffic table.
ACTIVITY = {
    "pings_by_status": ("pings_total", "status"),
    "ping_rejections": ("ping_rejections_total", "reason"), "jobs": ("jobs_total", "outcome"),
    "sync_actions": ("sync_actions_total", "action", "outcome"),
    "scheduled_runs": ("scheduled_runs_total", "loop", "outcome"),
    "alerts": ("alerts_total", "outcome"), "workloads_by_status": ("workloads", "status"),
}  # fmt: skip


def server_errors(m: Metrics) -> dict[str, int]:
    return {what: int(m.total(f"{PREFIX}_{name}", where)) for what, name, where in ERROR_COUNTERS}


def activity(m: Metrics) -> Json:
    found: Json = {"pings_accepted": int(m.total(f"{PREFIX}_pings_total")),
             "jobs_unroutable": int(m.total(f"{PREFIX}_jobs_unroutable_total")),
             **{key: m.by(f"{PREFIX}_{name}", *labels)
                for key, (name, *labels) in ACTIVITY.items()}}  # fmt: skip
    # the sync's, the report's and the heartbeat's runs by outcome (the supervisor's count)
    runs: dict[str, float] = found["scheduled_runs"]
    for key, loop in (("syncs", "sync"), ("reports", "report"), ("heartbeats", "heartbeat")):
        found[key] = {k.partition("/")[2]: v for k, v in runs.items()
                      if k.partition("/")[0] == loop}  # fmt: skip
    return found


def _pings(o: Json) -> Json:
    """Both wrk runs: sent, failed, by status, transport errors; latency measured only."""
    runs, statuses = (o["warmup_pings"], o["pings"]), Counter[str]()
    for run in runs:
        statuses.update(run["statuses"])
    transport = {k: sum(r[k] for r in runs) for k in ("connect", "read", "write", "timeout")}
    bad = sum(n for s, n in statuses.items() if not 200 <= int(s) < 300)
    return {"sent": sum(statuses.values()) + sum(transport.values()),
            "failed": bad + sum(transport.values()), "statuses": dict(sorted(statuses.items())),
            "transport_errors": {k: v for k, v in transport.items() if v},
            "latency_ms_measured_phase": {k: round(o["pings"]["latency_us"][k] / 1000, 2)
                                          for k in ("p50", "p99", "max")}}  # fmt: skip


def _client_errors(o: Json) -> dict[str, int]:
    return {"pings without a 2xx": _pings(o)["failed"],
            "job publishes without an ack": sum(o["jobs"]["publish_failures"].values()),
            "/metrics scrapes failed": sum(o["scrape_failures"].values()),
            "backend: requests rejected (contract)": o["backend"]["rejected"],
            "backend: answers >= 400": o["backend"]["errors"],
            "kube API: unexpected answers": o["kube"]["errors"]}  # fmt: skip


def _errors(o: Json) -> dict[str, int]:
    """Every error source: the manager's counters, the client side, the log."""
    manager = {f"manager: {k}": v for k, v in server_errors(o["end_scrape"]).items()}
    log = {"log: ERROR/CRITICAL lines": o["log"]["error_lines"],
           "log: Traceback lines": o["log"]["tracebacks"]}  # fmt: skip
    return manager | _client_errors(o) | log


def _trend(samples: list[Json]) -> float | None:
    """Least-squares RSS trend over the measured phase, MB/h: a leak shows as a steady slope."""
    points = [(s["t"], s["rss_mb"]) for s in samples if s["phase"] == "measured"]
    if len(points) < 2 or points[-1][0] - points[0][0] < TREND_MIN_SECONDS:
        return None
    return round(statistics.linear_regression(*zip(*points, strict=True))[0] * 3600, 2)


def checks(o: Json) -> list[Json]:
    b, f, ledger = o["baseline"], o["final"], o["ledger"]
    down = sorted({c for s in o["samples"] for c in s["components_down"]})
    growth, errors = f["rss_mb"] - b["rss_mb"], sum(_errors(o).values())
    leaked = f["asyncio_tasks_min"] - b["asyncio_tasks_min"]
    found = [
        ("manager RSS growth (quiet, after warm-up -> end)", f"< {RSS_GROWTH_TARGET_MB} MB",
         f"{growth:+.1f} MB", growth < RSS_GROWTH_TARGET_MB),
        ("asyncio tasks leaked (quiet, end - after warm-up)", "0", f"{leaked:+d}", leaked <= 0),
        ("errors (manager counters + client side + log)", "0", str(errors), errors == 0),
        ("jobs lost (JetStream acked, not completed in the ledger)", "0",
         f"{ledger['lost']} of {ledger['published']}",
         ledger["lost"] == 0 and ledger["completed"] == ledger["published"]),
        ("job consumers drained at the end", "nothing pending or unacked",
         "yes" if o["drained"] else f"no: {o['consumers_at_end']}", o["drained"]),
        ("cluster converged to the desired versions at the end", "yes",
         f"no: {len(o['not_converged'])} differ" if o["not_converged"] else "yes",
         not o["not_converged"]),
        ("components never down (component_up, every sample)", "none", ", ".join(down) or "none",
         not down),
        ("manager stopped cleanly on SIGTERM", "exit 0 or -15", str(o["manager_exit"]),
         o["manager_exit"] in (0, -15)),
    ]  # fmt: skip
    return [dict(zip(("what", "target", "observed", "met"), c, strict=True)) for c in found]


def _counts(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {int(v):,}" for k, v in values.items()) or "-"


def _tables(o: Json, found: list[Json]) -> list[Json]:
    b, f, s0, s1 = o["baseline"], o["final"], o["load_start_sample"], o["load_end_sample"]
    peers = sorted({*b["sockets_by_peer"], *f["sockets_by_peer"]})
    moved = {p: f["sockets_by_peer"].get(p, 0) - b["sockets_by_peer"].get(p, 0) for p in peers}
    targets: list[list[Any]] = [
        ["manager RSS, MB (quiet)", f"{b['rss_mb']:.1f}", f"{f['rss_mb']:.1f}",
         f"{f['rss_mb'] - b['rss_mb']:+.1f}", f"< {RSS_GROWTH_TARGET_MB} MB growth"],
        ["manager RSS, MB (under load)", f"{s0['rss_mb']:.1f}", f"{s1['rss_mb']:.1f}",
         f"{s1['rss_mb'] - s0['rss_mb']:+.1f}", None],
        *([what, b[k], f[k], f"{f[k] - b[k]:+d}", target] for what, k, target in (
            ("asyncio tasks (quiet, min of reads)", "asyncio_tasks_min", "0 leaked"),
            ("open file descriptors (quiet)", "fds", None), ("threads (quiet)", "threads", None))),
        ["TCP sockets (quiet; change by peer)", sum(b["sockets_by_peer"].values()),
         sum(f["sockets_by_peer"].values()),
         ", ".join(f"{p} {n:+d}" for p, n in moved.items() if n) or "+0", None],
    ]  # fmt: skip
    if (slope := _trend(o["samples"])) is not None:
        targets.append(
            ["RSS trend over the measured phase", None, None, f"{slope:+.1f} MB/h", None]
        )
    targets += [[c["what"], None, None, c["observed"], f"{c['target']}: "
                 f"{'met' if c['met'] else 'NOT MET'}"] for c in found[2:]]  # fmt: skip
    seen, p, ledger, backend = activity(o["end_scrape"]), _pings(o), o["ledger"], o["backend"]
    lat = p["latency_ms_measured_phase"]
    traffic = [
        ["pings sent (client, wrk)", p["sent"], f"answers {_counts(p['statuses'])}; transport "
         f"errors {sum(p['transport_errors'].values())}; measured phase p50 / p99 / max "
         f"{lat['p50']} / {lat['p99']} / {lat['max']} ms"],
        ["pings accepted (manager)", seen["pings_accepted"], f"by status: "
         f"{_counts(seen['pings_by_status'])}; rejected: {_counts(seen['ping_rejections'])}"],
        ["jobs published (JetStream acked)", ledger["published"],
         f"attempted {o['jobs']['attempted']:,}; failures {_counts(o['jobs']['publish_failures'])}"
         f"; by kind {_counts(o['jobs']['by_kind'])}"],
        ["jobs completed (ledger)", ledger["completed"], f"lost {ledger['lost']}; claimed twice "
         f"{ledger['claimed_more_than_once']}; worker outcomes: {_counts(seen['jobs'])}"],
        ["syncs done", sum(seen["syncs"].values()), f"by outcome: {_counts(seen['syncs'])}; "
         f"actions: {_counts(seen['sync_actions'])}; versions bumped {o['versions_bumped']}, "
         f"reported to the backend {backend['versions']}"],
        ["reports", sum(seen["reports"].values()), f"by outcome: {_counts(seen['reports'])}; "
         f"backend accepted {backend['reports']}"],
        *([what, sum(seen[what].values()), f"by outcome: {_counts(seen[what])}"]
          for what in ("heartbeats", "alerts")),
        ["backend requests", backend["requests"], _counts(backend["by_status"])],
        ["kube API requests", o["kube"]["requests"], _counts(o["kube"]["by_status"])],
    ]  # fmt: skip
    warnings = o["log"]["by_level"].get("WARNING", 0)
    errors = [*_errors(o).items(), ("log: WARNING lines (not counted as errors)", warnings)]
    samples = o["samples"]
    shown = samples[:: max(1, -(-len(samples) // SAMPLE_ROWS))]
    shown += samples[-1:] if samples and shown[-1] is not samples[-1] else []
    rows = [[s["t"], s["phase"], s["rss_mb"], s["asyncio_tasks"], s["fds"], s["threads"],
             100 * (s["cpu_seconds"] - prev["cpu_seconds"]) / (s["t"] - prev["t"])
             if prev and s["t"] > prev["t"] else None, s["server_errors"]]
            for prev, s in zip([None, *shown], shown, strict=False)]  # fmt: skip
    return [
        table("soak: targets", "measure|after warm-up|at the end|change|target", targets),
        table("soak: traffic (whole run)", "what|count{,.0f}|detail", traffic),
        table("soak: errors (whole run)", "source|count", errors),
        table(f"soak: the manager every ~{o['config']['sample_seconds']:.0f} s ({len(shown)} of "
              f"{len(samples)} samples; RSS, CPU, fds from its /metrics)", "t s{.0f}|phase|"
              "RSS MB{.1f}|asyncio tasks|fds|threads|CPU % since prev row{.0f}|errors", rows),
    ]  # fmt: skip


def build(o: Json) -> Json:
    found, c, log = checks(o), o["config"], o["log"]
    missed = "; ".join(f"{x['what']}: {x['observed']} (target {x['target']})"
                       for x in found if not x["met"])  # fmt: skip
    b, f = o["baseline"], o["final"]
    warnings = list(log["warnings_by_message"].items())[:5]
    notes = [
        f"load for {c['seconds']:.0f} s ({c['warmup_seconds']:.0f} s warm-up, measured "
        f"{o['measured_seconds']:.0f} s): {c['workloads']} workloads pinging every "
        f"{c['ping_interval']:.0f} s, {c['job_rate']:g} noop jobs/s (tier {c['tier']}), "
        f"{c['bump_count']} versions bumped every {c['bump_seconds']:.0f} s; syncs every "
        f"{c['sync_interval']:.0f} s, reports every {c['report_interval']:.0f} s.",
        *(["first ERROR/Traceback lines: " + " | ".join(log["first_errors"][:5])]
          if log["first_errors"] else []),
        *(["most frequent WARNING lines (numbers masked): " + "; ".join(
            f"{n}x {msg}" for msg, n in warnings)] if warnings else []),
        *([f"lost job keys (first few): {', '.join(o['ledger']['lost_keys_first'])}"]
          if o["ledger"]["lost_keys_first"] else []),
        *([f"not converged (desired, deployed): {list(o['not_converged'].items())[:5]}"]
          if o["not_converged"] else []),
    ]  # fmt: skip
    hidden = ("baseline", "final", "start_scrape", "end_scrape", "warmup_pings", "pings",
              "load_start_sample", "load_end_sample", "scrape_failures", "ledger")  # fmt: skip
    return {k: v for k, v in o.items() if k not in hidden} | {
        "passed": not missed, "verdict": f"SOAK FAILED: {missed}" if missed
        else "SOAK PASSED: every target met, nothing lost", "checks": found,
        "rss_mb": {"after_warmup_quiet": b["rss_mb"], "end_quiet": f["rss_mb"],
                   "growth_quiet": round(f["rss_mb"] - b["rss_mb"], 2),
                   "measured_start_under_load": o["load_start_sample"]["rss_mb"],
                   "measured_end_under_load": o["load_end_sample"]["rss_mb"],
                   "trend_mb_per_hour": _trend(o["samples"])},
        "asyncio_tasks": {"after_warmup": b, "end": f,
                          "leaked": f["asyncio_tasks_min"] - b["asyncio_tasks_min"]},
        "server_errors": server_errors(o["end_scrape"]), "client_errors": _client_errors(o),
        "pings": _pings(o) | {"wrk": {"warm_up": o["warmup_pings"], "measured": o["pings"]}},
        "jobs": o["jobs"] | {"ledger": o["ledger"]}, "converged": not o["not_converged"],
        "manager_activity": activity(o["end_scrape"]),
        "manager_activity_after_warmup": activity(o["start_scrape"]),
        "tables": _tables(o, found), "notes": notes,
    }  # fmt: skip


def main() -> int:
    try:
        config = Config.from_env(os.environ)
    except ValueError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    output = Path(os.environ.get("SOAK_OUTPUT", "").strip() or RESULTS / "soak.json")
    # Ctrl-C and SIGTERM both end in KeyboardInterrupt, SIGINT even when inherited as
    # ignored (a shell's background job), so the servers are always stopped
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    machine = facts(RESULTS.parent.parent)
    print(headline(machine), flush=True)
    try:
        with started(config) as world:
            try:
                outcome = asyncio.run(_soak(world))
            except Exception:
                print(f"--- manager log (tail) ---\n{world.manager.log()}", file=sys.stderr)
                raise
            finally:
                _say("stopping the manager (SIGTERM)")
                code = world.manager.stop()
                if keep := os.environ.get("SOAK_KEEP_LOG", "").strip():
                    shutil.copyfile(world.manager.log_path, keep)
            report = build(outcome | {"config": asdict(config), "manager_exit": code,
                                      "log": scan_log(world.manager.log_path)})  # fmt: skip
    except KeyboardInterrupt:
        print("soak: interrupted; every server it started has been stopped", file=sys.stderr)
        return 130
    show(report)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"machine": machine} | report, indent=2, default=str) + "\n")
    print(f"\nresults: {output}\n{report['verdict']}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
