"""The manager with one failing route and one failing loop, for the Sentry test.

Run as `python -m tests.support.sentry_target PORT` with SENTRY_DSN set: it builds the
real app from the environment, adds the two failures, and serves it.
"""

from __future__ import annotations

import sys

import uvicorn

from app.main import app_from_environment


class RouteBoom(RuntimeError):
    pass


class LoopBoom(RuntimeError):
    pass


def main() -> None:
    app = app_from_environment()

    @app.get("/boom")
    async def boom() -> None:
        raise RouteBoom("route failed on purpose")

    async def failing_loop() -> None:
        raise LoopBoom("loop failed on purpose")

    app.state.runtime.supervisor.add_loop("boom", failing_loop, every=3600, first_after=0.5)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_config=None)


if __name__ == "__main__":
    main()
