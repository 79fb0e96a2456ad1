"""The soak run: `python -m bench.soak`. Does the manager leak under steady, realistic load?

The manager runs as a child process (`python -m app serve`) against real PostgreSQL and
nats-server, the local backend and a real kube-apiserver and deployment controller (kwok
nodes, bench/cluster.py), syncing every 10 s and reporting every 10 s, while 100 workloads
ping it every 5 s (wrk at a fixed rate: one connection per workload, each waiting the
interval after its answer, bench/load/pings.lua), noop jobs flow through JetStream at a
fixed rate and a few desired versions change every minute. Every ~10 s its /metrics is
read: RSS, CPU and open file descriptors from the process collector, the asyncio task
gauge and the error counters (threads from /proc).

Leaks are judged between two quiet readings (load paused after the warm-up, load stopped
at the end): RSS growth < 5 MB and no more asyncio tasks. Errors (the manager's error
counters, client-side failures, ERROR/Traceback lines in its log) must be 0, every job
JetStream acked must be completed in the ledger, and the cluster must end converged.
The report is printed and written to bench/results/soak.json; the exit code is 1 when
any of that fails, 2 for a bad setting, 130 when interrupted.

Environment: SOAK_SECONDS (600: the whole load, warm-up included), SOAK_WARMUP_SECONDS
(60), SOAK_WORKLOADS (100), SOAK_JOB_RATE (10 jobs/s), SOAK_BUMP_SECONDS (60; 0: never),
SOAK_OUTPUT (bench/results/soak.json), SOAK_KEEP_LOG (a path to copy the manager's log to).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import asyncpg
import httpx
import psutil
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.adapters.bus import JetStreamBus
from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.domain.jobs import STREAMS, consumer_name
from app.domain.nats_servers import NatsServers
from app.domain.tokens import ping_token
from app.services.streams import new_job, publish_job
from bench import proc, tools
from bench.cluster import Cluster, Requests, Snapshot, running
from bench.machine import facts, headline
from bench.report import MB, say, show
from bench.servers import HOST, ServerProcess, ServerSpec
from bench.soak_report import LedgerCheck, Outcome, QuietReading, Sample, build, server_errors
from standins.backend import LocalBackend
from standins.sync_world import manifest

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
WRK_SCRIPT = Path(__file__).resolve().parent / "load" / "pings.lua"
NODE, TIER, NAMESPACE, FIRST_VERSION = "soak-node", "A", "workloads", "1.0.0"
PING_TOKEN_SECRET = "soak-ping-token-secret"  # only ever sent to 127.0.0.1
PREFIX = "workload_manager"
TASKS = f"{PREFIX}_asyncio_tasks"
QUIET_SECONDS = 6.0  # > uvicorn's 5 s keep-alive: every idle connection is closed by then
QUIET_READS, QUIET_READ_STEP = 10, 0.5  # gauge reads in a quiet reading; the minimum is taken
DRAIN_TIMEOUT = 60.0  # seconds for the job consumers to empty once the load stops
READY_TIMEOUT = 30.0  # seconds for the manager's job streams to exist after /readyz
PING_TIMEOUT = 5.0  # seconds; a ping slower than this counts as an error
DEGRADED_SHARE = 0.02  # of pings; the rest say healthy
PUBLISH_TIMEOUT = 5.0
JOB_KINDS: tuple[str, ...] = tuple(STREAMS)  # online, offline, write: every tier consumer works
JOB_MAX_DELAY = 0.02  # seconds a noop job sleeps at most (uniform), so jobs overlap a little
LOST_KEYS_SHOWN = 10


def _say(message: str) -> None:
    say("soak", message)


@dataclass(frozen=True)
class Config:
    seconds: float = 600.0
    warmup_seconds: float = 60.0
    workloads: int = 100
    ping_interval: float = 5.0
    job_rate: float = 10.0
    bump_seconds: float = 60.0
    bump_count: int = 5
    sample_seconds: float = 10.0
    sync_interval: float = 10.0
    report_interval: float = 10.0
    quiet_seconds: float = QUIET_SECONDS
    tier: str = TIER

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Config:
        """Read the SOAK_* variables; ValueError names the one that is wrong."""

        def number(name: str, default: float, low: float) -> float:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None
            if value < low:
                raise ValueError(f"{name}={raw} must be at least {low:g}")
            return value

        config = cls(
            seconds=number("SOAK_SECONDS", cls.seconds, 10.0),
            warmup_seconds=number("SOAK_WARMUP_SECONDS", cls.warmup_seconds, 0.0),
            workloads=int(number("SOAK_WORKLOADS", cls.workloads, 1)),
            job_rate=number("SOAK_JOB_RATE", cls.job_rate, 0.1),
            bump_seconds=number("SOAK_BUMP_SECONDS", cls.bump_seconds, 0.0),
        )
        if config.workloads > 500:
            raise ValueError("SOAK_WORKLOADS must be at most 500 (MAX_TRACKED_WORKLOADS)")
        if config.seconds - config.warmup_seconds < 2 * config.sample_seconds:
            raise ValueError(
                f"SOAK_SECONDS ({config.seconds:g}) must exceed SOAK_WARMUP_SECONDS "
                f"({config.warmup_seconds:g}) by at least {2 * config.sample_seconds:g} s"
            )
        return config


# --- the world ---------------------------------------------------------------------------


@dataclass
class World:
    """PostgreSQL, nats-server, the local backend, the control plane and the manager, all
    on free loopback ports under one temporary directory."""

    workdir: Path
    pg: EmbeddedPostgres
    nats: EmbeddedNats
    backend: LocalBackend
    requests: Cluster
    requests_at_start: Snapshot  # before the manager started
    manager: ServerProcess
    backend_port: int
    desired: dict[str, str] = field(default_factory=dict)  # name -> version desired now

    @property
    def manager_url(self) -> str:
        return f"http://{HOST}:{self.manager.port}"

    @property
    def versions_file(self) -> Path:
        return self.workdir / "ping-versions.txt"  # what the pings report (pings.lua)

    def desire(self, versions: Mapping[str, str]) -> None:
        """Serve these versions (and their manifests) as the backend's desired state."""
        for name, version in versions.items():
            if self.desired.get(name) != version:
                self.backend.set_manifest(name, version, manifest(name, version))
        self.desired.update(versions)
        self.backend.set_desired([{"name": n, "version": v} for n, v in self.desired.items()])
        part = self.versions_file.with_suffix(".part")
        part.write_text("".join(f"{n} {v}\n" for n, v in self.desired.items()))
        part.replace(self.versions_file)

    def peers(self) -> dict[int, str]:
        return {self.pg.port: "postgres", self.nats.port: "nats",
                self.backend_port: "backend", self.requests.plane.api_port: "kube API"}  # fmt: skip

    def deployed_versions(self) -> dict[str, str]:
        """Managed Deployments by name, with their version (one LIST as the admin, left out
        of `kube_requests`)."""
        return self.requests.versions()

    def kube_requests(self) -> Requests:
        """The Deployment requests since the world started, as the API server counts them."""
        return Cluster.between(self.requests_at_start, self.requests.settled_snapshot())


def manager_env(workdir: Path, world: dict[str, str], config: Config) -> dict[str, str]:
    """Only what is set here reaches the manager: not the shell's environment, not a `.env`
    (it runs in the temporary directory)."""
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": str(workdir)}
    return env | world | {
        "HOST": HOST, "DATA_DIR": str(workdir / "data"), "EMBEDDED_SERVICES": "false",
        "LOG_LEVEL": "INFO", "LOG_FORMAT": "text",  # the log scan reads the level column
        "NODE_ID": NODE, "NODE_TIER": TIER, "MANAGED_NAMESPACE": NAMESPACE,
        "PING_TOKEN_SECRET": PING_TOKEN_SECRET,
        "SYNC_INTERVAL_SECONDS": str(config.sync_interval),
        "REPORT_INTERVAL_SECONDS": str(config.report_interval),
        "REPORT_ENABLED": "true", "SYNC_ENABLED": "true", "WORKER_ENABLED": "true",
        # every simulated workload pings from this one address (pods each have their own)
        "HTTP_MAX_CONNECTIONS_PER_CLIENT": "1000",
        "MAX_DESIRED_WORKLOADS": "500",  # the soak's own bound on its workloads
    }  # fmt: skip


@contextmanager
def started(config: Config) -> Iterator[World]:
    """Every server up, the desired state served, the manager ready; all stopped in reverse
    order on any exit, an exception or Ctrl-C included."""
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "data").mkdir()
        _say(f"starting PostgreSQL and nats-server under {workdir}")
        pg = EmbeddedPostgres(workdir / "postgres")
        stack.callback(pg.stop)
        pg.start()
        nats = EmbeddedNats(workdir / "nats")
        stack.callback(nats.stop)
        nats.start()
        key = Ed25519PrivateKey.generate()
        backend = LocalBackend(NODE, key.public_key())
        server = stack.enter_context(backend.serve())
        _say("starting the control plane (etcd, kube-apiserver, controllers, kwok)")
        requests = stack.enter_context(running(workdir))
        seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())  # fmt: skip
        env = manager_env(workdir, {
            "DATABASE_URL": pg.url, "NATS_URL": nats.url, "NODE_SYSTEM_ENDPOINT": server.url,
            "NODE_PRIVATE_KEY": base64.b64encode(seed).decode(),
            "KUBECONFIG": str(requests.kubeconfig),
        }, config)  # fmt: skip
        spec = ServerSpec("manager", (sys.executable, "-m", "app", "serve"), env, workdir)
        manager = ServerProcess(spec, log=workdir / "manager.log")
        port = manager.port
        at_start = requests.settled_snapshot()
        world = World(workdir, pg, nats, backend, requests, at_start, manager, server.port)
        world.desire({f"soak-{i:03d}": FIRST_VERSION for i in range(config.workloads)})
        stack.callback(manager.stop)  # first to go: registered last
        _say(f"starting the manager on port {port}")
        manager.start()
        _say(f"manager ready (pid {manager.pid})")
        yield world


# --- the load ----------------------------------------------------------------------------


async def pings(world: World, config: Config, seconds: float) -> dict[str, Any]:
    """wrk for `seconds`: one connection per workload, each pinging every `ping_interval`
    (after the answer; a new connection each time, as a pod's client would)."""
    tokens = [f"{n}={ping_token(PING_TOKEN_SECRET, n)}" for n in sorted(world.desired)]
    env = os.environ | {
        "PINGS_DELAY_MS": str(int(config.ping_interval * 1000)),
        "PINGS_VERSIONS": str(world.versions_file), "PINGS_DEGRADED": str(DEGRADED_SHARE),
        "PINGS_CLOSE": "1", "PINGS_STATUSES": "1",
    }  # fmt: skip
    child = await asyncio.create_subprocess_exec(
        tools.find("wrk"), "-t1", f"-c{len(tokens)}", f"-d{max(1, round(seconds))}s",
        f"--timeout={PING_TIMEOUT:g}s", "-s", str(WRK_SCRIPT), world.manager_url, "--", "-",
        *tokens, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"wrk exited with {child.returncode}: {err.decode()[-800:]}")
    summary: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return summary


@dataclass
class Gate:
    """Open: the publishers run. Closed: they finish what is in flight and wait."""

    running: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def tick(self, seconds: float) -> bool:
        """Sleep, then wait while closed; False once stopping."""
        if seconds > 0:
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=seconds)
            except TimeoutError:
                pass
        await self.running.wait()
        return not self.stop.is_set()

    def halt(self) -> None:
        self.stop.set()
        self.running.set()


@dataclass
class JobStats:
    published: list[str] = field(default_factory=list)  # idempotency keys JetStream acked
    attempted: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # by exception type
    by_kind: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {"attempted": self.attempted, "published": len(self.published),
                "publish_failures": dict(self.failures), "by_kind": dict(self.by_kind)}  # fmt: skip


async def publish_jobs(bus: JetStreamBus, config: Config, gate: Gate, stats: JobStats,
                       prefix: str) -> None:  # fmt: skip
    """noop jobs at a steady rate (open loop), the job kinds of one tier in turn; keys
    unique per run, so every acked publish must end as one completed ledger row."""
    next_at = time.monotonic()
    for seq in itertools.count():
        if not await gate.tick(next_at - time.monotonic()):
            return
        kind = JOB_KINDS[seq % len(JOB_KINDS)]
        key = f"{prefix}{seq:07d}"
        payload = {"seq": seq, "delay_seconds": round(random.uniform(0, JOB_MAX_DELAY), 4)}
        stats.attempted += 1
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                job = new_job("noop", idempotency_key=key, payload=payload)
                await publish_job(bus, job, kind=kind, tier=config.tier)
        except Exception as exc:  # any failure to get JetStream's ack is a client-side error
            stats.failures[type(exc).__name__] += 1
        else:
            stats.published.append(key)
            stats.by_kind[kind] += 1
        # fallen behind by more than a second (a slow publish): do not burst to catch up
        next_at = max(next_at + 1.0 / config.job_rate, time.monotonic() - 1.0)


async def bump_versions(world: World, config: Config, gate: Gate, bumped: list[int]) -> None:
    """Every `bump_seconds`, a new minor version for the next `bump_count` workloads (round
    robin), so syncs keep fetching manifests, applying and reporting versions."""
    if config.bump_seconds <= 0:
        return
    names = itertools.cycle(sorted(world.desired))
    while await gate.tick(config.bump_seconds):
        chosen = [next(names) for _ in range(min(config.bump_count, len(world.desired)))]
        world.desire({n: _next_minor(world.desired[n]) for n in chosen})
        bumped[0] += len(chosen)


def _next_minor(version: str) -> str:
    major, minor, _patch = (int(part) for part in version.split("."))
    return f"{major}.{minor + 1}.0"


# --- observing the manager ---------------------------------------------------------------


class Probe:
    """The manager's /metrics and, for what no metric says, its process."""

    def __init__(self, world: World) -> None:
        self._pid = world.manager.pid
        self._port = world.manager.port
        self._peers = world.peers()
        self._client = httpx.AsyncClient(base_url=world.manager_url, timeout=10.0)
        self.started = time.monotonic()
        self.phase = "warm-up"
        self.samples: list[Sample] = []
        self.scrape_failures: Counter[str] = Counter()

    async def scrape(self) -> proc.Metrics | None:
        try:
            response = await self._client.get("/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self.scrape_failures[type(exc).__name__] += 1
            return None
        return proc.Metrics(response.text)

    async def sample(self) -> Sample:
        m = await self.scrape()

        def metric(name: str) -> float | None:
            return None if m is None else m.value(name)

        down = [] if m is None else [
            labels.get("component", "?")
            for labels, value in m.samples.get(f"{PREFIX}_component_up", []) if value == 0
        ]  # fmt: skip
        sample = Sample(
            t=time.monotonic() - self.started, phase=self.phase,
            rss_bytes=int(metric("process_resident_memory_bytes") or 0),
            fds=int(metric("process_open_fds") or 0), threads=proc.status(self._pid)["Threads"],
            cpu_seconds=metric("process_cpu_seconds_total") or 0.0,
            tasks=_int(metric(TASKS)), jobs_in_flight=_int(metric(f"{PREFIX}_jobs_in_flight")),
            components_down=tuple(down), errors=sum(server_errors(m).values()) if m else 0,
            pings=int(m.total(f"{PREFIX}_pings_total")) if m else 0,
        )  # fmt: skip
        self.samples.append(sample)
        return sample

    async def record(self, every: float) -> None:
        while True:
            s = await self.sample()
            _say(f"t={s.t:4.0f}s {s.phase:<8} RSS {s.rss_bytes / MB:6.1f} MB, tasks {s.tasks}, "
                 f"fds {s.fds}, errors {s.errors}; pings accepted {s.pings}")  # fmt: skip
            await asyncio.sleep(every)

    async def quiet_reading(self) -> tuple[QuietReading, proc.Metrics | None]:
        seen: list[int] = []
        m = None
        for i in range(QUIET_READS):
            if i:
                await asyncio.sleep(QUIET_READ_STEP)
            m = await self.scrape()
            if m is not None and (tasks := m.value(TASKS)) is not None:
                seen.append(int(tasks))
        if not seen or m is None:
            raise RuntimeError(f"the manager exported no {TASKS} gauge in {QUIET_READS} scrapes")
        reading = QuietReading(
            tasks_min=min(seen), tasks_seen=tuple(seen),
            rss_bytes=int(m.value("process_resident_memory_bytes") or 0),
            fds=int(m.value("process_open_fds") or 0), threads=proc.status(self._pid)["Threads"],
            sockets=self.sockets(),
        )  # fmt: skip
        return reading, m

    def sockets(self) -> dict[str, int]:
        """TCP sockets of the manager by the server at the other end (or listening)."""
        counts: Counter[str] = Counter()
        for conn in psutil.Process(self._pid).net_connections(kind="tcp"):
            port: int | None = getattr(conn.raddr, "port", None)  # () when not connected
            if conn.status == psutil.CONN_LISTEN or port is None:
                counts["listening"] += 1
            elif conn.laddr.port == self._port:
                counts["incoming"] += 1  # pings, or the soak's own scrapes
            else:
                counts[self._peers.get(port, "other")] += 1
        return dict(sorted(counts.items()))


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


# --- phases ------------------------------------------------------------------------------


async def _consumers(bus: JetStreamBus, tier: str) -> dict[str, dict[str, int]]:
    return {s: await bus.consumer_state(s, consumer_name(tier)) for s in STREAMS.values()}


async def _drain(bus: JetStreamBus, config: Config) -> tuple[bool, dict[str, dict[str, int]]]:
    """Publishers paused or stopped: wait for the job consumers to empty, then be quiet."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while True:
        state = await _consumers(bus, config.tier)
        drained = all(s["pending"] == 0 and s["ack_pending"] == 0 for s in state.values())
        if drained or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(config.quiet_seconds)
    return drained, state


async def _converged(world: World, within: float) -> dict[str, list[str]]:
    """Wait for the syncs to make the cluster match the desired versions; what still differs."""
    deadline = time.monotonic() + within
    while True:
        deployed = world.deployed_versions()
        differ = {n: [v, deployed.get(n, "")] for n, v in world.desired.items()
                  if deployed.get(n) != v}  # fmt: skip
        differ |= {n: ["", v] for n, v in deployed.items() if n not in world.desired}
        if not differ or time.monotonic() > deadline:
            return differ
        await asyncio.sleep(0.5)


async def _ledger(url: str, published: list[str], prefix: str) -> LedgerCheck:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        rows = await conn.fetch("SELECT idempotency_key, status, attempts FROM job_ledger "
                                "WHERE idempotency_key LIKE $1", prefix + "%")  # fmt: skip
    finally:
        await conn.close()
    status = {r["idempotency_key"]: r["status"] for r in rows}
    lost = [key for key in published if status.get(key) != "completed"]
    return LedgerCheck(
        published=len(published),
        completed=sum(1 for key in published if status.get(key) == "completed"),
        lost=lost[:LOST_KEYS_SHOWN], lost_count=len(lost),
        not_completed=dict(Counter(s for s in status.values() if s != "completed")),
        claimed_more_than_once=sum(1 for r in rows if r["attempts"] > 1),
        unconfirmed_in_ledger=len(set(status) - set(published)),
    )  # fmt: skip


def _traffic(world: World) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the local backend and the API server saw: counts by status, unexpected answers."""
    seen = world.backend.requests
    backend = {
        "requests": len(seen),
        "by_status": dict(Counter(str(r.status) for r in seen)),
        "rejected": len(world.backend.rejected),
        "errors": sum(1 for r in seen if r.status >= 400),
        "reports": sum(1 for r in seen if r.route == "health" and r.status == 202),
        "versions": len(world.backend.versions),
    }
    kube = world.kube_requests()
    return backend, {
        "requests": kube.total, "by_status": kube.by("status"), "by_kind": kube.by(),
        "not_counted": dict(kube.other.most_common()),
        # 404: a create first reads the name; 409: an apply conflict is re-planned
        "errors": sum(n for k, n in kube.counted.items() if k.code >= 400
                      and k.code not in (404, 409)),
    }  # fmt: skip


async def _soak(config: Config, world: World) -> Outcome:
    probe = Probe(world)
    bus = JetStreamBus(
        NatsServers.parse(world.nats.url), name="soak-publisher", timeout=PUBLISH_TIMEOUT
    )
    await bus.connect()
    gate, jobs, bumped = Gate(), JobStats(), [0]
    prefix = f"soak-{uuid.uuid4().hex[:8]}-"
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:  # the manager creates its streams and consumers at start
            try:
                await _consumers(bus, config.tier)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        _say(f"load on: {config.workloads} workloads, {config.job_rate:g} jobs/s, "
             f"{config.seconds:.0f} s ({config.warmup_seconds:.0f} s warm-up)")  # fmt: skip
        probe.started = load_started = time.monotonic()
        gate.running.set()
        background = [
            asyncio.create_task(c)
            for c in (
                publish_jobs(bus, config, gate, jobs, prefix),
                bump_versions(world, config, gate, bumped),
                probe.record(config.sample_seconds),
            )
        ]
        try:
            warmup = await pings(world, config, config.warmup_seconds)
            _say("warm-up over: pausing the load for a quiet reading")
            probe.phase = "quiet"
            gate.running.clear()
            await _drain(bus, config)
            baseline, start_scrape = await probe.quiet_reading()
            _say(f"after warm-up: tasks {baseline.tasks_min}, RSS {baseline.rss_bytes / MB:.1f} MB")
            probe.phase = "measured"
            gate.running.set()
            measured_started = time.monotonic()
            measuring = asyncio.create_task(
                pings(world, config, load_started + config.seconds - measured_started)
            )
            await asyncio.sleep(min(config.sample_seconds, config.seconds))
            first = await probe.sample()
            measured = await measuring
            last = await probe.sample()
            measured_seconds = time.monotonic() - measured_started
            _say("load off: stopping the generators")
            probe.phase = "drain"
            gate.halt()
            await asyncio.gather(*background[:2])
            mismatched = await _converged(world, 3 * config.sync_interval + 15)
            drained, consumers = await _drain(bus, config)
            probe.phase = "quiet"
            final, end_scrape = await probe.quiet_reading()
            _say(f"at the end: tasks {final.tasks_min}, RSS {final.rss_bytes / MB:.1f} MB")
        finally:
            gate.halt()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        ledger = await _ledger(world.pg.url, jobs.published, prefix)
        backend, kube = _traffic(world)
    finally:
        await bus.drain()
        await probe._client.aclose()
    return Outcome(
        config=asdict(config), samples=probe.samples, baseline=baseline, final=final,
        load_start_sample=first, load_end_sample=last, start_scrape=start_scrape,
        end_scrape=end_scrape, warmup_pings=warmup, pings=measured, jobs=jobs.as_dict(),
        job_failures=dict(jobs.failures), job_kinds=dict(jobs.by_kind), ledger=ledger,
        drained=drained, consumers=consumers, converged=not mismatched, mismatched=mismatched,
        bumped=bumped[0], backend=backend, kube=kube,
        scrape_failures=dict(probe.scrape_failures), measured_seconds=measured_seconds,
    )  # fmt: skip


# --- the log -----------------------------------------------------------------------------

# The text format: "%H:%M:%S LEVEL   logger: message" (app/logs.py TextFormatter)
_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+)\s+(?P<logger>\S+): (?P<message>.*)$")
_NUMBERS = re.compile(r"\d+(\.\d+)?")
EXCERPT = 20  # lines of each kind kept for the report


def scan_log(path: Path) -> dict[str, Any]:
    """Lines by level, Traceback lines, the first errors, warnings by message (numbers masked)."""
    levels: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    errors: list[str] = []
    lines = tracebacks = 0
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        lines += 1
        match = _LINE.match(line)
        if line.startswith("Traceback (most recent call last)"):
            tracebacks += 1
        elif match is None:
            continue
        elif match["level"] == "WARNING":
            warnings[f"{match['logger']}: {_NUMBERS.sub('N', match['message'])}"] += 1
        if match is not None:
            levels[match["level"]] += 1
        if (match is None or match["level"] in ("ERROR", "CRITICAL")) and len(errors) < EXCERPT:
            errors.append(line)
    return {
        "lines": lines, "by_level": dict(levels),
        "error_lines": levels["ERROR"] + levels["CRITICAL"], "tracebacks": tracebacks,
        "first_errors": errors, "warnings_by_message": dict(warnings.most_common(EXCERPT)),
    }  # fmt: skip


# --- main --------------------------------------------------------------------------------


def _sigterm_as_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGTERM takes Ctrl-C's path, so the servers are stopped either way."""
    signal.raise_signal(signal.SIGINT)


def _run(config: Config) -> Outcome:
    with started(config) as world:
        try:
            outcome = asyncio.run(_soak(config, world))
        except Exception:
            print(f"--- manager log (tail) ---\n{world.manager.log()}", file=sys.stderr)
            raise
        finally:
            _say("stopping the manager (SIGTERM)")
            code = world.manager.stop()
            if keep := os.environ.get("SOAK_KEEP_LOG", "").strip():
                shutil.copyfile(world.manager.log_path, keep)
        outcome.manager_exit = code
        outcome.log = scan_log(world.manager.log_path)
    return outcome


def main() -> int:
    try:
        config = Config.from_env(dict(os.environ))
    except ValueError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    output = Path(os.environ.get("SOAK_OUTPUT", "").strip() or RESULTS / "soak.json")
    # Ctrl-C and SIGTERM both end in KeyboardInterrupt, SIGINT even when inherited as
    # ignored (a shell's background job), so the servers are always stopped
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_sigint)
    machine = facts(REPO)
    print(headline(machine), flush=True)
    try:
        outcome = _run(config)
    except KeyboardInterrupt:
        print("soak: interrupted; every server it started has been stopped", file=sys.stderr)
        return 130
    report = build(outcome)
    show(report)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"machine": machine} | report, indent=2, default=str) + "\n")
    print(f"\nresults: {output}")
    print(report["verdict"])
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
