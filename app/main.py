"""The FastAPI application: routes, middleware, and a lifespan that owns every resource."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI, Request, Response
from starlette.requests import ClientDisconnect

from app import __version__
from app.api import admin, fleet, page, pings, probes, status
from app.api.fastping import PingAnswers
from app.api.middleware import BodyLimitMiddleware, RequestIdMiddleware
from app.services.runtime import Runtime, build_runtime, start_runtime
from app.settings import Settings, load_settings

DEFAULT_BODY_LIMIT = 1024 * 1024


async def _client_gone(request: Request, exc: Exception) -> Response:
    """A client that went away in the middle of its body (or was closed by the server's
    body timeout) is no application error: no traceback, no Sentry event. The answer is
    never sent; the server drops it."""
    return Response(status_code=400)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    rt: Runtime = app.state.runtime
    async with AsyncExitStack() as stack:
        if rt.settings.sentry_dsn is not None:
            from app.adapters import sentry

            stack.callback(lambda: sentry.flush(timeout=min(2.0, rt.shutdown.remaining())))
        await start_runtime(rt, stack)
        try:
            yield
        finally:
            rt.stopping = True


def create_app(
    settings: Settings | None = None, *, clock: Callable[[], float] = time.monotonic
) -> FastAPI:
    """The app; `clock` (monotonic seconds) is the workload book's, for tests."""
    settings = settings or load_settings()
    if settings.sentry_dsn is not None:
        from app.adapters import sentry

        sentry.init(
            dsn=settings.sentry_dsn.get_secret_value(),
            environment=settings.app_env.value,
            traces_sample_rate=settings.sentry_traces_sample_rate,
        )
    runtime = build_runtime(settings, clock=clock)
    app = FastAPI(
        title="Node workload manager",
        version=__version__,
        lifespan=_lifespan,
        docs_url="/docs" if not settings.is_production else None,
        redoc_url=None,
    )
    app.state.runtime = runtime
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.include_router(pings.router)
    app.include_router(status.router)
    app.include_router(probes.router)
    app.include_router(admin.router)
    app.include_router(fleet.router)
    app.include_router(page.router)
    ping_path = re.compile(r"/v1/workloads/[^/]+/health")

    def count_refused(path: str) -> None:
        if ping_path.fullmatch(path):
            runtime.metrics.ping_rejections.labels("too-large").inc()

    app.add_middleware(
        BodyLimitMiddleware,
        default_limit=DEFAULT_BODY_LIMIT,
        limits=[(ping_path, settings.ping_max_body_bytes)],
        on_refused=count_refused,
    )
    app.add_middleware(RequestIdMiddleware)
    # what the HTTP server answers valid pings with, before the framework (app/server.py)
    app.state.ping_answers = (
        PingAnswers(runtime=runtime, limit=settings.ping_max_body_bytes)
        if settings.ping_fast_path
        else None
    )
    return app


def app_from_environment() -> FastAPI:
    """Factory for `uvicorn --factory` (used by `serve --reload`): settings and logs from env."""
    from app import logs, server

    settings = load_settings()
    logs.configure(level=settings.log_level, json_lines=settings.json_logs)
    app = create_app(settings)
    # the protocol uvicorn imports by name (`server.RELOAD_PROTOCOL`) counts on this app's
    # metrics: this process serves only this app
    server.BoundedHttpProtocol.refusal_counter = app.state.runtime.metrics.http_refusals
    return app
