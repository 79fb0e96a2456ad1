"""NATS access through nats-py (the JetStream job worker lives here).

For now: a connectivity check that reports the server's version and whether
JetStream is enabled, used by start-up and `/v1/status`.
"""

from __future__ import annotations

import logging

import nats
import nats.errors

log = logging.getLogger(__name__)


async def _log_quietly(exc: Exception) -> None:
    # nats-py's default callback logs every failed attempt at ERROR (and so to Sentry);
    # the caller reports the outcome once instead.
    log.debug("nats: %s", exc)


async def server_info(url: str, *, connect_timeout: float) -> dict[str, object]:
    """Connect once, read the server's version, ask JetStream, close; raises on failure.

    nats-py treats `max_reconnect_attempts=0` as "no limit" when picking a server, so a
    single attempt is spelled `1` here.
    """
    nc = await nats.connect(
        url,
        connect_timeout=connect_timeout,
        allow_reconnect=False,
        max_reconnect_attempts=1,
        reconnect_time_wait=0.1,
        error_cb=_log_quietly,
    )
    try:
        server = nc.connected_server_version
        version = f"{server.major}.{server.minor}.{server.patch}"
        jetstream = True
        try:
            await nc.jetstream(timeout=connect_timeout).account_info()
        except (nats.errors.Error, TimeoutError):
            jetstream = False
        return {"version": version, "jetstream": jetstream}
    finally:
        await nc.close()
