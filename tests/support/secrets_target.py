"""The manager with one route that fails the way an outbound call does, for the secrets test.

Run as `python -m tests.support.secrets_target PORT URL`: it builds the real app from the
environment (settings, logging, Sentry, every component) and adds `GET /fetch`, which GETs
URL with httpx and lets the `HTTPStatusError` it gets go unhandled. httpx names the URL,
query and all, in that error, and the URL sits in the failing frame's variables, so the
Sentry event it becomes carries the URL in its exception value, its frames and its
breadcrumbs (the log lines before it).
"""

from __future__ import annotations

import sys

import httpx
import uvicorn

from app.main import app_from_environment


def main() -> None:
    port, url = int(sys.argv[1]), sys.argv[2]
    app = app_from_environment()

    @app.get("/fetch")
    async def fetch() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(url)
            response.raise_for_status()

    uvicorn.run(app, host="127.0.0.1", port=port, log_config=None)


if __name__ == "__main__":
    main()
