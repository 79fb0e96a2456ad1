"""Helpers for job-worker tests: publish jobs, collect events, read the ledger."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import nats
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.adapters.bus import JetStreamBus
from app.domain.jobs import Job
from app.services.streams import new_job, publish_job


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
    log = EventLog()
    nc = await nats.connect(url)

    async def collect(msg: Any) -> None:
        log.events.append((msg.subject, json.loads(msg.data)))

    await nc.subscribe("mm.events.>", cb=collect)
    try:
        yield log
    finally:
        await nc.drain()


@asynccontextmanager
async def publisher(url: str) -> AsyncIterator[JetStreamBus]:
    bus = JetStreamBus(url, name="test-publisher", timeout=5)
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
    info = await _consumer_info(url, stream, durable)
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


async def stored_events(url: str | list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The events MM_EVENTS holds (what was acknowledged), as (subject, body)."""
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
