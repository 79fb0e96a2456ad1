"""Error tracking with sentry-sdk: route errors, and loop errors through the logging integration.

Scheduled loops log their failures with `log.exception`, which the logging
integration turns into Sentry events; routes are covered by the FastAPI integration.
Request bodies and headers are not sent (`send_default_pii=False`).
"""

from __future__ import annotations

import logging

import sentry_sdk
from sentry_sdk.integrations.fastapi import FastApiIntegration
from sentry_sdk.integrations.logging import LoggingIntegration
from sentry_sdk.integrations.starlette import StarletteIntegration

from app import __version__


def init(*, dsn: str, environment: str, traces_sample_rate: float) -> None:
    sentry_sdk.init(
        dsn=dsn,
        environment=environment,
        release=f"workload-manager@{__version__}",
        send_default_pii=False,
        traces_sample_rate=traces_sample_rate,
        # Integrations named, not auto-enabled: auto-enabling imports every installed
        # library it knows (botocore among them, some 5 MiB) just to look for it.
        auto_enabling_integrations=False,
        integrations=[
            LoggingIntegration(event_level=logging.ERROR),
            StarletteIntegration(),
            FastApiIntegration(),
        ],
    )


def flush(timeout: float = 2.0) -> None:
    client = sentry_sdk.get_client()
    if client.is_active():
        client.flush(timeout=timeout)
