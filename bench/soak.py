"""The soak run: `python -m bench.soak`. Does the manager leak under steady, realistic load?

The manager runs as a child process (`python -m app serve`) against real PostgreSQL and
nats-server, the local backend and a real kube-apiserver and deployment controller (kwok
nodes), syncing every 10 s and
reporting every 10 s, while 100 workloads ping it every 5 s, noop jobs flow through
JetStream and a few desired versions change every minute. Every ~10 s its RSS, file
descriptors, threads and /metrics are sampled.

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
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import asyncpg

from app.adapters.bus import JetStreamBus
from app.domain.jobs import STREAMS, consumer_name
from app.domain.nats_servers import NatsServers
from bench.__main__ import render_table
from bench.checks import say
from bench.machine import facts
from bench.soak_load import PUBLISH_TIMEOUT, Gate, JobFlow, Pingers, VersionBumper
from bench.soak_observe import MB, Probe, QuietReading, Sample, Scrape, scan_log
from bench.soak_report import LedgerCheck, Outcome, build
from bench.soak_world import PING_TOKEN_SECRET, TIER, ManagerConfig, World, started

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
QUIET_SECONDS = 6.0  # > uvicorn's 5 s keep-alive: every idle connection is closed by then
DRAIN_TIMEOUT = 60.0  # seconds for the job consumers to empty once the load stops
READY_TIMEOUT = 30.0  # seconds for the manager's job streams to exist after /readyz
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


# --- phases ------------------------------------------------------------------------------


class Recorder:
    """Samples the manager every `every` seconds in the background, labelled by phase."""

    def __init__(self, probe: Probe, every: float, progress: Callable[[], str]) -> None:
        self._probe = probe
        self._every = every
        self._progress = progress  # appended to each progress line
        self.phase = "warm-up"
        self.samples: list[Sample] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="soak-recorder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def take(self) -> Sample:
        sample, _ = await self._probe.sample(self.phase)
        self.samples.append(sample)
        return sample

    async def _run(self) -> None:
        while True:
            s = await self.take()
            _say(
                f"t={s.t:4.0f}s {s.phase:<8} RSS {s.rss_bytes / MB:6.1f} MB, tasks {s.tasks}, "
                f"fds {s.fds}, errors {s.errors}; {self._progress()}"
            )
            await asyncio.sleep(self._every)


async def _consumers(bus: JetStreamBus, tier: str) -> dict[str, dict[str, int]]:
    durable = consumer_name(tier)
    return {stream: await bus.consumer_state(stream, durable) for stream in STREAMS.values()}


async def _streams_ready(bus: JetStreamBus, tier: str) -> None:
    """The manager creates its streams and consumers at start; publish only once they exist."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            await _consumers(bus, tier)
            return
        except Exception as exc:  # NotFound until the manager's start-up made them
            if time.monotonic() > deadline:
                raise RuntimeError(f"job consumers missing after {READY_TIMEOUT} s: {exc}") from exc
            await asyncio.sleep(0.2)


async def _quiesce(
    bus: JetStreamBus, pingers: Pingers, config: Config
) -> tuple[bool, dict[str, dict[str, int]]]:
    """Load paused or stopped: wait for answers in flight, empty consumers, then quiet."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    try:
        await asyncio.wait_for(pingers.idle.wait(), timeout=DRAIN_TIMEOUT)
    except TimeoutError:
        pass  # a ping that never answers counts as a client error; the reading goes on
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
        differ = {
            name: [version, deployed.get(name, "")]
            for name, version in world.desired.items()
            if deployed.get(name) != version
        }
        differ |= {n: ["", v] for n, v in deployed.items() if n not in world.desired}
        if not differ or time.monotonic() > deadline:
            return differ
        await asyncio.sleep(0.5)


async def _ledger(url: str, jobs: JobFlow) -> LedgerCheck:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        rows = await conn.fetch(
            "SELECT idempotency_key, status, attempts FROM job_ledger "
            "WHERE idempotency_key LIKE $1",
            jobs.key_prefix + "%",
        )
    finally:
        await conn.close()
    status = {r["idempotency_key"]: r["status"] for r in rows}
    published = jobs.stats.published
    lost = [key for key in published if status.get(key) != "completed"]
    confirmed = set(published)
    return LedgerCheck(
        published=len(published),
        completed=sum(1 for key in published if status.get(key) == "completed"),
        lost=lost[:LOST_KEYS_SHOWN],
        lost_count=len(lost),
        not_completed=dict(Counter(s for s in status.values() if s != "completed")),
        claimed_more_than_once=sum(1 for r in rows if r["attempts"] > 1),
        unconfirmed_in_ledger=sum(1 for key in status if key not in confirmed),
    )


def _traffic(world: World) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the local backend and the API server saw: counts by status, unexpected answers.
    The API server counts the Deployment requests (LIST, GET, PATCH, DELETE; not the
    controllers' UPDATE and WATCH), bench/cluster.py."""
    requests = world.backend.requests
    backend = {
        "requests": len(requests),
        "by_status": dict(Counter(str(r.status) for r in requests)),
        "rejected": len(world.backend.rejected),
        "errors": sum(1 for r in requests if r.status >= 400),
        "reports": sum(1 for r in requests if r.route == "health" and r.status == 202),
        "versions": len(world.backend.versions),
    }
    kube_requests = world.kube_requests()
    kube = {
        "requests": kube_requests.total,
        "by_status": kube_requests.by_status(),
        "by_kind": kube_requests.by_kind(),
        "not_counted": dict(kube_requests.other.most_common()),
        # 404: a create first reads the name; 409: an apply conflict is re-planned
        "errors": sum(
            count
            for key, count in kube_requests.counted.items()
            if key.code >= 400 and key.code not in (404, 409)
        ),
    }
    return backend, kube


@dataclass
class Load:
    """The generators and the recorder, behind one gate."""

    gate: Gate
    pingers: Pingers
    jobs: JobFlow
    bumper: VersionBumper
    recorder: Recorder

    def start(self) -> None:
        for part in (self.pingers, self.jobs, self.bumper, self.recorder):
            part.start()

    async def stop(self) -> None:
        """Stop the generators (what is in flight finishes); the recorder goes on."""
        self.gate.stop.set()
        await asyncio.gather(self.pingers.join(), self.jobs.join(), self.bumper.join())


def _load(config: Config, world: World, bus: JetStreamBus, probe: Probe) -> Load:
    gate = Gate()
    pingers = Pingers(
        world.manager_url, sorted(world.desired), world.desired,
        secret=PING_TOKEN_SECRET, interval=config.ping_interval, gate=gate,
    )  # fmt: skip
    jobs = JobFlow(bus, tier=config.tier, rate=config.job_rate, gate=gate)
    bumper = VersionBumper(
        world.desire, world.desired, every=config.bump_seconds, count=config.bump_count,
        gate=gate,
    )  # fmt: skip

    def progress() -> str:
        return f"pings {pingers.stats.sent} ({pingers.stats.failed} failed), " + (
            f"jobs {len(jobs.stats.published)}"
        )

    recorder = Recorder(probe, config.sample_seconds, progress)
    return Load(gate, pingers, jobs, bumper, recorder)


async def _baseline(
    config: Config, load: Load, bus: JetStreamBus, probe: Probe
) -> tuple[QuietReading, Scrape | None]:
    """After the warm-up: pause the load, take the quiet reading, resume."""
    _say("warm-up over: pausing the load for a quiet reading")
    load.recorder.phase = "quiet"
    load.gate.close()
    await _quiesce(bus, load.pingers, config)
    reading = await probe.quiet_reading()
    scrape = await probe.scrape()
    _say(f"after warm-up: tasks {reading.tasks_min}, RSS {reading.rss_bytes / MB:.1f} MB")
    load.pingers.stats.latencies.clear()  # latencies of the measured phase only
    load.recorder.phase = "measured"
    load.gate.open()
    return reading, scrape


async def _measure(config: Config, load: Load, until: float) -> tuple[Sample, Sample, float]:
    """The measured phase, under load: its first and last samples and its length."""
    started = time.monotonic()
    await asyncio.sleep(min(config.sample_seconds, max(0.0, until - started)))
    first = await load.recorder.take()
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    last = await load.recorder.take()
    return first, last, time.monotonic() - started


@dataclass(frozen=True)
class Ending:
    reading: QuietReading
    scrape: Scrape | None
    drained: bool
    consumers: dict[str, dict[str, int]]
    mismatched: dict[str, list[str]]


async def _end(config: Config, load: Load, world: World, bus: JetStreamBus, probe: Probe) -> Ending:
    """Stop the load, let the syncs converge and the consumers drain, take the quiet reading."""
    _say("load off: stopping the generators")
    load.recorder.phase = "drain"
    await load.stop()
    mismatched = await _converged(world, 3 * config.sync_interval + 15)
    drained, consumers = await _quiesce(bus, load.pingers, config)
    load.recorder.phase = "quiet"
    reading = await probe.quiet_reading()
    scrape = await probe.scrape()
    _say(f"at the end: tasks {reading.tasks_min}, RSS {reading.rss_bytes / MB:.1f} MB")
    return Ending(reading, scrape, drained, consumers, mismatched)


async def _soak(config: Config, world: World) -> Outcome:
    probe = Probe(world.manager.pid, world.manager_url, world.peers())
    bus = JetStreamBus(
        NatsServers.parse(world.nats.url), name="soak-publisher", timeout=PUBLISH_TIMEOUT
    )
    await bus.connect()
    try:
        await _streams_ready(bus, config.tier)
        load = _load(config, world, bus, probe)
        load_started = probe.started = time.monotonic()
        _say(
            f"load on: {config.workloads} workloads, {config.job_rate:g} jobs/s, "
            f"{config.seconds:.0f} s ({config.warmup_seconds:.0f} s warm-up)"
        )
        load.start()
        try:
            await asyncio.sleep(config.warmup_seconds)
            baseline, start_scrape = await _baseline(config, load, bus, probe)
            first, last, measured = await _measure(config, load, load_started + config.seconds)
            end = await _end(config, load, world, bus, probe)
        finally:
            load.gate.stop.set()
            await load.recorder.stop()
        ledger = await _ledger(world.pg.url, load.jobs)
        backend, kube = _traffic(world)
    finally:
        await bus.drain()
        await probe.aclose()
    return Outcome(
        config=asdict(config),
        samples=load.recorder.samples,
        baseline=baseline,
        final=end.reading,
        load_start_sample=first,
        load_end_sample=last,
        start_scrape=start_scrape,
        end_scrape=end.scrape,
        pings=load.pingers.stats,
        jobs=load.jobs.stats,
        ledger=ledger,
        drained=end.drained,
        consumers=end.consumers,
        converged=not end.mismatched,
        mismatched=end.mismatched,
        bumped=load.bumper.bumped,
        backend=backend,
        kube=kube,
        scrape_failures=dict(probe.scrape_failures),
        measured_seconds=measured,
    )


# --- main --------------------------------------------------------------------------------


def _sigterm_as_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGTERM takes Ctrl-C's path, so the servers are stopped either way."""
    signal.raise_signal(signal.SIGINT)


def _handle_interrupts() -> None:
    """Ctrl-C and SIGTERM both end in KeyboardInterrupt (inside asyncio.run: the main task
    cancelled first). SIGINT is handled even when inherited as ignored, as a shell does for
    a background job, or a plain `kill -INT` would leave the servers running to the end."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_sigint)


def _run(config: Config) -> Outcome:
    manager = ManagerConfig(
        sync_interval=config.sync_interval, report_interval=config.report_interval
    )
    with started(config.workloads, manager) as world:
        try:
            outcome = asyncio.run(_soak(config, world))
        except Exception:
            print(f"--- manager log (tail) ---\n{world.manager.log()}", file=sys.stderr)
            raise
        finally:
            _say("stopping the manager (SIGTERM)")
            code = world.manager.stop()
            keep = os.environ.get("SOAK_KEEP_LOG", "").strip()
            if keep:
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
    _handle_interrupts()
    machine = facts(REPO)
    print(
        f"{machine['date']}  {machine['cpu_model']}, {machine['cpu_count_logical']} cores, "
        f"{machine['memory_total_bytes'] / 2**30:.1f} GiB, Python {machine['python']}, "
        f"load {machine['load_average_1m']}, git {machine['git_revision']}",
        flush=True,
    )
    try:
        outcome = _run(config)
    except KeyboardInterrupt:
        print("soak: interrupted; every server it started has been stopped", file=sys.stderr)
        return 130
    report = build(outcome)
    for table in report["tables"]:
        print()
        print(render_table(table))
    for note in report["notes"]:
        print(f"* {note}")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"machine": machine} | report, indent=2, default=str) + "\n")
    print(f"\nresults: {output}")
    print(report["verdict"])
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
