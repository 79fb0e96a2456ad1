"""Helpers for job-worker tests: publish jobs, collect events, read the ledger."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.adapters.bus import JetStreamBus, NatsAuth
from app.adapters.embedded import EmbeddedNats
from app.domain.jobs import Job, job_subject
from app.domain.nats_servers import NatsServers
from app.services.streams import new_job, publish_job
from tests.support import asyncapi
from tests.support.polling import eventually
from tests.support.process import ManagerProcess


class EventLog:
    """Every message on mm.events.> as (subject, body), via a core NATS subscription."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def kinds(self, key: str | None = None) -> list[str]:
        return [
            subject.split(".", 3)[3]
            for subject, body in self.events
            if key is None or body.get("idempotency_key") == key
        ]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [body for subject, body in self.events if subject.endswith("." + kind)]

    async def wait_for(self, predicate: Callable[[], bool], within: float = 15.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"events so far: {self.events}")


@asynccontextmanager
async def watching_events(url: str) -> AsyncIterator[EventLog]:
    """Every event while the block runs; each one must be what docs/asyncapi.yaml says
    (checked as it comes, asserted when the block ends)."""
    log = EventLog()
    unlike: list[str] = []

    async def collect(msg: Any) -> None:
        body = json.loads(msg.data)
        log.events.append((msg.subject, body))
        said = asyncapi.check(msg.subject, body)
        if said is not None:
            unlike.append(said)

    async with _subscribed(url, "mm.events.>", collect):
        yield log
    assert unlike == [], "events unlike docs/asyncapi.yaml"


@asynccontextmanager
async def _subscribed(
    url: str, subject: str, collect: Callable[[Any], Awaitable[None]]
) -> AsyncIterator[None]:
    """A connection of its own, subscribed to `subject` while the block runs."""
    nc = await nats.connect(url)
    await nc.subscribe(subject, cb=collect)
    try:
        yield
    finally:
        await nc.drain()


@asynccontextmanager
async def publisher(url: str, auth: NatsAuth | None = None) -> AsyncIterator[JetStreamBus]:
    bus = JetStreamBus(NatsServers.parse(url), name="test-publisher", timeout=5, auth=auth)
    await bus.connect()
    try:
        yield bus
    finally:
        await bus.drain()


async def publish(
    bus: JetStreamBus, job_type: str = "noop", *, kind: str = "write", tier: str = "A",
    **fields: Any,
) -> Job:  # fmt: skip
    job = new_job(job_type, **fields)
    await publish_job(bus, job, kind=kind, tier=tier)
    return job


async def ledger(url: str) -> dict[str, asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT * FROM job_ledger")
    finally:
        await conn.close()
    return {r["idempotency_key"]: r for r in rows}


async def completed_count(url: str) -> int:
    """Completed jobs in the ledger; 0 while the manager has not migrated the database."""
    conn = await asyncpg.connect(url)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM job_ledger WHERE status = 'completed'"
        )
        return count
    except asyncpg.UndefinedTableError:
        return 0
    finally:
        await conn.close()


async def at_least_completed(url: str, count: int) -> bool:
    return await completed_count(url) >= count


async def in_ledger(url: str, key: str) -> bool:
    return key in await ledger(url)


def manager_env(database: str, nats_url: str, node: str, tier: str) -> dict[str, str]:
    """A manager process that runs jobs of `tier` and heartbeats every second."""
    return {
        "DATABASE_URL": database,
        "NATS_URL": nats_url,
        "NODE_ID": node,
        "NODE_TIER": tier,
        "HEARTBEAT_INTERVAL_SECONDS": "1",
        "REPORT_ENABLED": "false",
        "SHUTDOWN_GRACE_SECONDS": "15",
    }


async def _consumer_info(url: str | list[str], stream: str, durable: str) -> Any:
    nc = await nats.connect(url)
    try:
        return await nc.jetstream().consumer_info(stream, durable)
    finally:
        await nc.close()


async def consumer_bound(
    url: str | list[str], stream: str, pullers: int, durable: str = "wm-A"
) -> bool:
    """True once `pullers` pull requests wait on the durable (its workers are up)."""
    try:
        info = await _consumer_info(url, stream, durable)
    except nats.js.errors.NotFoundError:
        return False
    return int(info.num_waiting or 0) >= pullers


async def consumer_settled(url: str | list[str], stream: str, durable: str = "wm-A") -> bool:
    """True when every message on the durable has been answered for good."""
    try:
        info = await _consumer_info(url, stream, durable)
    except (nats.errors.Error, TimeoutError):  # a cluster electing a leader: ask again
        return False
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


async def stored_events(
    url: str | list[str], *, within: float = 30.0
) -> list[tuple[str, dict[str, Any]]]:
    """The events MM_EVENTS holds (what was acknowledged), as (subject, body). A cluster
    that answers 503 (JetStream temporarily unavailable: a member just came back and the
    meta leader is still settling) is asked again until `within` has passed."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await _read_events(url)
        except nats.js.errors.ServiceUnavailableError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)


async def _read_events(url: str | list[str]) -> list[tuple[str, dict[str, Any]]]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info("MM_EVENTS")
        except nats.js.errors.NotFoundError:
            return []
        found = []
        for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
            try:
                msg = await js.get_msg("MM_EVENTS", seq)
            except nats.js.errors.NotFoundError:
                continue
            found.append((msg.subject or "", json.loads(msg.data or b"{}")))
        return found
    finally:
        await nc.close()


class EffectCounter:
    """A workload that counts the calls it gets per idempotency key (the job's effect),
    holding each call long enough that two copies of one job overlap. While `paused`,
    calls are counted and then wait for `resume()` (it serves from another thread)."""

    def __init__(self, hold: float, *, paused: bool = False) -> None:
        self.calls: dict[str, int] = {}
        self._hold = hold
        self._running = threading.Event()
        if not paused:
            self._running.set()

    def resume(self) -> None:
        self._running.set()

    def app(self) -> Starlette:
        async def effect(request: Request) -> JSONResponse:
            key = request.headers.get("idempotency-key", "")
            self.calls[key] = self.calls.get(key, 0) + 1
            await asyncio.to_thread(self._running.wait)
            await asyncio.sleep(self._hold)  # the workload's own work time
            return JSONResponse({"stored": key})

        return Starlette(routes=[Route("/effect", effect, methods=["POST"])])

    async def started(self, key: str) -> bool:
        return key in self.calls


# -- routing, budget and claim tests (tests/e2e/test_job_routing.py, tests/faults/) ----------

FINAL_EVENTS = ("job.completed", "job.rejected", "job.expired", "job.dead")


def final_events(log: EventLog, key: str) -> list[tuple[str, dict[str, Any]]]:
    """The final events seen for `key`, as (kind, body), in the order they came."""
    found = []
    for subject, body in log.events:
        kind = subject.split(".", 3)[3]
        if body.get("idempotency_key") == key and kind in FINAL_EVENTS:
            found.append((kind, body))
    return found


def all_final(log: EventLog, keys: list[str]) -> Callable[[], Awaitable[bool]]:
    """An `eventually` check: every key has had a final event."""

    async def check() -> bool:
        return all(final_events(log, key) for key in keys)

    return check


async def wait_final(log: EventLog, keys: list[str], *, url: str, within: float) -> None:
    """Wait until every key has had a final event; else fail naming the keys still
    without one and what the job consumers of tier A hold (a message NAK'd for later
    shows as ack-pending until it comes back)."""
    try:
        await eventually(all_final(log, keys), within=within, step=0.1)
    except AssertionError:
        missing = [key for key in keys if not final_events(log, key)]
        held = {}
        for stream in ("MM_ONLINE", "MM_OFFLINE", "MM_WRITE"):
            info = await _consumer_info(url, stream, "wm-A")
            held[stream] = {"pending": info.num_pending, "ack_pending": info.num_ack_pending}
        raise AssertionError(
            f"{len(missing)} of {len(keys)} jobs without a final event after {within} s: "
            f"{missing}; consumers: {held}"
        ) from None


def worker_env(nats_url: str, node: str, tier: str = "A") -> dict[str, str]:
    """A manager process without a database (the JetStream ledger, no registry) that
    runs jobs of `tier`."""
    return {
        "NATS_URL": nats_url,
        "NODE_ID": node,
        "NODE_TIER": tier,
        "REPORT_ENABLED": "false",
        "SHUTDOWN_GRACE_SECONDS": "15",
    }


async def metric_samples(manager_url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric `name` on the manager's /metrics, as (labels, value)."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{manager_url}/metrics")).text
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


async def job_outcomes(manager_url: str, job_type: str = "noop") -> dict[str, float]:
    """The manager's `workload_manager_jobs_total` for `job_type`, by outcome."""
    samples = await metric_samples(manager_url, "workload_manager_jobs_total")
    return {labels["outcome"]: value for labels, value in samples if labels["type"] == job_type}


async def jobs_in_flight(manager_url: str) -> float:
    """Jobs the manager is handling now (fetched and not yet answered or given up)."""
    [(_labels, value)] = await metric_samples(manager_url, "workload_manager_jobs_in_flight")
    return value


async def ledger_row(url: str, key: str) -> asyncpg.Record | None:
    """The ledger's row of `key`; None while there is none, no table yet or no server."""
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, asyncpg.PostgresError):
        return None
    try:
        row: asyncpg.Record | None = await conn.fetchrow(
            "SELECT * FROM job_ledger WHERE idempotency_key = $1", key
        )
        return row
    except asyncpg.UndefinedTableError:
        return None
    finally:
        await conn.close()


async def publish_as(bus: JetStreamBus, job: Job, *, msg_id: str, kind: str = "write",
                     tier: str = "A") -> None:  # fmt: skip
    """Publish `job` under a message id of its own: past JetStream's duplicate window, as
    a producer republishing after it, so that the ledger is what sees the key again."""
    body = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    await bus.publish(job_subject(kind, tier, job.type), body, msg_id=msg_id)


async def publish_raw(url: str, job: Job, *, kind: str = "write", tier: str = "A") -> int:
    """Publish `job` as `publish_job` does (its key as Nats-Msg-Id), with nats-py's own
    client; the stream sequence it got."""
    body = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    nc = await nats.connect(url)
    try:
        ack = await nc.jetstream().publish(
            job_subject(kind, tier, job.type), json.dumps(body).encode(),
            headers={"Nats-Msg-Id": job.idempotency_key},
        )  # fmt: skip
    finally:
        await nc.close()
    return int(ack.seq)


class NakLog:
    """JetStream's NAK advisories (nats-server >= 2.10): how often each stream message has
    been delivered and handed back, by stream and stream sequence, as the server counts."""

    def __init__(self) -> None:
        self.deliveries: dict[tuple[str, int], int] = {}

    def delivered(self, stream: str, seq: int) -> int:
        return self.deliveries.get((stream, seq), 0)


@asynccontextmanager
async def watching_naks(url: str) -> AsyncIterator[NakLog]:
    log = NakLog()

    async def collect(msg: Any) -> None:
        body = json.loads(msg.data)
        where = (str(body["stream"]), int(body["stream_seq"]))
        log.deliveries[where] = max(log.deliveries.get(where, 0), int(body["deliveries"]))

    async with _subscribed(url, "$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.>", collect):
        yield log


@contextmanager
def own_nats(directory: Path) -> Iterator[EmbeddedNats]:
    """A nats-server of the test's own: its streams and consumers hold nothing another
    test left behind, and its settings (ack wait, backoff) are this test's."""
    server = EmbeddedNats(directory).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def running_managers(
    workdir: Path, envs: dict[str, dict[str, str]], *, ready_within: float = 90.0
) -> Iterator[dict[str, ManagerProcess]]:
    """Manager processes started together (each in `workdir/<name>`) and ready; on exit
    each is resumed (a test may have stopped one with SIGSTOP) and stopped."""
    procs: dict[str, ManagerProcess] = {}
    try:
        for name, env in envs.items():
            (workdir / name).mkdir(parents=True, exist_ok=True)
            procs[name] = ManagerProcess(env=env, workdir=workdir / name)
            procs[name].start(wait_ready=False)
        for proc in procs.values():
            proc.wait_ready(ready_within)
        yield procs
    finally:
        unstopped: list[Exception] = []
        for proc in procs.values():
            try:
                if proc.running:
                    proc.send(signal.SIGCONT)
                proc.stop()
            except Exception as exc:  # the others are stopped all the same
                unstopped.append(exc)
        if unstopped:
            raise unstopped[0]


def logs(procs: dict[str, ManagerProcess]) -> str:
    """Every manager's log, headed by its name, for an assertion's message."""
    return "".join(f"\n--- {name} ---\n{proc.log()}" for name, proc in procs.items())


async def stream_messages(url: str, stream: str) -> int:
    """Messages `stream` holds: on a work-queue stream, those not acked yet."""
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(stream)
    finally:
        await nc.close()
    return int(info.state.messages)


async def stream_exists(url: str, stream: str) -> bool:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().stream_info(stream)
    except nats.js.errors.NotFoundError:
        return False
    finally:
        await nc.close()
    return True


# The `http` job may call only the cluster's Services (HTTP_JOB_ALLOWED_TARGETS); a test
# workload on loopback is reached under a Service's name through HTTP_PROXY, which httpx
# honours: the manager sends `POST http://effect.workloads.svc:8080/effect` to the proxy
# address, and the workload (uvicorn) serves the absolute-form request itself.
EFFECT_URL = "http://effect.workloads.svc:8080/effect"


def through_proxy(workload_url: str) -> dict[str, str]:
    """Environment for a manager whose http jobs reach `workload_url` as EFFECT_URL."""
    return {"HTTP_PROXY": workload_url, "NO_PROXY": "127.0.0.1,localhost"}
