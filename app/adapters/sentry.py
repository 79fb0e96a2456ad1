"""Error tracking with sentry-sdk: route errors, and loop errors through the logging integration.

Scheduled loops log their failures with `log.exception`, which the logging
integration turns into Sentry events; routes are covered by the FastAPI integration.
Request bodies and headers are not sent (`send_default_pii=False`).
"""

from __future__ import annotations

import logging

import sentry_sdk
from sentry_sdk.integrations.atexit import AtexitIntegration
from sentry_sdk.integrations.dedupe import DedupeIntegration
from sentry_sdk.integrations.excepthook import ExcepthookIntegration
from sentry_sdk.integrations.fastapi import FastApiIntegration
from sentry_sdk.integrations.logging import LoggingIntegration
from sentry_sdk.integrations.starlette import StarletteIntegration
from sentry_sdk.integrations.threading import ThreadingIntegration

from app import __version__


def init(*, dsn: str, environment: str, traces_sample_rate: float) -> None:
    sentry_sdk.init(
        dsn=dsn,
        environment=environment,
        release=f"workload-manager@{__version__}",
        send_default_pii=False,
        traces_sample_rate=traces_sample_rate,
        # Integrations named, none by default: the auto-enabled ones import every
        # installed library they know just to look for it, and the default `stdlib` one
        # imports botocore (some 5 MiB, installed for the S3 version file) to patch it.
        # The manager makes no http.client or subprocess calls worth a breadcrumb.
        default_integrations=False,
        auto_enabling_integrations=False,
        integrations=[
            LoggingIntegration(event_level=logging.ERROR),
            StarletteIntegration(),
            FastApiIntegration(),
            ExcepthookIntegration(),
            ThreadingIntegration(),
            DedupeIntegration(),
            AtexitIntegration(),
        ],
    )


def flush(timeout: float = 2.0) -> None:
    client = sentry_sdk.get_client()
    if client.is_active():
        client.flush(timeout=timeout)
