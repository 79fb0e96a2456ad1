"""The jobs benchmark: noop jobs per second through the worker's whole path, against a floor.

N noop jobs (5,000; 500 with --quick) are pre-published to mm.write.A.noop and run by the
manager's worker inside its lifespan (validation, matching, ledger, event, ack), at the
default WORKER_CONCURRENCY and at 16. The floor, in the same run on the same nats-server:
`nats bench` (the NATS CLI, a Go client, pinned in tools/bench-tools/versions.env) storing
N messages on MM_WRITE and then fetching and acking them from wm-A, the stream and
consumer the manager itself creates; so the ratio is the Python worker's rate against a Go
client's. A second floor, a nats-py loop that stores one event before each ack, prices the
worker's guarantee (no load tool does that shape); the third, that loop with the worker's
own ledger writes (claim and completion through AsyncpgLedger), is the target's floor:
the whole path must reach half of it.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncpg
import nats
import nats.errors
import nats.js.errors

from app.adapters.bus import JetStreamBus
from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.adapters.registry import AsyncpgLedger, AsyncpgRegistry
from app.domain.jobs import STREAMS, Job, consumer_name, job_subject
from app.domain.ledger import job_fingerprint
from app.domain.nats_servers import NatsServers
from app.main import create_app
from app.services import migrating
from app.services.features.worker import WORKER
from app.services.runtime import Runtime
from app.services.streams import consumer_specs, init_streams, new_job, publish_job, stream_specs
from app.settings import Settings
from bench import Options, proc, sampling, tools
from bench.report import CheckFailed, check, say, table
from standins.databases import fresh_database

NAME = "jobs"
DESCRIPTION = (
    "noop jobs/s through the worker's whole path (validation, matching, ledger, event, ack) "
    "against a nats-py fetch-ack loop with the same ledger writes and events (target: "
    ">= 0.5x), and against `nats bench js fetch` (a Go client) on the same server"
)


def _check(condition: bool, message: str) -> None:
    check(condition, message)


def _say(message: str) -> None:
    say(NAME, message)


JOBS = 5000
QUICK_JOBS = 500
DEFAULT_CONCURRENCY: int = Settings.model_fields["worker_concurrency"].default
WIDE_CONCURRENCY = 16
FETCH_BATCH: int = Settings.model_fields["job_fetch_batch"].default
FETCH_WAIT = 1.0  # seconds; the worker's WorkerConfig.fetch_wait
TARGET_RATIO = 0.5  # of the nats-py loop with the worker's ledger writes
LEASE_SECONDS = 60.0  # the ledger floor's claims: 2 x the default ack wait, as the worker's
NODE, TIER, KIND = "bench-node", "A", "write"
JOB_STREAM, DURABLE = STREAMS[KIND], consumer_name(TIER)
FLOOR_SUBJECT = job_subject(KIND, TIER, "noop")
# beyond STALL, the seconds per message a `nats bench` run may take before it counts as stuck
TOOL_SECONDS_PER_MESSAGE = 0.01
# the floor that keeps the worker's guarantee (a nats-py loop): an event stored before each
# ack, on copies of the MM_WRITE stream and wm-A consumer settings
BARE_STREAM, BARE_FILTER, BARE_DURABLE = "BENCH_BARE", "bench.bare.>", "bench-bare"
BARE_SUBJECT = "bench.bare.noop"
BARE_EVENTS, BARE_EVENT_SUBJECT = "BENCH_BARE_EVENTS", "bench.bare-events.completed"
POLL = 0.01  # seconds between consumer-state polls while draining
CPU_BOUND = 0.8  # CPU seconds per wall second of this process above which it is CPU-bound
STALL = 30.0  # seconds without progress before a phase is declared stuck
# Settings passed explicitly below; any other field set in the environment changes the run.
EXPLICIT = frozenset(
    {"data_dir", "embedded_services", "database_url", "nats_url", "node_id", "node_tier",
     "report_enabled", "sync_enabled", "worker_concurrency", "job_fetch_batch",
     "heartbeat_interval_seconds"}
)  # fmt: skip


# --- measuring ---------------------------------------------------------------------------


Snapshot = Mapping[str, float]  # what -> CPU seconds


class CpuMeter:
    """CPU seconds (user + system, bench.proc) of this process, nats-server and PostgreSQL's
    processes (the backends that exited included)."""

    def __init__(self, nats_pid: int, pg_pid: int) -> None:
        self._pids = {"python": (os.getpid(), False), "nats": (nats_pid, False),
                      "postgres": (pg_pid, True)}  # fmt: skip

    def snapshot(self) -> Snapshot:
        return {name: proc.cpu_seconds(pid, tree) for name, (pid, tree) in self._pids.items()}

    @staticmethod
    def spent(before: Snapshot, after: Snapshot) -> dict[str, float]:
        return {name: round(after[name] - before[name], 3) for name in after}


@dataclass(frozen=True)
class ConsumerView:
    pending: int
    ack_pending: int
    redelivered: int
    delivered: int

    @property
    def drained(self) -> bool:
        return self.pending == 0 and self.ack_pending == 0


@dataclass
class World:
    nats_url: str
    pg_url: str
    workdir: Path
    cpu: CpuMeter
    observer: Any  # a nats-py JetStream context, for consumer info only

    async def consumer(self, stream: str, durable: str) -> ConsumerView:
        info = await self.observer.consumer_info(stream, durable)
        return ConsumerView(
            pending=int(info.num_pending or 0),
            ack_pending=int(info.num_ack_pending or 0),
            redelivered=int(info.num_redelivered or 0),
            delivered=int(info.delivered.consumer_seq or 0),
        )

    async def drained(
        self, stream: str, durable: str, n: int, in_flight: Callable[[], int] | None = None
    ) -> tuple[ConsumerView, list[int]]:
        """Poll the consumer until nothing is pending or unacknowledged; fail on a stall.

        Returns the last view and, when `in_flight` is given, its value at every poll.
        """
        samples: list[int] = []
        last, progress_at = -1, time.monotonic()
        while True:
            view = await self.consumer(stream, durable)
            if view.drained:
                return view, samples
            if in_flight is not None:
                samples.append(in_flight())
            left = view.pending + view.ack_pending
            if left != last:
                last, progress_at = left, time.monotonic()
            _check(
                time.monotonic() - progress_at < STALL,
                f"{stream}/{durable}: no progress for {STALL:.0f} s with {view.pending} pending "
                f"and {view.ack_pending} unacknowledged of {n}",
            )
            await asyncio.sleep(POLL)


def _jobs(n: int, tag: str) -> list[Job]:
    return [new_job("noop", idempotency_key=f"bench-{tag}-{i:05d}") for i in range(n)]


def _body(job: Job) -> dict[str, Any]:
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)


async def _timed(label: str, n: int, publish: Callable[[int], Awaitable[object]]) -> float:
    """Publish n messages one after the other, each awaiting its JetStream ack: the wall."""
    _say(f"{label}: publishing {n} messages")
    started = time.perf_counter()
    for i in range(n):
        await publish(i)
    return time.perf_counter() - started


def _percentile(values: Sequence[float], p: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def _settings(world: World, database_url: str, concurrency: int, tag: str) -> Settings:
    return Settings(
        _env_file=None,
        data_dir=world.workdir / f"data-{tag}",
        embedded_services=False,
        database_url=database_url,
        nats_url=world.nats_url,
        node_id=NODE,
        node_tier=TIER,
        report_enabled=False,
        sync_enabled=False,
        worker_concurrency=concurrency,
        job_fetch_batch=FETCH_BATCH,
        heartbeat_interval_seconds=30,
    )


# --- the floor: nats bench, a Go client --------------------------------------------------


async def _nats_bench(
    world: World, label: str, args: Sequence[str], n: int
) -> tuple[dict[str, str], float]:
    """`nats bench js ARGS` for n messages against the benchmark's server, to the end: its
    one client's CSV row (the tool's machine-readable report) and its CPU seconds."""
    report = world.workdir / f"{label}.csv"
    argv = [
        tools.find("nats"), "--no-context", "--server", world.nats_url,
        "--connection-name", f"bench-{label}", "bench", "js", *args,
        "--msgs", str(n), "--no-progress", "--csv", str(report),
    ]  # fmt: skip
    timeout = STALL + n * TOOL_SECONDS_PER_MESSAGE
    try:
        ran = await asyncio.to_thread(tools.run, argv, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"nats bench {label} did not end within {timeout:.0f} s") from None
    except RuntimeError as exc:  # a non-zero exit, with its stderr
        raise CheckFailed(f"nats bench {label}: {exc}") from None
    rows = list(csv.DictReader(report.read_text().splitlines()))
    _check(len(rows) == 1, f"nats bench {label}: {len(rows)} client rows in its CSV, not 1")
    return rows[0], ran.cpu_seconds


async def _floor(world: World, settings: Settings, n: int, batch: int, tag: str) -> dict[str, Any]:
    """nats bench on MM_WRITE and wm-A as init_streams makes them: `js pub sync` stores n
    messages of a noop job's body, each with its own Nats-Msg-Id, awaiting each PubAck;
    then one `js fetch` client fetches `batch` at a time and acks each, until n acked."""
    body = json_bytes(_body(_jobs(1, f"floor-{tag}")[0]))
    payload = world.workdir / f"floor-{tag}.json"
    payload.write_bytes(body)
    bus = JetStreamBus(NatsServers.parse(world.nats_url), name="bench-floor-setup", timeout=10.0)
    await bus.connect()
    try:
        await init_streams(bus, settings)  # what the worker's start-up does, idempotently
    finally:
        await bus.drain()
    start = await world.consumer(JOB_STREAM, DURABLE)
    _check(start.drained, f"{JOB_STREAM}/{DURABLE} is not empty before the floor: {start}")
    _say(f"floor, batch {batch}: nats bench js pub sync, {n} messages")
    published, _ = await _nats_bench(
        world,
        f"floor-{tag}-pub",
        ["pub", "sync", FLOOR_SUBJECT, "--stream", JOB_STREAM, "--payload", str(payload),
         "--size", f"{len(body)}B", "--dedup"],
        n,
    )  # fmt: skip
    view = await world.consumer(JOB_STREAM, DURABLE)
    _check(view.pending == n, f"{view.pending} messages pending on {JOB_STREAM}/{DURABLE}, not {n}")
    _say(f"floor, batch {batch}: nats bench js fetch and ack")
    before = world.cpu.snapshot()
    started = time.perf_counter()
    fetched, tool_cpu = await _nats_bench(
        world,
        f"floor-{tag}-fetch",
        ["fetch", "--stream", JOB_STREAM, "--consumer", DURABLE, "--batch", str(batch)],
        n,
    )
    view, _ = await world.drained(JOB_STREAM, DURABLE, n)
    span = time.perf_counter() - started
    cpu = CpuMeter.spent(before, world.cpu.snapshot())
    _check(view.redelivered == 0, f"{view.redelivered} floor messages were redelivered")
    publish_wall, wall = float(published["DurationSecs"]), float(fetched["DurationSecs"])
    _check(wall > 0 and publish_wall > 0, f"nats bench reported no duration: {fetched}")
    return {
        "messages": n,
        "client": "nats bench (Go): js pub sync, js fetch",
        "fetch_batch": batch,
        "body_bytes": len(body),
        "publish_seconds": round(publish_wall, 4),
        "publish_rate": round(n / publish_wall, 1),
        # nats bench's own time: first message received to last one handled
        "wall_seconds": round(wall, 4),
        "rate": round(n / wall, 1),
        # the tool's process from start to exit, then until the consumer showed every ack
        "process_seconds": round(span, 4),
        # the tool's own CPU (user + system of its process) beside the meter's
        "cpu_seconds": {"nats_cli": round(tool_cpu, 3), **cpu},
    }


# --- the floor with the guarantee: a nats-py loop ----------------------------------------


async def _events_floor(
    world: World, settings: Settings, n: int, batch: int, tag: str, *, ledger: bool = False
) -> dict[str, Any]:
    """One nats-py loop: fetch(batch) from a durable pull consumer; for each fetched batch,
    one small event per message published to a stream of its own (all at once, awaiting
    every PubAck), and only then each message acked; until n acked. The shape the
    worker's guarantee needs and nothing else. With `ledger`, each message is first
    claimed and completed in the worker's own ledger (`AsyncpgLedger`, the same pool size
    and group commit, in a fresh migrated database): the worker's writes, with no
    validation, matching, handler or bookkeeping around them."""
    if ledger:
        async with fresh_database(world.pg_url) as database_url:
            registry = AsyncpgRegistry(
                database_url, timeout=10.0, max_connections=settings.database_pool_size
            )
            await registry.open()
            try:
                await migrating.migrate(registry, migrating.migrations_dir(None))
                writes = AsyncpgLedger(registry, node_id=NODE, claimant="bench-floor")
                return await _loop_floor(world, settings, n, batch, tag, writes)
            finally:
                await registry.close()
    return await _loop_floor(world, settings, n, batch, tag, None)


async def _loop_floor(
    world: World, settings: Settings, n: int, batch: int, tag: str, writes: AsyncpgLedger | None
) -> dict[str, Any]:
    (stream,) = [s for s in stream_specs(settings) if s.name == JOB_STREAM]
    (consumer,) = [c for c in consumer_specs(settings, (TIER,)) if c.stream == JOB_STREAM]
    bodies = [_body(job) for job in _jobs(n, f"bare-{tag}")]
    bus = JetStreamBus(NatsServers.parse(world.nats_url), name="bench-bare-publisher", timeout=10.0)
    await bus.connect()
    nc = await nats.connect(world.nats_url, name="bench-bare-consumer")
    js = nc.jetstream(timeout=10.0)
    try:
        await _recreate(js, BARE_STREAM)
        # the same stream and consumer settings as MM_WRITE and wm-A, by construction
        await bus.ensure_stream(replace(stream, name=BARE_STREAM, subjects=(BARE_FILTER,)))
        await bus.ensure_consumer(
            replace(consumer, stream=BARE_STREAM, durable=BARE_DURABLE, filter_subject=BARE_FILTER)
        )
        await _recreate(js, BARE_EVENTS)
        events_stream = replace(stream, name=BARE_EVENTS, subjects=(BARE_EVENT_SUBJECT,))
        await bus.ensure_stream(replace(events_stream, retention="limits"))
        publish_wall = await _timed(
            f"floor with events, batch {batch}",
            n,
            lambda i: bus.publish(BARE_SUBJECT, bodies[i], msg_id=bodies[i]["idempotency_key"]),
        )
        view = await world.consumer(BARE_STREAM, BARE_DURABLE)
        _check(
            view.pending == n, f"{view.pending} messages pending on the floor's consumer, not {n}"
        )
        _say(f"floor with events, batch {batch}: fetch, store events, ack")
        fetches = empty = acked = 0
        before = world.cpu.snapshot()
        started = time.perf_counter()
        sub = await js.pull_subscribe_bind(BARE_DURABLE, stream=BARE_STREAM)
        while acked < n:
            fetches += 1
            try:
                msgs = await sub.fetch(batch, timeout=FETCH_WAIT)
            except (nats.errors.TimeoutError, TimeoutError):
                empty += 1
                _check(empty * FETCH_WAIT < STALL, f"the floor stalled at {acked} of {n} acked")
                continue
            await asyncio.gather(*(_event_for(js, msg, writes) for msg in msgs))
            for msg in msgs:
                await msg.ack()
                acked += 1
        await nc.flush()
        view, _ = await world.drained(BARE_STREAM, BARE_DURABLE, n)
        wall = time.perf_counter() - started
        cpu = CpuMeter.spent(before, world.cpu.snapshot())
        await sub.unsubscribe()
        _check(
            acked == n and view.redelivered == 0, f"{acked} acked, {view.redelivered} redelivered"
        )
        return {
            "messages": n,
            "client": "nats-py",
            "events": True,
            "ledger": writes is not None,
            "fetch_batch": batch,
            "body_bytes": len(json_bytes(bodies[0])),
            "publish_seconds": round(publish_wall, 4),
            "publish_rate": round(n / publish_wall, 1),
            "wall_seconds": round(wall, 4),
            "rate": round(n / wall, 1),
            "fetches": fetches,
            "empty_fetches": empty,
            "cpu_seconds": cpu,
        }
    finally:
        for name in (BARE_STREAM, BARE_EVENTS):
            try:
                await js.delete_stream(name)
            except (nats.errors.Error, TimeoutError):
                pass
        await nc.close()
        await bus.drain()


async def _recreate(js: Any, name: str) -> None:
    try:
        await js.delete_stream(name)
    except nats.js.errors.NotFoundError:
        pass


async def _event_for(js: Any, msg: Any, writes: AsyncpgLedger | None = None) -> None:
    """An event of about the size of job.completed, with a message id, awaiting its ack;
    with `writes`, after the job's claim and completion in the ledger."""
    seq = msg.metadata.sequence.stream
    if writes is not None:
        job = json.loads(msg.data)
        key = job["idempotency_key"]
        await writes.claim(
            key=key, job_id=job["job_id"], job_type=job["type"],
            fingerprint=job_fingerprint(job["type"], job.get("payload", {})),
            lease_seconds=LEASE_SECONDS,
        )  # fmt: skip
        await writes.complete(key=key, result={"noop": True})
    body = b'{"job_id":"%d","node_id":"bench-node","code":"completed","result":{"noop":true}}'
    await js.publish(
        BARE_EVENT_SUBJECT, body % seq, headers={"Nats-Msg-Id": f"bare-{seq}:completed"}
    )


def json_bytes(body: Mapping[str, Any]) -> bytes:
    """The bytes JetStreamBus.publish sends for `body`."""
    return json.dumps(body, separators=(",", ":")).encode()


# --- the whole path: the manager's worker in its lifespan --------------------------------


async def _worker_ready(runtime: Runtime) -> None:
    component = runtime.components["worker"]
    deadline = time.monotonic() + 60.0
    while component.state != "ok":
        _check(component.enabled, f"the worker is off: {component.reason}")
        _check(time.monotonic() < deadline, f"the worker did not start: {component.as_dict()}")
        await asyncio.sleep(0.001)


def _outcomes(runtime: Runtime) -> dict[str, int]:
    counts: dict[str, int] = {}
    for metric in runtime.metrics.jobs.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                counts[sample.labels["outcome"]] = int(sample.value)
    return counts


def _mean_duration(runtime: Runtime) -> float | None:
    """Mean delivery-to-answer time of noop jobs from the worker's histogram, in seconds."""
    values: dict[str, float] = {}
    for metric in runtime.metrics.job_duration.collect():
        for sample in metric.samples:
            if sample.labels.get("type") == "noop":
                values[sample.name.rsplit("_", 1)[-1]] = sample.value
    count = values.get("count", 0.0)
    return values.get("sum", 0.0) / count if count else None


async def _ledger(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return await conn.fetch(
            """SELECT idempotency_key, status, attempts, node_id,
                      EXTRACT(EPOCH FROM completed_at - created_at)::float8 AS seconds,
                      EXTRACT(EPOCH FROM created_at)::float8 AS claimed,
                      EXTRACT(EPOCH FROM completed_at)::float8 AS completed
               FROM job_ledger"""
        )
    finally:
        await conn.close()


async def _whole(
    world: World, n: int, concurrency: int, tag: str, during: Callable[[], object] | None = None
) -> dict[str, Any]:
    """Pre-publish n noop jobs, start the manager, time from worker ready to all acked."""
    jobs = _jobs(n, tag)
    async with fresh_database(world.pg_url) as database_url:
        settings = _settings(world, database_url, concurrency, tag)
        bus = JetStreamBus(NatsServers.parse(world.nats_url), name="bench-publisher", timeout=10.0)
        await bus.connect()
        try:
            await init_streams(bus, settings)  # what the worker's start-up does, idempotently
            start = await world.consumer(JOB_STREAM, DURABLE)
            _check(start.drained, f"{JOB_STREAM}/{DURABLE} is not empty before the run: {start}")
            publish_wall = await _timed(
                f"whole path, concurrency {concurrency}",
                n,
                lambda i: publish_job(bus, jobs[i], kind=KIND, tier=TIER),
            )
        finally:
            await bus.drain()
        view = await world.consumer(JOB_STREAM, DURABLE)
        _check(view.pending == n, f"{view.pending} jobs pending on {JOB_STREAM}/{DURABLE}, not {n}")
        app = create_app(settings)
        runtime: Runtime = app.state.runtime
        _say(f"whole path, concurrency {concurrency}: starting the manager, running {n} jobs")
        async with app.router.lifespan_context(app):
            await _worker_ready(runtime)
            before = world.cpu.snapshot()
            started = time.perf_counter()
            if during is not None:
                during()
            working = runtime.get(WORKER)
            assert working is not None
            worker = working.worker
            view, in_flight = await world.drained(JOB_STREAM, DURABLE, n, lambda: worker.in_flight)
            wall = time.perf_counter() - started
            cpu = CpuMeter.spent(before, world.cpu.snapshot())
        rows = await _ledger(database_url)
    outcomes = _outcomes(runtime)
    keys = {job.idempotency_key for job in jobs}
    completed = [r for r in rows if r["status"] == "completed"]
    _check(
        len(rows) == n and len(completed) == n and {r["idempotency_key"] for r in rows} == keys,
        f"the ledger holds {len(rows)} rows, {len(completed)} completed; expected exactly the "
        f"{n} published keys, completed",
    )
    attempts = sorted({int(r["attempts"]) for r in rows})
    _check(attempts == [1], f"ledger attempts {attempts}, expected all 1")
    _check({r["node_id"] for r in rows} == {NODE}, "a ledger row names another node")
    _check(outcomes == {"completed": n}, f"worker outcomes {outcomes}, expected {n} completed")
    _check(view.redelivered == 0, f"{view.redelivered} jobs were redelivered")
    latencies = sorted(float(r["seconds"]) for r in rows)
    span = max(float(r["completed"]) for r in rows) - min(float(r["claimed"]) for r in rows)
    mean = _mean_duration(runtime)
    return {
        "jobs": n,
        "concurrency": concurrency,
        "fetch_batch": FETCH_BATCH,
        "publish_seconds": round(publish_wall, 4),
        "publish_rate": round(n / publish_wall, 1),
        "wall_seconds": round(wall, 4),
        "rate": round(n / wall, 1),
        "ledger_span_seconds": round(span, 4),
        "ledger_rate": round(n / span, 1) if span > 0 else None,
        "claim_to_complete_ms": {
            "p50": round(1000 * _percentile(latencies, 50), 2),
            "p99": round(1000 * _percentile(latencies, 99), 2),
            "max": round(1000 * latencies[-1], 2),
        },
        "delivery_to_answer_mean_ms": None if mean is None else round(1000 * mean, 2),
        # jobs in flight at each 10 ms poll: how much of WORKER_CONCURRENCY was in use
        "in_flight_mean": round(statistics.fmean(in_flight), 2) if in_flight else None,
        "in_flight_max": max(in_flight, default=None),
        "outcomes": outcomes,
        "cpu_seconds": cpu,
    }


# --- runs --------------------------------------------------------------------------------


async def _measure(world: World, n: int, concurrency: int) -> dict[str, Any]:
    batch = min(concurrency, FETCH_BATCH)  # the worker never fetches more than free slots
    tag = f"c{concurrency}"
    result: dict[str, Any] = {
        "concurrency": concurrency, "bare": None, "bare_events": None, "bare_ledger": None,
        "whole": None,
    }  # fmt: skip
    result["failure"] = None
    current = "floor"
    try:
        # only the stream and consumer settings are used: the database URL is a placeholder
        settings = _settings(world, world.pg_url, concurrency, tag)
        result["bare"] = await _floor(world, settings, n, batch, tag)
        current = "floor with events"
        result["bare_events"] = await _events_floor(world, settings, n, batch, f"{tag}-ev")
        current = "floor with the ledger's writes and events"
        result["bare_ledger"] = await _events_floor(
            world, settings, n, batch, f"{tag}-lg", ledger=True
        )
        current = "whole path"
        result["whole"] = await _whole(world, n, concurrency, tag)
    except CheckFailed as exc:
        result["failure"] = {"phase": current, "reason": str(exc)}
        _say(f"concurrency {concurrency}: FAILED in {current}: {exc}")
    if result["bare"] and result["whole"]:
        result["ratio_to_go"] = round(result["whole"]["rate"] / result["bare"]["rate"], 3)
    if result["bare_ledger"] and result["whole"]:
        # the target: the whole path against the same writes with nothing around them
        result["ratio"] = round(result["whole"]["rate"] / result["bare_ledger"]["rate"], 3)
        result["target_met"] = result["ratio"] >= TARGET_RATIO
    if result["bare_events"] and result["bare"]:
        # what storing one event before each ack costs on its own, with no other work
        result["events_floor_ratio"] = round(
            result["bare_events"]["rate"] / result["bare"]["rate"], 3
        )
    if result["bare_events"] and result["whole"]:
        result["ratio_to_events_floor"] = round(
            result["whole"]["rate"] / result["bare_events"]["rate"], 3
        )
    return result


async def _profile(world: World, n: int, expected_wall: float) -> dict[str, Any]:
    """An extra, unmeasured whole-path run at concurrency 16 with py-spy sampling us."""
    seconds = max(1.0, 0.9 * expected_wall)
    output = world.workdir / "jobs.pyspy.txt"
    holder: dict[str, Any] = {}

    def start() -> None:
        try:
            holder["sampler"] = sampling.start(os.getpid(), seconds, output)
        except FileNotFoundError as exc:
            holder["error"] = str(exc)

    _say(f"profiling an extra run at concurrency {WIDE_CONCURRENCY} with py-spy")
    try:
        await _whole(world, n, WIDE_CONCURRENCY, "profile", during=start)
    except CheckFailed as exc:
        holder.setdefault("error", f"the profiled run failed: {exc}")
    sampler = holder.get("sampler")
    if sampler is None:
        return {"error": holder.get("error", "py-spy did not start")}
    deadline = time.monotonic() + seconds + 30.0
    while sampler.poll() is None:  # no thread of ours waits on py-spy: it would be sampled
        if time.monotonic() > deadline:
            sampler.kill()
            break
        await asyncio.sleep(0.1)
    _, stderr = sampler.communicate()
    if sampler.returncode != 0 or not output.exists():
        return {"error": f"py-spy exited with {sampler.returncode}: {stderr.decode()[-500:]}"}
    return {"seconds": round(seconds, 1)} | sampling.summarize(output.read_text())


async def _measure_all(world: World, n: int, profile: bool) -> dict[str, Any]:
    nc = await nats.connect(world.nats_url, name="bench-observer")
    world.observer = nc.jetstream(timeout=10.0)
    try:
        runs: dict[str, Any] = {}
        for concurrency in dict.fromkeys((DEFAULT_CONCURRENCY, WIDE_CONCURRENCY)):
            runs[str(concurrency)] = await _measure(world, n, concurrency)
        result: dict[str, Any] = {"runs": runs}
        wide = runs[str(WIDE_CONCURRENCY)].get("whole")
        if profile and wide is not None:
            result["profile"] = await _profile(world, n, wide["wall_seconds"])
        return result
    finally:
        await nc.close()


def run(options: Options) -> dict[str, Any]:
    n = QUICK_JOBS if options.quick else JOBS
    nats_cli = tools.version("nats", "--version")  # ToolMissing (names the script) if absent
    overridden = sorted(
        k for k in os.environ if k.lower() in Settings.model_fields and k.lower() not in EXPLICIT
    )
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as tmp:
        workdir = Path(tmp)
        pg = EmbeddedPostgres(workdir / "postgres")
        server = EmbeddedNats(workdir / "nats")
        try:
            _say("starting PostgreSQL and nats-server")
            pg.start()
            server.start()
            assert pg.pid is not None and server.pid is not None
            world = World(server.url, pg.url, workdir, CpuMeter(server.pid, pg.pid), None)
            measured = asyncio.run(_measure_all(world, n, options.profile))
        finally:
            server.stop()
            pg.stop()
    runs = measured["runs"]
    setup = {
        "jobs": n,
        "concurrencies": [int(c) for c in runs],
        "default_concurrency": DEFAULT_CONCURRENCY,
        "job_fetch_batch": FETCH_BATCH,
        "nats_cli": nats_cli,
        "cpu_count": os.cpu_count(),
        "load_average_1m_before": round(os.getloadavg()[0], 2),
        "settings_from_environment": overridden,
    }
    result: dict[str, Any] = {"setup": setup, **measured}
    result["ok"] = all(r["failure"] is None for r in runs.values())
    result["targets"] = {
        "whole_path_vs_ledger_loop": {
            "target": f">= {TARGET_RATIO}x",
            "measured": {c: r.get("ratio") for c, r in runs.items()},
            "met": all(r.get("target_met") for r in runs.values()) if result["ok"] else None,
        }
    }
    result["tables"] = _tables(runs, n, measured.get("profile"))
    result["notes"] = _notes(setup, runs, measured.get("profile"))
    return result


# --- report ------------------------------------------------------------------------------


def _cpu(phase: Mapping[str, Any], n: int) -> list[str]:
    """CPU % of the client (the nats CLI for the floor, else this process), nats-server and
    PostgreSQL over the span the meter covered; the client's CPU ms per message."""
    cpu = phase["cpu_seconds"]
    span = phase.get("process_seconds", phase["wall_seconds"])
    client = cpu.get("nats_cli", cpu["python"])
    shares = " / ".join(f"{100 * c / span:.0f}" for c in (client, cpu["nats"], cpu["postgres"]))
    return [shares, f"{1000 * client / n:.3f}"]


def _tables(
    runs: Mapping[str, Any], n: int, profile: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    rows: list[list[Any]] = []
    for concurrency, r in runs.items():
        default = " (default)" if int(concurrency) == DEFAULT_CONCURRENCY else ""
        bare, events, whole = r["bare"], r["bare_events"], r["whole"]
        floor = r["bare_ledger"]
        if bare is not None:
            rows.append([f"floor: nats bench js fetch {bare['fetch_batch']}, ack each (Go)",
                         f"{bare['publish_rate']:,.0f}", f"{bare['wall_seconds']:.3f}",
                         f"{bare['rate']:,.0f}", "1.00", "-", "-", *_cpu(bare, n)])  # fmt: skip
        if events is not None and bare is not None:
            rows.append([f"nats-py loop + an event stored before each ack, fetch "
                         f"{events['fetch_batch']}", f"{events['publish_rate']:,.0f}",
                         f"{events['wall_seconds']:.3f}", f"{events['rate']:,.0f}",
                         f"{r['events_floor_ratio']:.2f}", "-", "-", *_cpu(events, n)])  # fmt: skip
        if floor is not None and bare is not None:
            rows.append([f"nats-py loop + the worker's ledger claim and completion + the "
                         f"event, fetch {floor['fetch_batch']}", f"{floor['publish_rate']:,.0f}",
                         f"{floor['wall_seconds']:.3f}", f"{floor['rate']:,.0f}",
                         f"{floor['rate'] / bare['rate']:.2f}", "-", "-",
                         *_cpu(floor, n)])  # fmt: skip
        if whole is not None:
            lat = whole["claim_to_complete_ms"]
            ratio = (
                f"{r['ratio']:.2f}x the ledger loop ({'met' if r['target_met'] else 'NOT met'})"
                if "ratio" in r
                else "-"
            )
            ratio += f"; {r['ratio_to_go']:.2f}x Go" if "ratio_to_go" in r else ""
            ratio += f"; {r['ratio_to_events_floor']:.2f}x the events loop" if events else ""
            rows.append([f"whole path: WORKER_CONCURRENCY={concurrency}{default}",
                         f"{whole['publish_rate']:,.0f}", f"{whole['wall_seconds']:.3f}",
                         f"{whole['rate']:,.0f}", ratio, f"{whole['in_flight_mean']} of "
                         f"{concurrency}", f"{lat['p50']:.1f} / {lat['p99']:.1f}",
                         *_cpu(whole, n)])  # fmt: skip
        if r["failure"] is not None:
            rows.append([f"FAILED at {concurrency} in {r['failure']['phase']}", *["-"] * 7,
                         r["failure"]["reason"]])  # fmt: skip
    tables = [
        table(f"jobs: {n:,} noop jobs, whole path against the nats-py loop with the same "
              "ledger writes (and the nats bench fetch-ack floor)",
              ["path", "publish /s", "wall s", "per s",
               f"x Go floor; whole path: x ledger loop (>= {TARGET_RATIO})",
               "in flight (mean)", "claim->done p50 / p99 ms", "CPU % client / nats / pg",
               "client CPU ms per job"], rows)
    ]  # fmt: skip
    if profile is not None and "error" not in profile:
        title = f"jobs: py-spy, whole path at {WIDE_CONCURRENCY} ({profile['samples']} samples"
        tables += [
            table(f"{title}; inclusive, top 15)", "function (file)|% of samples",
                  [[e["name"], f"{e['percent']:.1f}"] for e in profile["inclusive"][:15]]),
            table(f"{title}): innermost frame by package", "package|% of samples",
                  [[e["name"], f"{e['percent']:.1f}"] for e in profile["by_package"]]),
        ]  # fmt: skip
    return tables


def _notes(
    setup: Mapping[str, Any], runs: Mapping[str, Any], profile: Mapping[str, Any] | None
) -> list[str]:
    notes = [
        f"whole path: noop jobs published to mm.write.{TIER}.noop before the manager starts; "
        "timed from the worker turning ok to wm-A having nothing pending or unacknowledged "
        "(polled every 10 ms), in the manager's real lifespan with a fresh database per run. "
        f"floor: `nats bench` ({setup['nats_cli']}, a Go client) on {JOB_STREAM} and {DURABLE} "
        "as init_streams makes them: `js pub sync --dedup` stores the jobs' bodies, then one "
        "`js fetch --batch B` client acks each, B = min(concurrency, JOB_FETCH_BATCH); its "
        "rate is n / its own duration. The second floor is a nats-py loop storing one event "
        f"before each ack on {BARE_STREAM}/{BARE_DURABLE}, copies of those settings; the "
        "third, the target's, is that loop with each job first claimed and completed in the "
        "worker's own ledger adapter (AsyncpgLedger, fresh migrated database, the same pool).",
        "checked before reporting: the ledger holds exactly the published keys, all completed, "
        "attempts all 1, this node; the worker counted only `completed`; no redeliveries.",
        f"CPU: {setup['cpu_count']} cores shared, nothing pinned; CPU % = CPU seconds during "
        "the timed phase / wall (100 = one core; the floor's client is the nats CLI over its "
        f"whole life); at >= {100 * CPU_BOUND:.0f} % this process is CPU-bound. Load average "
        f"before the run: {setup['load_average_1m_before']}.",
    ]
    if profile is not None and "error" in profile:
        notes.append(f"profile not taken: {profile['error']}")
    notes += [
        f"FAILED at WORKER_CONCURRENCY={c} in {r['failure']['phase']}: {r['failure']['reason']}"
        for c, r in runs.items() if r["failure"] is not None
    ]  # fmt: skip
    if setup["settings_from_environment"]:
        notes.append("settings also read from this environment (they change what is "
                     "measured): " + ", ".join(setup["settings_from_environment"]))  # fmt: skip
    return notes
