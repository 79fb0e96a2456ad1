"""Job handlers, looked up by job `type`: built-ins and entry-point plugins.

A handler is `async def handle(job: Job, context: HandlerContext) -> JSON-able result`.
It raises `RetryableJobFailure` or `PermanentJobFailure` to say how a failure should be
treated; otherwise `classify_failure` decides (a ValueError, KeyError or TypeError is
permanent, anything else retried up to JOB_MAX_ATTEMPTS attempts; docs/jobs.md).

Plugins register in the `workload_manager.handlers` entry-point group, the entry
point's name being the job type:

    [project.entry-points."workload_manager.handlers"]
    "memory.write" = "my_package.handlers:write_memory"
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from app.adapters.workload_http import WorkloadHttp, WorkloadHttpError
from app.domain.jobs import Job, PermanentJobFailure, RetryableJobFailure

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "workload_manager.handlers"
NOOP_MAX_DELAY_SECONDS = 300.0


@dataclass(frozen=True)
class HandlerContext:
    node_id: str
    # JetStream's delivery count of the message: hand-ons to capable nodes, a held key and
    # outages spend deliveries too
    delivered: int
    # the ledger's count of real attempts at running this job, this one included (1 for
    # the first): what a handler that acts on retries should count
    attempt: int
    http: WorkloadHttp


Handler = Callable[[Job, HandlerContext], Awaitable[Any]]


async def noop(job: Job, context: HandlerContext) -> dict[str, Any]:
    """Does nothing, for tests, drills and benchmarks. The payload may ask it to take
    `delay_seconds` (at most 300) or to fail: `fail` = "retryable" | "permanent", and
    `fail_times` to fail only on the first N attempts (`context.attempt`: deliveries
    spent on handing the job on or waiting for a held key do not count)."""
    delay = float(job.payload.get("delay_seconds", 0))
    if delay:
        await asyncio.sleep(min(max(delay, 0.0), NOOP_MAX_DELAY_SECONDS))
    fail = job.payload.get("fail")
    if fail and context.attempt <= int(job.payload.get("fail_times", 1_000_000)):
        if fail == "permanent":
            raise PermanentJobFailure("noop asked to fail permanently")
        raise RetryableJobFailure("noop asked to fail, retryably")
    return {"noop": True, "delivered": context.delivered}


async def http(job: Job, context: HandlerContext) -> dict[str, Any]:
    """POST `payload.body` to `payload.url`, a workload's in-cluster URL.

    5xx answers, timeouts and connection errors are retried; 4xx answers, a missing URL,
    a URL that cannot be sent (whitespace, control characters, userinfo, a bad port) and
    a host outside HTTP_JOB_ALLOWED_TARGETS are permanent failures. The result is
    `{"status", "body"}`, the body being the JSON document or the text of the answer, as
    the workload sent it (a NUL stays a NUL); of a body longer than MAX_RESPONSE_BYTES
    only that much is read and kept, as text, and the result says so with
    `"truncated": true` and `"kept_bytes"`.
    """
    url = job.payload.get("url")
    if not isinstance(url, str):
        raise PermanentJobFailure("payload.url is required (a workload's in-cluster URL)")
    try:
        response = await context.http.post_capped(
            url, job.payload.get("body", {}), headers={"Idempotency-Key": job.idempotency_key}
        )
    except WorkloadHttpError as exc:
        if exc.retryable:
            raise RetryableJobFailure(str(exc)) from None
        raise PermanentJobFailure(str(exc)) from None
    result: dict[str, Any] = {"status": response.status, "body": response.body}
    if response.truncated:
        result |= {"truncated": True, "kept_bytes": response.kept_bytes}
    return result


BUILT_IN: dict[str, Handler] = {"noop": noop, "http": http}


@dataclass(frozen=True)
class JobHandlers:
    """What runs jobs on this node: the handlers by job type, and the workload HTTP client
    each handler's context carries."""

    table: dict[str, Handler]
    http: WorkloadHttp


def load_handlers() -> dict[str, Handler]:
    """Built-ins plus installed plugins; a plugin that fails to load is logged and skipped."""
    handlers = dict(BUILT_IN)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            handler = entry.load()
        except Exception:  # a broken plugin must not stop the manager
            log.exception("job handler plugin %s (%s) failed to load", entry.name, entry.value)
            continue
        if not callable(handler):
            log.error("job handler plugin %s is not callable; skipped", entry.name)
            continue
        if entry.name in BUILT_IN:
            log.warning("plugin %s replaces the built-in handler", entry.name)
        handlers[entry.name] = handler
    return handlers
