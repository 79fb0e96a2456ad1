"""An ASGI app served by a real uvicorn server, in the test's process, with the manager's
bounded protocol (app/server.py) and, when given, its ping fast path."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn

from app.api.fastping import PingAnswers
from app.server import HttpLimits, bounded_protocol
from tests.support.polling import eventually

LIMITS = HttpLimits(
    max_header_bytes=16 * 1024,
    header_timeout=60.0,
    body_timeout=60.0,
    keepalive_timeout=60.0,
    max_connections=100,
    max_connections_per_client=100,
)


@asynccontextmanager
async def serving(
    app: Any, *, limits: HttpLimits = LIMITS, pings: PingAnswers | None = None
) -> AsyncIterator[int]:
    """A uvicorn server for `app` on a free port, lifespan off; yields the port."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=bounded_protocol(limits, None, pings),
        lifespan="off",
        # as the manager serves: no access log (with one, the fast path is off)
        log_config=None,
        access_log=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())

    async def started() -> bool:
        assert not task.done(), "the server stopped"
        return server.started

    try:
        await eventually(started, within=10)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)


@asynccontextmanager
async def served_client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client over real HTTP to the manager's `app` (from `create_app`), valid pings
    answered by the server's fast path when the app has one."""
    async with (
        serving(app, pings=app.state.ping_answers) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
    ):
        yield client
