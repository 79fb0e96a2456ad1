"""The jobs benchmark: noop jobs per second through the worker's whole path, against floors.

N noop jobs (5,000; 500 with --quick) are pre-published and run by the manager's worker in
its real lifespan, at the default WORKER_CONCURRENCY and at 16, timed until wm-A has nothing
pending or unacknowledged. Floors on the same nats-server: `nats bench js fetch` (Go), a
nats-py fetch-ack loop storing one event per job, and that loop with the worker's own ledger
claim and completion (the target: the whole path reaches half of it). The ledger, outcomes
and redeliveries are checked. CPU % = CPU seconds / wall (100 = one core).
"""

from __future__ import annotations

import asyncio
import csv
import functools
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncpg
import nats
import nats.errors
import nats.js.errors

from app.adapters.bus import JetStreamBus
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
from bench.report import CheckFailed, Json, check, env_note, latency_ms, say, table
from bench.servers import data_servers, overridden
from standins.databases import fresh_database

NAME = "jobs"
DESCRIPTION = (
    "noop jobs/s through the worker's whole path (validation, matching, ledger, event, ack) "
    "against a nats-py fetch-ack loop with the same ledger writes and events (target: "
    ">= 0.5x), and against `nats bench js fetch` (a Go client) on the same server"
)
_say = functools.partial(say, NAME)

JOBS, QUICK_JOBS = 5000, 500
DEFAULT_CONCURRENCY: int = Settings.model_fields["worker_concurrency"].default
WIDE_CONCURRENCY = 16
FETCH_BATCH: int = Settings.model_fields["job_fetch_batch"].default
FETCH_WAIT = 1.0  # seconds; the worker's WorkerConfig.fetch_wait
TARGET_RATIO = 0.5  # of the nats-py loop with the worker's ledger writes
LEASE_SECONDS = 60.0  # the ledger floor's claims: 2 x the default ack wait, as the worker's
NODE, TIER, KIND = "bench-node", "A", "write"
JOB_STREAM, DURABLE = STREAMS[KIND], consumer_name(TIER)
TOOL_SECONDS_PER_MESSAGE = 0.01  # beyond STALL, before a `nats bench` run counts as stuck
# the nats-py floors' copies of the MM_WRITE stream and wm-A consumer, and their events
BARE_STREAM, BARE_FILTER, BARE_DURABLE = "BENCH_BARE", "bench.bare.>", "bench-bare"
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


@dataclass
class World:
    nats_url: str
    pg_url: str
    workdir: Path
    meter: proc.Meter  # this process, nats-server and PostgreSQL's processes
    observer: Any = None  # a nats-py JetStream context, for consumer info only

    async def drained(
        self, stream: str, durable: str, n: int, in_flight: Callable[[], int] | None = None
    ) -> tuple[Any, list[int]]:
        """Poll the consumer until nothing is pending or unacknowledged; fail on a stall.
        Returns its last info and, with `in_flight`, that count at every poll."""
        samples: list[int] = []
        last, progress_at = -1, time.monotonic()
        while True:
            info = await self.observer.consumer_info(stream, durable)
            left = (info.num_pending or 0) + (info.num_ack_pending or 0)
            if left == 0:
                return info, samples
            if in_flight is not None:
                samples.append(in_flight())
            if left != last:
                last, progress_at = left, time.monotonic()
            stalled = f"{stream}/{durable}: no progress for {STALL:.0f} s, {left} of {n} left"
            check(time.monotonic() - progress_at < STALL, stalled)
            await asyncio.sleep(POLL)

    async def pending(self, stream: str, durable: str, n: int) -> None:
        """Exactly n messages pending, none unacknowledged."""
        info = await self.observer.consumer_info(stream, durable)
        check((info.num_pending, info.num_ack_pending) == (n, 0),
              f"{stream}/{durable}: {info.num_pending} pending, {info.num_ack_pending} "
              f"unacknowledged, expected {n} and 0")  # fmt: skip

    def settings(self, database_url: str, concurrency: int, tag: str) -> Settings:
        return Settings(
            _env_file=None, data_dir=self.workdir / f"data-{tag}", embedded_services=False,
            database_url=database_url, nats_url=self.nats_url, node_id=NODE, node_tier=TIER,
            report_enabled=False, sync_enabled=False, worker_concurrency=concurrency,
            job_fetch_batch=FETCH_BATCH, heartbeat_interval_seconds=30,
        )  # fmt: skip


def _jobs(n: int, tag: str) -> list[Job]:
    return [new_job("noop", idempotency_key=f"bench-{tag}-{i:05d}") for i in range(n)]


def _bodies(n: int, tag: str) -> list[Json]:
    return [job.model_dump(mode="json", by_alias=True, exclude_none=True) for job in _jobs(n, tag)]


def _json(body: Mapping[str, Any]) -> bytes:
    """The bytes JetStreamBus.publish sends for `body`."""
    return json.dumps(body, separators=(",", ":")).encode()


async def _published(label: str, n: int, publish: Callable[[int], Awaitable[object]]) -> float:
    """Publish n messages one after the other, each awaiting its JetStream ack: the wall."""
    _say(f"{label}: publishing {n} messages")
    started = time.perf_counter()
    for i in range(n):
        await publish(i)
    return time.perf_counter() - started


def _rates(n: int, publish_seconds: float, wall: float) -> dict[str, float]:
    return {"publish_seconds": round(publish_seconds, 4),
            "publish_rate": round(n / publish_seconds, 1), "wall_seconds": round(wall, 4),
            "rate": round(n / wall, 1)}  # fmt: skip


async def _topology(world: World, settings: Settings) -> None:
    """MM_WRITE and wm-A as the worker's start-up makes them (idempotently), and empty."""
    bus = JetStreamBus(NatsServers.parse(world.nats_url), name="bench-setup", timeout=10.0)
    await bus.connect()
    try:
        await init_streams(bus, settings)
    finally:
        await bus.drain()
    await world.pending(JOB_STREAM, DURABLE, 0)


async def _nats_bench(world: World, label: str, n: int, *args: str) -> tuple[dict[str, str], float]:
    """`nats bench js ARGS` for n messages to the end: its one client's CSV row and its CPU."""
    report = world.workdir / f"{label}.csv"
    argv = [tools.find("nats"), "--no-context", "--server", world.nats_url, "--connection-name",
            f"bench-{label}", "bench", "js", *args, "--msgs", str(n), "--no-progress", "--csv",
            str(report)]  # fmt: skip
    timeout = STALL + n * TOOL_SECONDS_PER_MESSAGE
    try:
        ran = await asyncio.to_thread(tools.run, argv, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"nats bench {label} did not end within {timeout:.0f} s") from None
    except RuntimeError as exc:  # a non-zero exit, with its stderr
        raise CheckFailed(f"nats bench {label}: {exc}") from None
    rows = list(csv.DictReader(report.read_text().splitlines()))
    check(len(rows) == 1, f"nats bench {label}: {len(rows)} client rows in its CSV, not 1")
    return rows[0], ran.cpu_seconds


async def _floor(world: World, settings: Settings, n: int, batch: int, tag: str) -> Json:
    """`nats bench js pub sync --dedup` stores n noop bodies; `js fetch` acks them by `batch`."""
    body = _json(_bodies(1, f"floor-{tag}")[0])
    payload = world.workdir / f"floor-{tag}.json"
    payload.write_bytes(body)
    await _topology(world, settings)
    _say(f"floor, batch {batch}: nats bench js pub sync, {n} messages")
    published, _ = await _nats_bench(
        world, f"floor-{tag}-pub", n, "pub", "sync", job_subject(KIND, TIER, "noop"), "--stream",
        JOB_STREAM, "--payload", str(payload), "--size", f"{len(body)}B", "--dedup",
    )  # fmt: skip
    await world.pending(JOB_STREAM, DURABLE, n)
    _say(f"floor, batch {batch}: nats bench js fetch and ack")
    world.meter.start()
    started = time.perf_counter()
    fetch = ("fetch", "--stream", JOB_STREAM, "--consumer", DURABLE, "--batch", str(batch))
    fetched, tool_cpu = await _nats_bench(world, f"floor-{tag}-fetch", n, *fetch)
    info, _ = await world.drained(JOB_STREAM, DURABLE, n)
    span, cpu = time.perf_counter() - started, world.meter.spent()
    check(info.num_redelivered == 0, f"{info.num_redelivered} floor messages were redelivered")
    publish_wall, wall = float(published["DurationSecs"]), float(fetched["DurationSecs"])
    check(wall > 0 and publish_wall > 0, f"nats bench reported no duration: {fetched}")
    return {
        "messages": n, "client": "nats bench (Go): js pub sync, js fetch", "fetch_batch": batch,
        "body_bytes": len(body), **_rates(n, publish_wall, wall),  # wall: nats bench's own time
        # the tool's process from start to exit, then until the consumer showed every ack
        "process_seconds": round(span, 4), "cpu_seconds": {"nats_cli": round(tool_cpu, 3), **cpu},
    }  # fmt: skip


async def _loop_floor(
    world: World, settings: Settings, n: int, batch: int, tag: str, *, ledger: bool = False
) -> Json:
    """A nats-py loop: fetch(batch), store one event per message (awaiting every PubAck), then
    ack each; with `ledger`, each job first claimed and completed in the worker's ledger."""
    (stream,) = [s for s in stream_specs(settings) if s.name == JOB_STREAM]
    (consumer,) = [c for c in consumer_specs(settings, (TIER,)) if c.stream == JOB_STREAM]
    bodies = _bodies(n, f"bare-{tag}")
    async with AsyncExitStack() as stack:
        writes = None
        if ledger:
            url = await stack.enter_async_context(fresh_database(world.pg_url))
            pool = settings.database_pool_size
            registry = AsyncpgRegistry(url, timeout=10.0, max_connections=pool)
            await registry.open()
            stack.push_async_callback(registry.close)
            await migrating.migrate(registry, migrating.migrations_dir(None))
            writes = AsyncpgLedger(registry, node_id=NODE, claimant="bench-floor")
        bus = JetStreamBus(NatsServers.parse(world.nats_url), name="bench-bare", timeout=10.0)
        await bus.connect()
        stack.push_async_callback(bus.drain)
        nc = await nats.connect(world.nats_url, name="bench-bare-consumer")
        stack.push_async_callback(nc.close)
        js = nc.jetstream(timeout=10.0)
        for name in (BARE_STREAM, BARE_EVENTS):
            await _delete_stream(js, name)
            stack.push_async_callback(_delete_stream, js, name)
        # the same stream and consumer settings as MM_WRITE and wm-A, by construction
        await bus.ensure_stream(replace(stream, name=BARE_STREAM, subjects=(BARE_FILTER,)))
        await bus.ensure_consumer(replace(consumer, stream=BARE_STREAM, durable=BARE_DURABLE,
                                          filter_subject=BARE_FILTER))  # fmt: skip
        await bus.ensure_stream(replace(stream, name=BARE_EVENTS, subjects=(BARE_EVENT_SUBJECT,),
                                        retention="limits"))  # fmt: skip
        label = f"floor with {'the ledger and ' if ledger else ''}events, batch {batch}"
        publish_wall = await _published(label, n, lambda i: bus.publish(
            "bench.bare.noop", bodies[i], msg_id=bodies[i]["idempotency_key"]))  # fmt: skip
        await world.pending(BARE_STREAM, BARE_DURABLE, n)
        _say(f"{label}: fetch, store events, ack")
        fetches = empty = acked = 0
        world.meter.start()
        started = time.perf_counter()
        sub = await js.pull_subscribe_bind(BARE_DURABLE, stream=BARE_STREAM)
        while acked < n:
            fetches += 1
            try:
                msgs = await sub.fetch(batch, timeout=FETCH_WAIT)
            except (nats.errors.TimeoutError, TimeoutError):
                empty += 1
                check(empty * FETCH_WAIT < STALL, f"the floor stalled at {acked} of {n} acked")
                continue
            await asyncio.gather(*(_event_for(js, msg, writes) for msg in msgs))
            for msg in msgs:
                await msg.ack()
                acked += 1
        await nc.flush()
        info, _ = await world.drained(BARE_STREAM, BARE_DURABLE, n)
        wall, cpu = time.perf_counter() - started, world.meter.spent()
        await sub.unsubscribe()
        check(info.num_redelivered == 0, f"{info.num_redelivered} redelivered")
    return {
        "messages": n, "client": "nats-py", "events": True, "ledger": ledger, "fetch_batch": batch,
        "body_bytes": len(_json(bodies[0])), **_rates(n, publish_wall, wall), "fetches": fetches,
        "empty_fetches": empty, "cpu_seconds": cpu,
    }  # fmt: skip


async def _delete_stream(js: Any, name: str) -> None:
    try:
        await js.delete_stream(name)
    except (nats.errors.Error, nats.js.errors.NotFoundError, TimeoutError):
        pass


async def _event_for(js: Any, msg: Any, writes: AsyncpgLedger | None) -> None:
    """A job.completed-sized event, awaiting its ack; with `writes`, after the ledger's writes."""
    seq = msg.metadata.sequence.stream
    if writes is not None:
        job = json.loads(msg.data)
        key = job["idempotency_key"]
        await writes.claim(
            key=key, job_id=job["job_id"], job_type=job["type"], lease_seconds=LEASE_SECONDS,
            fingerprint=job_fingerprint(job["type"], job.get("payload", {})),
        )  # fmt: skip
        await writes.complete(key=key, result={"noop": True})
    body = b'{"job_id":"%d","node_id":"bench-node","code":"completed","result":{"noop":true}}'
    headers = {"Nats-Msg-Id": f"bare-{seq}:completed"}
    await js.publish(BARE_EVENT_SUBJECT, body % seq, headers=headers)


def _counts(runtime: Runtime, metric: str, label: str) -> dict[str, float]:
    """A worker metric's samples by `label`'s value, the sample's suffix appended."""
    found: dict[str, float] = {}
    for family in getattr(runtime.metrics, metric).collect():
        for s in family.samples:
            found[f"{s.labels.get(label)}_{s.name.rsplit('_', 1)[-1]}"] = s.value
    return found


async def _whole(
    world: World, n: int, concurrency: int, tag: str, during: Callable[[], object] | None = None
) -> Json:
    """Pre-publish n noop jobs, start the manager, time from worker ready to all acked."""
    jobs = _jobs(n, tag)
    async with fresh_database(world.pg_url) as database_url:
        settings = world.settings(database_url, concurrency, tag)
        await _topology(world, settings)
        bus = JetStreamBus(NatsServers.parse(world.nats_url), name="bench-publisher", timeout=10.0)
        await bus.connect()
        try:
            publish_wall = await _published(f"whole path, concurrency {concurrency}", n,
                lambda i: publish_job(bus, jobs[i], kind=KIND, tier=TIER))  # fmt: skip
        finally:
            await bus.drain()
        await world.pending(JOB_STREAM, DURABLE, n)
        app = create_app(settings)
        runtime: Runtime = app.state.runtime
        _say(f"whole path, concurrency {concurrency}: starting the manager, running {n} jobs")
        async with app.router.lifespan_context(app):
            component, deadline = runtime.components["worker"], time.monotonic() + 60.0
            while component.state != "ok":
                check(component.enabled, f"the worker is off: {component.reason}")
                late = f"the worker did not start: {component.as_dict()}"
                check(time.monotonic() < deadline, late)
                await asyncio.sleep(0.001)
            world.meter.start()
            started = time.perf_counter()
            if during is not None:
                during()
            working = runtime.get(WORKER)
            assert working is not None
            worker = working.worker
            info, in_flight = await world.drained(JOB_STREAM, DURABLE, n, lambda: worker.in_flight)
            wall, cpu = time.perf_counter() - started, world.meter.spent()
        conn = await asyncpg.connect(database_url, timeout=10)
        try:
            rows = await conn.fetch(
                "SELECT idempotency_key, status, attempts, node_id, EXTRACT(EPOCH FROM "
                "completed_at - created_at)::float8 AS seconds, EXTRACT(EPOCH FROM created_at)"
                "::float8 AS claimed, EXTRACT(EPOCH FROM completed_at)::float8 AS completed "
                "FROM job_ledger")  # fmt: skip
        finally:
            await conn.close()
    counted = _counts(runtime, "jobs", "outcome").items()
    outcomes = {k.removesuffix("_total"): int(v) for k, v in counted if k.endswith("_total") and v}
    completed = [r for r in rows if r["status"] == "completed"]
    keys = {r["idempotency_key"] for r in rows} == {job.idempotency_key for job in jobs}
    held = f"the ledger holds {len(rows)} rows, {len(completed)} completed"
    check(len(rows) == len(completed) == n and keys, f"{held}; expected the {n} keys, completed")
    attempts = sorted({int(r["attempts"]) for r in rows})
    check(attempts == [1], f"ledger attempts {attempts}, expected all 1")
    check({r["node_id"] for r in rows} == {NODE}, "a ledger row names another node")
    check(outcomes == {"completed": n}, f"worker outcomes {outcomes}, expected {n} completed")
    check(info.num_redelivered == 0, f"{info.num_redelivered} jobs were redelivered")
    span = max(float(r["completed"]) for r in rows) - min(float(r["claimed"]) for r in rows)
    duration = _counts(runtime, "job_duration", "type")  # delivery to answer, seconds
    count = duration.get("noop_count")
    mean = duration.get("noop_sum", 0.0) / count if count else None
    return {
        "jobs": n, "concurrency": concurrency, "fetch_batch": FETCH_BATCH,
        **_rates(n, publish_wall, wall), "ledger_span_seconds": round(span, 4),
        "ledger_rate": round(n / span, 1) if span > 0 else None,
        "claim_to_complete_ms": latency_ms(sorted(float(r["seconds"]) for r in rows), 1000),
        "delivery_to_answer_mean_ms": None if mean is None else round(1000 * mean, 2),
        # jobs in flight at each 10 ms poll: how much of WORKER_CONCURRENCY was in use
        "in_flight_mean": round(statistics.fmean(in_flight), 2) if in_flight else None,
        "in_flight_max": max(in_flight, default=None), "outcomes": outcomes, "cpu_seconds": cpu,
    }  # fmt: skip


async def _measure(world: World, n: int, concurrency: int) -> Json:
    batch, tag = min(concurrency, FETCH_BATCH), f"c{concurrency}"  # no more than free slots
    r: Json = dict.fromkeys(("bare", "bare_events", "bare_ledger", "whole", "failure"))
    r["concurrency"] = concurrency
    # only the stream and consumer settings are used: the database URL is a placeholder
    settings = world.settings(world.pg_url, concurrency, tag)
    steps: dict[str, tuple[str, Callable[[], Awaitable[Json]]]] = {
        "bare": ("floor", lambda: _floor(world, settings, n, batch, tag)),
        "bare_events": ("floor with events",
                        lambda: _loop_floor(world, settings, n, batch, f"{tag}-ev")),
        "bare_ledger": ("floor with the ledger's writes and events",
                        lambda: _loop_floor(world, settings, n, batch, f"{tag}-lg", ledger=True)),
        "whole": ("whole path", lambda: _whole(world, n, concurrency, tag)),
    }  # fmt: skip
    for key, (phase, step) in steps.items():
        try:
            r[key] = await step()
        except CheckFailed as exc:
            r["failure"] = {"phase": phase, "reason": str(exc)}
            _say(f"concurrency {concurrency}: FAILED in {phase}: {exc}")
            break
    ratios = {"ratio_to_go": ("whole", "bare"), "ratio": ("whole", "bare_ledger"),
              "events_floor_ratio": ("bare_events", "bare"),
              "ratio_to_events_floor": ("whole", "bare_events")}  # fmt: skip
    for name, (part, whole) in ratios.items():
        if r[part] and r[whole]:
            r[name] = round(r[part]["rate"] / r[whole]["rate"], 3)
    if "ratio" in r:  # the target: the whole path against the same writes with nothing around
        r["target_met"] = r["ratio"] >= TARGET_RATIO
    return r


async def _profile(world: World, n: int, expected_wall: float) -> Json:
    """An extra, unmeasured whole-path run at concurrency 16 with py-spy sampling us."""
    seconds, output = max(1.0, 0.9 * expected_wall), world.workdir / "jobs.pyspy.txt"
    holder: Json = {}

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
    if "sampler" not in holder:
        return {"error": holder.get("error", "py-spy did not start")}
    return sampling.finish(holder["sampler"], output, seconds)


async def _measure_all(world: World, n: int, profile: bool) -> Json:
    nc = await nats.connect(world.nats_url, name="bench-observer")
    world.observer = nc.jetstream(timeout=10.0)
    try:
        runs = {str(c): await _measure(world, n, c)
                for c in dict.fromkeys((DEFAULT_CONCURRENCY, WIDE_CONCURRENCY))}  # fmt: skip
        result: Json = {"runs": runs}
        if profile and (wide := runs[str(WIDE_CONCURRENCY)].get("whole")) is not None:
            result["profile"] = await _profile(world, n, wide["wall_seconds"])
        return result
    finally:
        await nc.close()


def run(options: Options) -> Json:
    n = QUICK_JOBS if options.quick else JOBS
    nats_cli = tools.version("nats", "--version")  # names the install script if absent
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as tmp:
        _say("starting PostgreSQL and nats-server")
        with data_servers(Path(tmp)) as (pg, server):
            assert pg.pid is not None and server.pid is not None
            nats_pid, pg_pid = server.pid, pg.pid
            meter = proc.Meter(python=functools.partial(proc.cpu_seconds, os.getpid()),
                               nats=lambda: proc.cpu_seconds(nats_pid),
                               postgres=lambda: proc.cpu_seconds(pg_pid, tree=True))  # fmt: skip
            world = World(server.url, pg.url, Path(tmp), meter)
            measured = asyncio.run(_measure_all(world, n, options.profile))
    runs = measured["runs"]
    setup: Json = {
        "jobs": n,
        "nats_cli": nats_cli,
        "load_average_1m_before": round(os.getloadavg()[0], 2),
        "settings_from_environment": overridden(EXPLICIT),
    }
    result: Json = {"setup": setup, **measured}
    result["ok"] = all(r["failure"] is None for r in runs.values())
    met = all(r.get("target_met") for r in runs.values()) if result["ok"] else None
    result["targets"] = {"whole_path_vs_ledger_loop": {
        "target": f">= {TARGET_RATIO}x", "measured": {c: r.get("ratio") for c, r in runs.items()},
        "met": met}}  # fmt: skip
    result["tables"] = _tables(runs, n, measured.get("profile"))
    result["notes"] = [
        f"CPU: {os.cpu_count()} cores shared, nothing pinned; at >= {100 * CPU_BOUND:.0f} % "
        f"this process is CPU-bound. Load average before the run: "
        f"{setup['load_average_1m_before']}; nats CLI {nats_cli}.",
        *(f"FAILED at WORKER_CONCURRENCY={c} in {r['failure']['phase']}: "
          f"{r['failure']['reason']}" for c, r in runs.items() if r["failure"] is not None),
        *env_note(setup["settings_from_environment"]),
    ]  # fmt: skip
    return result


def _tables(runs: Mapping[str, Any], n: int, profile: Mapping[str, Any] | None) -> list[Json]:
    def cpu(phase: Mapping[str, Any]) -> list[Any]:
        """CPU % of the client, nats-server and PostgreSQL; the client's CPU ms per message."""
        spent, span = phase["cpu_seconds"], phase.get("process_seconds", phase["wall_seconds"])
        client = spent.get("nats_cli", spent["python"])
        shares = (client, spent["nats"], spent["postgres"])
        return [" / ".join(f"{100 * c / span:.0f}" for c in shares), 1000 * client / n]

    rows: list[list[Any]] = []
    for c, r in runs.items():
        bare, events, floor, whole = r["bare"], r["bare_events"], r["bare_ledger"], r["whole"]
        for phase, label, ratio in (
            (bare, "floor: nats bench js fetch {}, ack each (Go)", 1.0),
            (events, "nats-py loop + an event stored before each ack, fetch {}",
             r.get("events_floor_ratio")),
            (floor, "nats-py loop + the worker's ledger claim and completion + the event, fetch {}",
             floor and bare and floor["rate"] / bare["rate"]),
        ):  # fmt: skip
            if phase is not None and bare is not None:
                rates = [phase[k] for k in ("publish_rate", "wall_seconds", "rate")]
                rows.append(
                    [label.format(phase["fetch_batch"]), *rates, ratio, None, None, *cpu(phase)]
                )
        if whole is not None:
            lat = whole["claim_to_complete_ms"]
            met = "met" if r.get("target_met") else "NOT met"
            versus = f"{r['ratio']:.2f}x the ledger loop ({met})" if "ratio" in r else "-"
            versus += f"; {r['ratio_to_go']:.2f}x Go" if "ratio_to_go" in r else ""
            versus += f"; {r['ratio_to_events_floor']:.2f}x the events loop" if events else ""
            default = " (default)" if int(c) == DEFAULT_CONCURRENCY else ""
            rows.append([f"whole path: WORKER_CONCURRENCY={c}{default}", whole["publish_rate"],
                         whole["wall_seconds"], whole["rate"], versus,
                         f"{whole['in_flight_mean']} of {c}",
                         f"{lat['p50']:.1f} / {lat['p99']:.1f}", *cpu(whole)])  # fmt: skip
        if r["failure"] is not None:
            rows.append([f"FAILED at {c} in {r['failure']['phase']}", *[None] * 7,
                         r["failure"]["reason"]])  # fmt: skip
    tables = [table(
        f"jobs: {n:,} noop jobs, whole path against the nats-py loop with the same ledger writes "
        "(and the nats bench fetch-ack floor)",
        ["path", "publish /s{,.0f}", "wall s{.3f}", "per s{,.0f}",
         f"x Go floor; whole path: x ledger loop (>= {TARGET_RATIO}){{.2f}}", "in flight (mean)",
         "claim->done p50 / p99 ms", "CPU % client / nats / pg", "client CPU ms per job{.3f}"],
        rows)]  # fmt: skip
    if profile is not None:
        tables += sampling.tables(f"jobs: whole path at {WIDE_CONCURRENCY}", dict(profile))
    return tables
