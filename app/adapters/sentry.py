"""Error tracking with sentry-sdk: route errors, and loop errors through the logging integration.

Scheduled loops log their failures with `log.exception`, which the logging
integration turns into Sentry events; routes are covered by the FastAPI integration.
Request bodies and headers are not sent (`send_default_pii=False`), nor the frames' local
variables (`include_local_variables=False`). Every event and
transaction is redacted before it leaves (`_redacted`): each string in it (message and
its parameters, exception values, breadcrumbs, the request's URL and query, span
descriptions) goes through the one redaction of `app.domain.redaction`,
so no URL's password or token and no secret query parameter reaches Sentry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import sentry_sdk
from sentry_sdk.integrations.atexit import AtexitIntegration
from sentry_sdk.integrations.dedupe import DedupeIntegration
from sentry_sdk.integrations.excepthook import ExcepthookIntegration
from sentry_sdk.integrations.fastapi import FastApiIntegration
from sentry_sdk.integrations.logging import LoggingIntegration
from sentry_sdk.integrations.starlette import StarletteIntegration
from sentry_sdk.integrations.threading import ThreadingIntegration

from app import __version__
from app.domain.redaction import scrub

if TYPE_CHECKING:
    from sentry_sdk.types import Event, Hint


def init(*, dsn: str, environment: str, traces_sample_rate: float) -> None:
    sentry_sdk.init(
        dsn=dsn,
        environment=environment,
        release=f"workload-manager@{__version__}",
        send_default_pii=False,
        # no frame variables: a frame may hold a key, a token or a request's headers in a
        # form no redaction can recognise (bytes, objects)
        include_local_variables=False,
        traces_sample_rate=traces_sample_rate,
        before_send=_redacted,
        before_send_transaction=_redacted,
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


def _redacted(event: Event, _hint: Hint) -> Event:
    """The event with every string in it redacted (it is serialized by now: plain data)."""
    cleaned: dict[str, Any] = scrub(dict(event))
    return cleaned  # type: ignore[return-value]


def flush(timeout: float = 2.0) -> None:
    client = sentry_sdk.get_client()
    if client.is_active():
        client.flush(timeout=timeout)
